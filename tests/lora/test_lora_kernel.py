"""The CPU's batched LoRA kernel (kernels/cpu/lora.c through kernels/cpu/lora.py) against
PyTorch's per-slot product (StackedLoRA.delta): fused slices, ranks below R and up to 64, rows of
several adapters interleaved with base-model rows, fp32 and bf16, any thread count."""

from __future__ import annotations

import pytest
import torch

from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.cpu.lora import lora_add, lora_struct
from model_server.kernels.lora_weights import StackedLoRA

pytestmark = pytest.mark.skipif(default_kernels() is None, reason="no native CPU build")


def _stacked(
    k: int,
    sizes: list[int],
    max_loras: int,
    max_rank: int,
    ranks: list[list[int]],
    seed: int = 0,
    weights: torch.dtype = torch.float32,
) -> StackedLoRA:
    """Random slots: slot s's slice i of rank ranks[s][i] (0: not trained), zeros elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    n_slices, n = len(sizes), sum(sizes)
    a = torch.zeros(max_loras, n_slices * max_rank, k)
    b = torch.zeros(max_loras, max_rank, n)
    offsets = [sum(sizes[:i]) for i in range(n_slices)]
    for s in range(max_loras):
        for i, r in enumerate(ranks[s]):
            a[s, i * max_rank : i * max_rank + r] = torch.randn(r, k, generator=gen) * 0.1
            b[s, :r, offsets[i] : offsets[i] + sizes[i]] = torch.randn(r, sizes[i], generator=gen)
    ranks_t = torch.tensor(ranks, dtype=torch.int32)
    return StackedLoRA(
        a.to(weights), b.to(weights), ranks_t, tuple(zip(offsets, sizes, strict=True))
    )


def _reference(stacked: StackedLoRA, x: torch.Tensor, y: torch.Tensor, slots: list[int]):
    out = y.float().clone()
    for t, s in enumerate(slots):
        if s >= 0:
            out[t] += stacked.delta(x[t : t + 1], s)[0]
    return out


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("sizes", "max_rank", "ranks"),
    [
        ([64, 32, 32], 16, [[8, 8, 8], [4, 0, 4], [16, 16, 16]]),  # q | k | v, q/v only
        ([200, 200], 8, [[8, 8], [0, 0], [3, 5]]),  # gate | up; an empty slot
        ([48], 64, [[64], [1], [33]]),  # down / o; rank 64
    ],
)
def test_the_kernel_adds_each_rows_adapter(dtype, weights, sizes, max_rank, ranks) -> None:
    k = 96
    stacked = _stacked(k, sizes, 3, max_rank, ranks, weights=weights)
    slots = [0, -1, 2, 0, 1, -1, 2, 2, 0, 1, 0]
    m, n = len(slots), sum(sizes)
    x = torch.randn(m, k).to(dtype)
    y = torch.randn(m, n).to(dtype)
    expected = _reference(stacked, x, y, slots)
    got = y.clone()
    lora_add(default_kernels(), x, got, torch.tensor(slots, dtype=torch.int32),
             lora_struct(stacked))  # fmt: skip
    base_rows = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(got[base_rows], y[base_rows])  # the base model's rows untouched
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # one rounding of the fp32 sum: at most one bf16 step from the exact one
        torch.testing.assert_close(got.float(), expected, rtol=8e-3, atol=1e-2)
    # An adapter changes its rows (a test that cannot fail proves nothing).
    trained = [t for t, s in enumerate(slots) if s >= 0 and sum(ranks[s]) > 0]
    assert (got[trained].float() - y[trained].float()).abs().max() > 0.01


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_the_bits_do_not_depend_on_the_thread_count(weights: torch.dtype) -> None:
    ranks = [[32, 32], [8, 8], [16, 0], [32, 4]]
    stacked = _stacked(512, [512, 1024], 4, 32, ranks, weights=weights)
    slots = torch.tensor([3, 0, 1, 2, -1, 0] * 6, dtype=torch.int32)
    x = torch.randn(len(slots), 512).bfloat16()
    y0 = torch.randn(len(slots), 1536).bfloat16()
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            y = y0.clone()
            lora_add(default_kernels(), x, y, slots, lora_struct(stacked))
            outs.append(y)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], y0)


def test_bad_slots_and_shapes_are_refused() -> None:
    stacked = _stacked(16, [8], 2, 4, [[4], [2]])
    lora = lora_struct(stacked)
    x, y = torch.randn(3, 16), torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="outside"):
        lora_add(default_kernels(), x, y, torch.tensor([0, 2, -1], dtype=torch.int32), lora)
    with pytest.raises(ValueError, match="16 inputs and 8 outputs"):
        lora_add(default_kernels(), torch.randn(3, 15), y, torch.zeros(3, dtype=torch.int32), lora)
    with pytest.raises(ValueError, match="token slots"):
        lora_add(default_kernels(), x, y, torch.zeros(3, dtype=torch.int64), lora)
    with pytest.raises(ValueError, match="tile"):
        StackedLoRA(stacked.a, stacked.b, stacked.ranks, ((1, 8),))


@pytest.mark.parametrize("split", ["slots", "columns"])
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_its_place_nor_on_the_threads(weights, dtype, split) -> None:
    """k and the slices not multiples of any vector width (the shrink's k tail; the expand's
    columns fall in a vector with one thread and in the scalar tail with two) and odd ranks:
    each row's result equals the same row's alone, in any order and thread count. Four adapters
    of equal work (two threads take two slots each), or one adapter's rows, more than one pass
    of the kernel (64; the threads split A's rows, then y's columns)."""
    if split == "slots":
        ranks, m = [[5, 16, 3]] * 4, 60
        slots = torch.tensor([0, 1, 2, 3, -1] * (m // 5), dtype=torch.int32)
    else:
        ranks, m = [[5, 16, 3], [16, 0, 7]], 150
        slots = torch.tensor([0, 0, -1, 0, 0] * (m // 5), dtype=torch.int32)
    stacked = _stacked(100, [40, 72, 24], len(ranks), 16, ranks, weights=weights)
    lora = lora_struct(stacked)
    lora.min_work_per_thread = 0  # every call on all the threads it is given
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, 100, generator=gen).to(dtype)
    y0 = torch.randn(m, 136, generator=gen).to(dtype)
    perm = torch.randperm(m, generator=gen)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            y = y0.clone()
            lora_add(default_kernels(), x, y, slots, lora)
            outs.append(y)
            y = y0[perm].clone()
            lora_add(default_kernels(), x[perm].contiguous(), y, slots[perm].contiguous(), lora)
            outs.append(torch.empty_like(y).index_copy_(0, perm, y))
        torch.set_num_threads(1)
        alone = y0.clone()
        for t in range(0, m, 7):  # a few rows, each the only row of its call
            lora_add(default_kernels(), x[t : t + 1], alone[t : t + 1], slots[t : t + 1], lora)
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    for t in range(0, m, 7):
        assert torch.equal(alone[t], outs[0][t])
    expected = _reference(stacked, x, y0, slots.tolist())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(outs[0].float(), expected, rtol=tol, atol=tol)
    assert not torch.equal(outs[0], y0)
