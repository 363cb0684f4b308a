"""Scheduling must never change what a greedy request generates, for the families beyond Llama.

Tiny random checkpoints (test_parity_families.py's configs, saved as HF folders) through the
whole engine in fp32, where tokens must be equal exactly: batched == alone, prefix cache on ==
off (with real hits, a shared 24-token prefix), small chunks == whole prefills, and preempted ==
not (a KV budget too small for the batch). Gemma 2 and Gemma 3 have sliding-window layers shorter
than the prompts, so their second KV cache group (window-sized blocks, its own prefix cache) is
under every invariant; GLM-4 and Phi-2 cover the other layer layouts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from model_server.engine.llm import LLM
from model_server.sampling_params import SamplingParams
from tests.models.test_parity_families import CONFIGS

pytestmark = pytest.mark.slow

NAMES = ["gemma2", "gemma3", "glm4", "phi2"]
PREFIX = [(5 * i + 11) % 256 for i in range(24)]
PROMPTS = [PREFIX + [(7 * i + j) % 256 for j in range(3 + 2 * i)] for i in range(6)] + [
    [(13 * j + 1) % 256 for j in range(30)],
    [(3 * j + 2) % 256 for j in range(9)],
]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
BASE = dict(dtype="float32", max_model_len=128, block_size=4, max_num_seqs=8)
ROOMY = 4 * 1024**2


@pytest.fixture(scope="module", params=NAMES)
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]())
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith(".bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * (0.1 if "norm" in pname else 0.02))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    return path


def _run(folder: Path, prompts: list[list[int]], **overrides: object) -> tuple[list, LLM]:
    llm = LLM(str(folder), **{**BASE, "kv_cache_memory": ROOMY, **overrides})
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)], llm


@pytest.fixture(scope="module")
def reference(folder: Path) -> list[list[int]]:
    """Each prompt alone, no prefix cache, whole prefills, room for everything."""
    return [
        _run(folder, [p], enable_prefix_caching=False, max_num_batched_tokens=256)[0][0]
        for p in PROMPTS
    ]


def test_batched_equals_alone(folder: Path, reference: list[list[int]]) -> None:
    tokens, _ = _run(folder, PROMPTS, enable_prefix_caching=False, max_num_batched_tokens=256)
    assert tokens == reference
    assert all(len(t) == 24 for t in tokens)


def test_prefix_cache_hits_change_nothing(folder: Path, reference: list[list[int]]) -> None:
    # The first prompt fills the cache; the others then hit its shared prefix.
    _, llm = _run(folder, PROMPTS[:1])
    later = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[1:], PARAMS)]
    kv = llm.engine.core.kv_cache_manager
    assert kv.prefix_cache_hits >= 5 * 20  # five later prompts reuse at least 20 tokens each
    assert later == reference[1:]


def test_small_chunks_equal_whole_prefills(folder: Path, reference: list[list[int]]) -> None:
    tokens, _ = _run(folder, PROMPTS, enable_prefix_caching=False, max_num_batched_tokens=8)
    assert tokens == reference


def test_preemption_changes_nothing(folder: Path, reference: list[list[int]]) -> None:
    runner_bytes = 2 * 4 * 2 * 16 * 4  # one block of one layer: K and V, 2 KV heads of 16, fp32
    tokens, llm = _run(
        folder, PROMPTS, kv_cache_memory=40 * 2 * runner_bytes, max_num_batched_tokens=32
    )
    assert llm.engine.core.scheduler.num_preemptions_total > 0
    assert tokens == reference
