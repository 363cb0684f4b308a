"""Sliding-window models through the whole engine: the sliding layers' KV lives in a pool of its
own and a request holds only its window's blocks there, while its tokens equal transformers'.

Tiny Gemma 2 / Gemma 3 / Phi-3 checkpoints (window 8, blocks of 4 tokens, saved as real HF
folders) generate 32 greedy tokens after a 40-token prompt, with chunked prefill (16-token
budget). After every decode step the request's sliding block table holds at most
window / block_size + 1 real blocks (the rest are the null block) while its full-attention table
covers the whole context; at the end both pools are entirely free again.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers

from model_server.engine.core.kv_cache_manager import NULL_BLOCK
from model_server.engine.llm import LLM
from model_server.sampling_params import RequestOutputKind, SamplingParams
from tests.models.test_parity_families import CONFIGS, WINDOW

BLOCK_SIZE = 4
PROMPT = [(13 * i + 7) % 256 for i in range(40)]
NUM_NEW = 32
ENGINE_ARGS = dict(
    dtype="float32",
    max_model_len=128,
    block_size=BLOCK_SIZE,
    kv_cache_memory=2 * 1024**2,
    max_num_batched_tokens=16,
    max_num_seqs=4,
)


def _save(name: str, root: Path) -> tuple[Path, list[int]]:
    torch.manual_seed(0)
    config = CONFIGS[name]()
    if name.startswith("phi3"):
        # Past the original context transformers' Phi-3 recomputes the whole sequence with the
        # long factors (its generate drops the cache there); Wick keeps the short factors for
        # the positions below it, so this run stays within the short ones.
        config.original_max_position_embeddings = 128
        config.rope_parameters["original_max_position_embeddings"] = 128
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith(".bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * (0.1 if "norm" in pname else 0.02))
        config = transformers.GenerationConfig(
            do_sample=False, max_new_tokens=NUM_NEW, eos_token_id=None, pad_token_id=0
        )
        expected = hf.generate(torch.tensor([PROMPT]), generation_config=config)
    folder = root / name
    hf.save_pretrained(folder, safe_serialization=True)
    return folder, expected[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize(
    ("name", "backend"),
    [("gemma2", "torch"), ("gemma3", "cpu"), ("phi3_longrope_window", "cpu")],
)
def test_sliding_layers_hold_only_the_window(name: str, backend: str, tmp_path: Path) -> None:
    folder, expected = _save(name, tmp_path)
    llm = LLM(str(folder), attention_backend=backend, **ENGINE_ARGS)
    core = llm.engine.core
    kv = core.kv_cache_manager
    assert kv.sliding is not None and kv.sliding.window == WINDOW
    runner = core.model_runner
    groups = runner.kv_groups
    # The sliding layers' caches are the sliding pool's size, the others the full pool's.
    for i, cache in enumerate(runner.kv_caches):
        pool = kv.sliding.num_blocks if i in groups.sliding_layers else kv.num_blocks
        assert cache.shape[1] == pool
    if groups.full_layers:  # Phi-3 slides on every layer: no full-attention cache at all
        assert kv.sliding.num_blocks < kv.num_blocks

    params = SamplingParams(
        max_tokens=NUM_NEW,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    llm.engine.add_request("0", list(PROMPT), dataclasses.replace(params))
    tokens: list[int] = []
    max_context_checked = 0
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            tokens += out.outputs[0].token_ids
        for req in core.scheduler.running:
            held = [b for b in req.sliding_block_ids if b != NULL_BLOCK]
            full = req.block_ids
            assert len(full) == len(req.sliding_block_ids)
            if req.num_computed_tokens > len(PROMPT):  # decoding
                assert 1 <= len(held) <= WINDOW // BLOCK_SIZE + 1
                assert len(full) >= req.num_computed_tokens // BLOCK_SIZE
                assert kv.num_free_sliding_blocks == kv.sliding.num_blocks - 1 - len(held)
                max_context_checked = req.num_computed_tokens
    # Checked up to the step before the last (which finishes the request): 70 tokens computed,
    # 18 full-attention blocks against at most 3 sliding ones.
    assert max_context_checked == len(PROMPT) + NUM_NEW - 2
    assert tokens == expected
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.num_free_sliding_blocks == kv.sliding.num_blocks - 1
