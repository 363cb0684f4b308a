"""Speculative decoding in bfloat16: greedy output identical, token for token and logprob for
logprob, with speculation on and off (engine/spec_decode/row_invariance.py): a verification
chunk's attention is its decodes' attention (the metadata gives each query a sequence of its
own), on the embedded SmolLM2 over the bench's editing / RAG / chat prompts and on a tiny
random Llama."""

from __future__ import annotations

import json

import pytest
import torch

from model_server.benchmarks.copy_workloads import workload_requests
from model_server.config import SpeculativeConfig
from model_server.engine.execution.input_batch import SeqChunk, build_model_inputs
from model_server.engine.llm import LLM
from model_server.engine.spec_decode.row_invariance import verification_rows
from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.cpu.linear_tuning import PANELS
from model_server.layers.attention.cpu_backend import CpuAttentionBackend
from model_server.sampling_params import SamplingParams
from tests.kernels.helpers import force
from tests.lora.helpers import save_base

KV_CACHE = 64 * 1024**2
SPEC = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
)


def test_the_plan_keeps_every_row_count_of_a_verifying_step_row_invariant() -> None:
    # Up to disable_by_batch_size - 1 = 3 running requests (the default 4), each 1 + k rows.
    assert verification_rows(SpeculativeConfig.parse(SPEC)) == 3 * 5
    wide = json.loads(SPEC) | {"disable_by_batch_size": 9, "num_speculative_tokens": 2}
    assert verification_rows(SpeculativeConfig.parse(wide)) == 8 * 3
    assert verification_rows(None) == 0


def _chunks(attend_as_decodes: bool) -> list[SeqChunk]:
    # A decode, a verification chunk (its last token and 4 drafts) and a prefill chunk.
    return [
        SeqChunk([1, 2, 3, 4, 5], 40, list(range(0, 3)), attend_as_decodes=attend_as_decodes),
        SeqChunk([7], 20, list(range(3, 5))),
        SeqChunk([9] * 6, 0, [5]),
    ]


def test_a_verification_chunk_is_one_sequence_per_query_in_the_metadata() -> None:
    inputs = build_model_inputs(_chunks(True), 16)
    md = inputs.attn_metadata
    assert inputs.order == [0, 1, 2]  # decodes and verifications first
    assert md.query_start_loc_cpu == [0, 1, 2, 3, 4, 5, 6, 12]
    assert md.seq_lens_cpu == [41, 42, 43, 44, 45, 21, 6]
    assert md.num_decodes == 6 and md.max_query_len == 6
    assert md.block_tables[:5].tolist() == [[0, 1, 2]] * 5
    assert inputs.positions[:5].tolist() == [40, 41, 42, 43, 44]
    # One last-token index per chunk, not per attention sequence.
    assert inputs.last_token_indices.tolist() == [4, 5, 11]
    plain = build_model_inputs(_chunks(False), 16)
    assert plain.order == [1, 0, 2] and plain.attn_metadata.num_decodes == 1
    assert plain.attn_metadata.query_start_loc_cpu == [0, 1, 6, 12]


