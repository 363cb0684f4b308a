"""--kv-cache-dtype through the whole engine (tiny random checkpoints, CPU): the KV budget counts
the smaller bytes (codes + float32 scales), so the same --kv-cache-memory holds ~1.9x the
blocks of a bf16 cache at head_dim 64; every layer's cache (both pools of a sliding-window
model) gets the dtype; greedy tokens of a quantized cache stay those of the float cache on every
CPU attention backend; the cache shows in the startup log and `CacheConfigInfo`; what cannot
run is refused in one line. The real-model agreement figures: `wick bench kv-cache-dtype`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from model_server.engine.llm import LLM
from model_server.kernels.kv_cache_dtype import QuantizedKVCache, resolve_kv_cache_dtype
from model_server.platforms.gcu import GcuPlatform
from model_server.sampling_params import SamplingParams
from tests.engine.test_sliding_window import ENGINE_ARGS as SLIDING_ARGS
from tests.engine.test_sliding_window import PROMPT as SLIDING_PROMPT
from tests.engine.test_sliding_window import _save as save_sliding

# Llama with head_dim 64 and one KV head: a 16-token block of one layer is 2 x 16 x 64 values.
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
BUDGET = 1024**2
PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((5, 37, 18, 70))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("kvq")
    (folder / "config.json").write_text(json.dumps(TINY))
    return str(folder)


def _llm(folder: str, kv_cache_dtype: str, **kw) -> LLM:
    args = dict(
        load_format="dummy",
        dtype="bfloat16",
        kv_cache_memory=BUDGET,
        seed=1,
        num_threads=1,
        kv_cache_dtype=kv_cache_dtype,
    )
    args.update(kw)
    return LLM(folder, **args)


@pytest.mark.parametrize(
    ("kv_cache_dtype", "block_bytes"),
    [
        # 2 layers x 2 (k, v) x 16 tokens x 64 values x 2 bytes
        ("auto", 2 * 2 * 16 * 64 * 2),
        ("float16", 2 * 2 * 16 * 64 * 2),
        # codes (1 byte) plus one float32 scale per token and KV head
        ("int8", 2 * 2 * 16 * (64 + 4)),
        ("fp8_e4m3", 2 * 2 * 16 * (64 + 4)),
        ("fp8_e5m2", 2 * 2 * 16 * (64 + 4)),
    ],
)
def test_budget_counts_the_smaller_bytes(tiny, kv_cache_dtype, block_bytes, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="model_server.engine.engine_core"):
        llm = _llm(tiny, kv_cache_dtype)
    core = llm.engine.core
    assert core.model_runner.bytes_per_block() == block_bytes
    assert core.num_blocks == BUDGET // block_bytes
    info = llm.engine.cache_config_info
    name = "bfloat16" if kv_cache_dtype == "auto" else kv_cache_dtype
    assert (info.cache_dtype, info.num_gpu_blocks) == (name, core.num_blocks)
    assert info.kv_cache_bytes == core.num_blocks * block_bytes <= BUDGET
    assert f"KV cache: {core.num_blocks} blocks of 16 tokens" in caplog.text
    assert name in caplog.text
    cache = core.model_runner.kv_caches[0]
    if kv_cache_dtype in ("int8", "fp8_e4m3", "fp8_e5m2"):
        assert isinstance(cache, QuantizedKVCache)
        assert cache.data.dtype == resolve_kv_cache_dtype(kv_cache_dtype, torch.float32).storage
        assert cache.scales.shape == (2, core.num_blocks, 16, 1)
        assert cache.scales.dtype == torch.float32
    else:
        assert cache.dtype == (torch.float16 if kv_cache_dtype == "float16" else torch.bfloat16)


def test_int8_holds_nearly_twice_the_blocks_of_bf16(tiny) -> None:
    bf16 = _llm(tiny, "auto").engine.core.num_blocks
    int8 = _llm(tiny, "int8").engine.core.num_blocks
    assert int8 == BUDGET // (2 * 2 * 16 * 68) and bf16 == BUDGET // (2 * 2 * 16 * 128)
    assert 1.85 < int8 / bf16 < 2


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8", "fp8_e4m3"])
def test_greedy_tokens_match_the_float_cache(tiny, backend, kv_cache_dtype) -> None:
    """fp32 model, chunked prefill (16-token steps) over a quantized cache: the random tiny
    model's logits are far apart, so the cache's rounding keeps every greedy token."""
    kw = dict(dtype="float32", attention_backend=backend, max_num_batched_tokens=16)
    reference = _greedy(_llm(tiny, "auto", **kw))
    assert _greedy(_llm(tiny, kv_cache_dtype, **kw)) == reference


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_sliding_window_pool_gets_the_dtype_too(tmp_path: Path, backend: str) -> None:
    """Gemma 2 (sliding + global layers, soft caps): both pools quantized, and the window /
    soft-cap paths of each backend read the codes: its greedy tokens are transformers' (fp32
    model; the tiny model's logits are far apart)."""
    folder, expected = save_sliding("gemma2", tmp_path)
    llm = LLM(str(folder), attention_backend=backend, kv_cache_dtype="int8", **SLIDING_ARGS)
    runner = llm.engine.core.model_runner
    assert runner.kv_groups.sliding_layers and runner.kv_groups.full_layers
    kv = llm.engine.core.kv_cache_manager
    for i, cache in enumerate(runner.kv_caches):
        assert isinstance(cache, QuantizedKVCache) and cache.data.dtype == torch.int8
        pool = kv.sliding.num_blocks if i in runner.kv_groups.sliding_layers else kv.num_blocks
        assert cache.data.shape[1] == pool and cache.scales.shape[1] == pool
    params = SamplingParams(max_tokens=len(expected), temperature=0.0, ignore_eos=True)
    out = llm.generate([list(SLIDING_PROMPT)], params)
    assert list(out[0].outputs[0].token_ids) == expected


def test_latent_cache_refuses_quantization_in_one_line(tmp_path: Path) -> None:
    from tests.models.test_parity_moe import save_tiny

    save_tiny("deepseek_v2", tmp_path)
    with pytest.raises(ValueError, match=r"latent KV cache .* not quantized; use auto"):
        LLM(str(tmp_path), dtype="float32", kv_cache_dtype="int8", kv_cache_memory=BUDGET)


def test_platform_refuses_what_it_cannot_run() -> None:
    fp8 = resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16)
    with pytest.raises(ValueError, match="kv_cache_dtype fp8_e4m3 is not supported on gcu"):
        GcuPlatform().check_kv_cache_dtype(fp8)
    GcuPlatform().check_kv_cache_dtype(resolve_kv_cache_dtype("int8", torch.bfloat16))
    GcuPlatform().check_kv_cache_dtype(resolve_kv_cache_dtype("float16", torch.bfloat16))


def test_unknown_kv_cache_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp4' is not supported; choose one of"):
        from model_server.settings_spec import _check_kv_cache_dtype

        _check_kv_cache_dtype("fp4")
