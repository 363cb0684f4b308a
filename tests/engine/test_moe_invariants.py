"""Scheduling never changes what a greedy request generates, for the mixture-of-experts families
too (tiny random HF checkpoints from tests/models/test_parity_moe.py, whole engine, fp32, the
CPU platform's default "cpu" attention backend; DeepSeek's latent attention runs its PyTorch
path there): batched == alone, prefix cache on == off (with hits), 8-token chunks == whole
prefill, forced preemption == none. And DeepSeek's paged cache holds the latent: its KV bytes
per token are exactly num_layers * (kv_lora_rank + qk_rope_head_dim) * 4 in fp32.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from model_server.engine.llm import LLM
from model_server.sampling_params import SamplingParams
from tests.models.test_parity_moe import MOE_CONFIGS, save_tiny

pytestmark = pytest.mark.slow

ARGS = dict(dtype="float32", max_model_len=96, block_size=4, num_threads=1)
KV_CACHE = 4 * 1024**2
MAX_TOKENS = 16
SHARED = [(5 * i + 1) % 250 for i in range(13)]  # a 13-token shared prefix (3 full blocks)
PROMPTS = [
    [(7 * i + 3) % 250 for i in range(11)],
    [(11 * i + 5) % 250 for i in range(23)],
    [(13 * i + 2) % 250 for i in range(6)],
    [*SHARED, 17, 33, 9],
    [*SHARED, 4, 249],
]


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, _greedy())]


@pytest.fixture(scope="module", params=list(MOE_CONFIGS))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, path)
    return path


@pytest.fixture(scope="module")
def alone(folder: Path) -> list[list[int]]:
    llm = LLM(str(folder), kv_cache_memory=KV_CACHE, enable_prefix_caching=False, **ARGS)
    return [_tokens(llm, [p])[0] for p in PROMPTS]


def test_batch_equals_alone(folder: Path, alone: list[list[int]]) -> None:
    llm = LLM(str(folder), kv_cache_memory=KV_CACHE, enable_prefix_caching=False, **ARGS)
    assert _tokens(llm, PROMPTS) == alone
    assert all(len(t) == MAX_TOKENS for t in alone)


def test_prefix_cache_on_equals_off(folder: Path, alone: list[list[int]]) -> None:
    llm = LLM(str(folder), kv_cache_memory=KV_CACHE, enable_prefix_caching=True, **ARGS)
    first = _tokens(llm, PROMPTS[3:4])
    kv = llm.engine.core.kv_cache_manager
    hits = kv.prefix_cache_hits
    second = _tokens(llm, PROMPTS[4:5])
    assert kv.prefix_cache_hits > hits  # the shared prefix came from the cache
    assert first + second == alone[3:5]
    assert _tokens(llm, PROMPTS[3:4]) == alone[3:4]  # a repeat, almost all cached


def test_small_chunks_equal_whole_prefill(folder: Path, alone: list[list[int]]) -> None:
    llm = LLM(
        str(folder),
        kv_cache_memory=KV_CACHE,
        enable_prefix_caching=False,
        max_num_batched_tokens=8,
        **ARGS,
    )
    assert _tokens(llm, PROMPTS) == alone


def test_forced_preemption_equals_no_preemption(folder: Path, alone: list[list[int]]) -> None:
    probe = LLM(str(folder), kv_cache_memory=KV_CACHE, **ARGS)
    per_block = probe.engine.core.model_runner.bytes_per_block()
    # 16 blocks of 4 tokens: the five requests (up to 39 tokens each) cannot all run at once.
    small = LLM(str(folder), kv_cache_memory=16 * per_block, enable_prefix_caching=False, **ARGS)
    assert small.engine.core.num_blocks == 16
    assert _tokens(small, PROMPTS) == alone
    assert small.engine.core.scheduler.num_preemptions_total > 0


def test_deepseek_kv_bytes_per_token_are_the_latent(folder: Path) -> None:
    llm = LLM(str(folder), kv_cache_memory=KV_CACHE, **ARGS)
    runner = llm.engine.core.model_runner
    config = runner.hf_config
    layers = config.num_hidden_layers
    per_token = runner.bytes_per_block() // ARGS["block_size"]
    if not config.model_type.startswith("deepseek"):
        # K and V of every KV head, for comparison.
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        assert per_token == layers * 2 * config.num_key_value_heads * head_dim * 4
        return
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    assert per_token == layers * latent * 4
    full_kv = 2 * config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)
    assert per_token < layers * full_kv * 4  # what per-head K/V would have cost
    assert [tuple(c.shape[1:]) for c in runner.kv_caches] == [(4, latent)] * layers