@pytest.mark.skipif(default_kernels() is None, reason="needs the native kernels")
def test_verified_rows_attend_exactly_as_their_decodes() -> None:
    """bf16, the CPU's paged attention: each row of a 5-query verification chunk equals the
    decode of its position bit for bit when it attends as decodes; the chunk's tiled path sums
    in another order and some rows differ (so the comparison can fail)."""
    heads, kv_heads, dim, block = 9, 3, 64, 16
    backend = CpuAttentionBackend(heads, kv_heads, dim, dim**-0.5)
    gen = torch.Generator().manual_seed(0)
    tiled_differs = 0
    for ctx in (37, 90, 250):
        total = ctx + 5
        blocks = list(range(-(-total // block)))
        k_cache = torch.zeros(len(blocks), block, kv_heads, dim, dtype=torch.bfloat16)
        v_cache = torch.zeros_like(k_cache)
        q = (3 * torch.randn(total, heads, dim, generator=gen)).bfloat16()
        k = (3 * torch.randn(total, kv_heads, dim, generator=gen)).bfloat16()
        v = torch.randn(total, kv_heads, dim, generator=gen).bfloat16()
        md = build_model_inputs([SeqChunk([0] * total, 0, blocks)], block).attn_metadata
        backend.forward(q, k, v, k_cache, v_cache, md)  # fills the caches
        decodes = []
        for j in range(5):
            md = build_model_inputs([SeqChunk([0], ctx + j, blocks)], block).attn_metadata
            p = ctx + j
            decodes.append(
                backend.forward(q[p : p + 1], k[p : p + 1], v[p : p + 1], k_cache, v_cache, md)
            )
        expected = torch.cat(decodes)
        for as_decodes in (True, False):
            md = build_model_inputs(
                [SeqChunk([0] * 5, ctx, blocks, attend_as_decodes=as_decodes)], block
            ).attn_metadata
            got = backend.forward(q[ctx:], k[ctx:], v[ctx:], k_cache, v_cache, md)
            if as_decodes:
                assert torch.equal(got, expected), f"context {ctx}"
            else:
                tiled_differs += int((got != expected).flatten(1).any(1).sum())
    assert tiled_differs > 0


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)


def _same(plain: LLM, spec: LLM, prompts: list[list[int]], max_tokens: int) -> None:
    for i, ids in enumerate(prompts):
        ref = plain.generate([ids], _greedy(max_tokens))[0].outputs[0]
        got = spec.generate([ids], _greedy(max_tokens))[0].outputs[0]
        assert got.token_ids == ref.token_ids, f"prompt {i}"
        assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in ref.logprobs]


def _pin_the_plan(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Both engines plan the same kernels: a timer that makes the (row-invariant) panels win
    everywhere, and a tuning cache of the test's own (timings cached by other runs, taken on a
    busy machine or another build, would plan the two engines apart)."""
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    force(monkeypatch, PANELS)


@pytest.mark.slow
def test_bf16_greedy_identical_on_the_embedded_model(monkeypatch, tmp_path) -> None:
    _pin_the_plan(monkeypatch, tmp_path)
    plain = LLM(kv_cache_memory=KV_CACHE, dtype="bfloat16")
    spec = LLM(kv_cache_memory=KV_CACHE, dtype="bfloat16", speculative_config=SPEC)
    prompts = [
        plain.apply_chat_template([{"role": "user", "content": r.prompt}])
        for workload in ("rag", "chat", "editing")
        for r in workload_requests(workload, 2, 96, 0, None)
    ]
    _same(plain, spec, prompts, 96)
    stats = spec.engine.core.scheduler.spec_decoding_stats
    assert stats.num_accepted_tokens > 0.3 * 96 * len(prompts) / 3  # the editing answers copy
    core = spec.engine.core
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks


def test_bf16_greedy_identical_on_a_tiny_random_model(monkeypatch, tmp_path) -> None:
    _pin_the_plan(monkeypatch, tmp_path)
    save_base(tmp_path, "llama")
    kw = dict(model=str(tmp_path), kv_cache_memory=8 * 1024**2, dtype="bfloat16")
    plain, spec = LLM(**kw), LLM(**kw, speculative_config=SPEC)
    gen = torch.Generator().manual_seed(0)
    # Prompts that repeat a phrase: the n-gram lookup finds drafts, some accepted.
    prompts = []
    for _ in range(4):
        phrase = torch.randint(3, 256, (6,), generator=gen).tolist()
        prompts.append(torch.randint(3, 256, (5,), generator=gen).tolist() + phrase * 4)
    _same(plain, spec, prompts, 48)
    assert spec.engine.core.scheduler.spec_decoding_stats.num_drafts > 0
