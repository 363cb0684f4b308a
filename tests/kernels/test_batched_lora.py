"""The Triton batched LoRA kernels (kernels/batched_lora.py, the CUDA table's `lora_add`) against
PyTorch's form (kernels/batched_lora_torch.py) and each row's own `StackedLoRA.delta`, and a tiny
Llama serving two adapters and the base model through either table.

The batch mixes decodes of three adapters and the base model, a long run of one adapter (a
prefill chunk: one of PyTorch's segments) and a base-model run, over row tiles of 16 (so tiles
hold several slots and some hold none). The fused layer has q/k/v-like slices of different
sizes, ranks below the maximum and different per slice (0: a slice the adapter leaves), one
slice of the full rank, and an empty slot some rows still name.

Tolerances: fp32 1e-5 (the sums run in another order: tiles of K, split partials); bf16 one
bf16 ulp of the result (2^-7 relative, and 2^-6 under the interpreter, which truncates fp32 ->
bf16 casts) plus, compiled, the TF32 dots 16-bit activations run (about 2^-11 relative per
operand; 4e-3 on the shrink's float32 output). Base-model rows are never written (equal bit for
bit).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from model_server.kernels.batched_lora import lora_add_triton, lora_expand, lora_shrink
from model_server.kernels.batched_lora_torch import LoRARows, lora_add_torch
from model_server.kernels.lora_weights import StackedLoRA
from model_server.kernels.table import KernelTable, triton_kernels

pytestmark = pytest.mark.kernels

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
IN = 40  # not a multiple of the K tile
SLICES = ((0, 24), (24, 8), (32, 8))  # q | k | v: 24 + 8 + 8 outputs
# slot -> rank per slice; slot 3 stays empty (all zeros), slot 4 is unused
RANKS = {0: (64, 4, 8), 1: (3, 0, 16), 2: (5, 5, 64)}
NUM_SLOTS = 5
# decodes of three adapters, the base model and the empty slot; a long run of slot 1 (a prefill
# chunk), a base-model prefill, more decodes, a long run of slot 2
ROW_SLOTS = [0, 1, -1, 2, 0, 3, -1, 1] + [1] * 12 + [-1] * 6 + [2, 0, 3] + [2] * 17
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-6, 2**-6)}


def _stacked(max_rank: int, dtype: torch.dtype, ranks: dict[int, tuple[int, ...]] = RANKS):
    """Random non-zero slots in the LoRA layer's layout (lora/layers.py's set_slot)."""
    gen = torch.Generator().manual_seed(0)
    n, out = len(SLICES), sum(size for _, size in SLICES)
    a = torch.zeros(NUM_SLOTS, n * max_rank, IN)
    b = torch.zeros(NUM_SLOTS, max_rank, out)
    rank_table = torch.zeros(NUM_SLOTS, n, dtype=torch.int32)
    for slot, slot_ranks in ranks.items():
        for i, ((offset, size), r) in enumerate(zip(SLICES, slot_ranks, strict=True)):
            a[slot, i * max_rank : i * max_rank + r] = torch.randn(r, IN, generator=gen) * 0.3
            b[slot, :r, offset : offset + size] = torch.randn(r, size, generator=gen) * 0.3
            rank_table[slot, i] = r
    return a.to(dtype), b.to(dtype), rank_table


def _on(device: str, a, b, ranks) -> StackedLoRA:
    return StackedLoRA(a.to(device), b.to(device), ranks.to(device), SLICES)


def _x(dtype: torch.dtype, device: str, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(len(ROW_SLOTS), IN, generator=gen).to(dtype=dtype, device=device)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOL[expected.dtype]
    if expected.dtype == torch.bfloat16 and not INTERPRETED:
        rtol, atol = 2**-7 + 2e-3, 2**-7 + 2e-3  # one rounding, TF32 dots
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize(
    ("dtype", "weights"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, None)],
    ids=["fp32", "bf16-fp32-slots", "bf16-bf16-slots"],
)
def test_shrink_gives_each_rows_slice_products(dtype, weights, split, device) -> None:
    """h summed over its splits: x A[slot, i R : i R + rank]^T in each slice's first columns,
    zeros after up to R, for every row of an adapter and every slice its adapter trains."""
    r = 64
    stacked = _on(device, *_stacked(r, weights or dtype))
    x = _x(dtype, device)
    rows = LoRARows.build(ROW_SLOTS, NUM_SLOTS, device)
    h = lora_shrink(x, rows.slots, stacked, split=split, block_k=16)
    assert h.shape == (split, len(ROW_SLOTS), len(SLICES) * r) and h.dtype == torch.float32
    h = h.sum(0).cpu()
    a, ranks = stacked.a.float().cpu(), stacked.ranks.cpu()
    tol = 1e-5 if dtype == torch.float32 or INTERPRETED else 4e-3  # compiled: TF32 dots
    checked = 0
    for row, slot in enumerate(ROW_SLOTS):
        if slot < 0:
            continue
        for i in range(len(SLICES)):
            rank = int(ranks[slot, i])
            if rank == 0:
                continue
            want = x[row].float().cpu() @ a[slot, i * r : i * r + rank].t()
            got = h[row, i * r : (i + 1) * r]
            torch.testing.assert_close(got[:rank], want, rtol=tol, atol=tol)
            assert torch.equal(got[rank:], torch.zeros(r - rank))
            checked += 1
    assert checked > 40


@pytest.mark.parametrize("max_rank", [64, 80])  # 80: two rank tiles of 64
@pytest.mark.parametrize(
    ("dtype", "weights"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, None)],
    ids=["fp32", "bf16-fp32-slots", "bf16-bf16-slots"],
)
def test_lora_add_equals_pytorch_form_and_each_rows_delta(dtype, weights, max_rank, device) -> None:
    ranks = dict(RANKS)
    if max_rank > 64:
        ranks[4] = (max_rank, 70, 1)
    stacked = _on(device, *_stacked(max_rank, weights or dtype, ranks))
    x = _x(dtype, device)
    out = _x(dtype, device, seed=2)
    rows = LoRARows.build([*ROW_SLOTS[:-1], 4], NUM_SLOTS, device)
    expected, actual = out.clone(), out.clone()
    lora_add_torch(x, expected, rows, stacked)
    lora_add_triton(x, actual, rows, stacked)
    assert actual.dtype == dtype
    _assert_close(actual, expected)
    # Each row against its own slot's product alone (PyTorch's form groups rows differently).
    for row, slot in enumerate(rows.host_slots):
        if slot < 0:
            assert torch.equal(actual[row], out[row])  # base-model rows untouched
            continue
        delta = stacked.delta(x[row : row + 1], slot)[0]
        _assert_close(actual[row], (out[row].float() + delta).to(dtype))
    assert not torch.equal(actual, out)


def test_split_partials_and_column_tiles_straddling_slices(device) -> None:
    """The expand sums the shrink's split partials and adds each slice's product in a column
    tile that straddles the q | k | v boundaries (16 columns: 24 is not a multiple)."""
    stacked = _on(device, *_stacked(16, torch.float32, {0: (16, 7, 2), 2: (1, 16, 9)}))
    x = _x(torch.float32, device)
    out = _x(torch.float32, device, seed=3)
    rows = LoRARows.build(ROW_SLOTS, NUM_SLOTS, device)
    expected, actual = out.clone(), out.clone()
    lora_add_torch(x, expected, rows, stacked)
    h = lora_shrink(x, rows.slots, stacked, split=3, block_k=16)
    lora_expand(h, actual, rows.slots, stacked, block_n=16)
    _assert_close(actual, expected)


def test_only_base_rows_or_no_rows_change_nothing(device) -> None:
    stacked = _on(device, *_stacked(16, torch.float32, {0: (16, 16, 16)}))
    x = _x(torch.float32, device)
    out = _x(torch.float32, device, seed=4)
    before = out.clone()
    lora_add_triton(x, out, LoRARows.build([-1] * len(ROW_SLOTS), NUM_SLOTS, device), stacked)
    assert torch.equal(out, before)
    empty = torch.empty(0, IN, device=device)
    lora_add_triton(
        empty, torch.empty(0, 40, device=device), LoRARows.build([], 5, device), stacked
    )


def test_bad_inputs_are_refused(device) -> None:
    stacked = _on(device, *_stacked(16, torch.float32, {0: (16, 16, 16)}))
    x = _x(torch.float32, device)
    slots = LoRARows.build(ROW_SLOTS, NUM_SLOTS, device).slots
    with pytest.raises(ValueError, match="slots"):
        lora_shrink(x, slots.long(), stacked)
    with pytest.raises(ValueError, match="x"):
        lora_shrink(x[:, :8], slots, stacked)
    h = lora_shrink(x, slots, stacked)
    with pytest.raises(ValueError, match="out"):
        lora_expand(h, torch.zeros(len(ROW_SLOTS), 39, device=device), slots, stacked)


def test_the_triton_table_runs_lora_add() -> None:
    assert triton_kernels().lora_add is lora_add_triton
    assert KernelTable().lora_add is lora_add_torch


# ---- a tiny Llama with adapters through the LoRA layers --------------------------------------


def test_tiny_llama_with_adapters_equals_the_portable_table(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, device: str
) -> None:
    """Two PEFT adapters (ranks 8 and 4, the second on q/v only) and the base model in one
    batch: the LoRA layers running the Triton `lora_add` give the tokens and logprobs of the same
    layers on PyTorch's form (every other kernel the platform's)."""
    pytest.importorskip("peft")
    from model_server.engine.llm import LLM
    from model_server.lora.request import LoRARequest
    from model_server.sampling_params import SamplingParams
    from tests.kernels.helpers import use_kernels
    from tests.lora.helpers import VOCAB, make_adapter, save_base

    save_base(tmp_path / "base", "llama")
    adapters = [
        make_adapter(tmp_path / "base", tmp_path / "a1", r=8, alpha=16, seed=1),
        make_adapter(
            tmp_path / "base", tmp_path / "a2", r=4, alpha=8, targets=["q_proj", "v_proj"], seed=2
        ),
    ]
    requests = [LoRARequest(f"a{i + 1}", i + 1, str(a.path)) for i, a in enumerate(adapters)]
    prompts = [[(7 * i + 3 * k + 1) % VOCAB for k in range(11 + i)] for i in range(3)]
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=3, ignore_eos=True)
    calls = {"triton": 0}

    def counted(*args) -> None:
        calls["triton"] += 1
        lora_add_triton(*args)

    results = []
    for lora_add in (lora_add_torch, counted):
        use_kernels(monkeypatch, lambda table, fn=lora_add: replace(table, lora_add=fn))
        llm = LLM(
            str(tmp_path / "base"),
            dtype="float32",
            device=device,
            max_model_len=64,
            block_size=8,
            kv_cache_memory=2 * 1024**2,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
        )
        runner = llm.engine.core.model_runner
        runner.native_step = None  # every step through the modules
        runner.lora_manager.batch.native = False  # their table's lora_add, not the CPU kernel
        try:
            outs = llm.generate(prompts, params, lora_request=[None, *requests])
            results.append([o.outputs[0] for o in outs])
        finally:
            llm.shutdown()
    assert calls["triton"] > 0
    for expected, actual in zip(*results, strict=True):
        assert actual.token_ids == expected.token_ids
        for e, a in zip(expected.logprobs, actual.logprobs, strict=True):
            assert [t for t, _ in a.top] == [t for t, _ in e.top]
            for (_, lp_a), (_, lp_e) in zip(a.top, e.top, strict=True):
                assert abs(lp_a - lp_e) < 1e-4
