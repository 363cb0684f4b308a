"""The bf16 matmul on panel-packed weights (kernels/cpu/panel_gemm.c, panel_gemm.py) against
F.linear, on this machine's best build: with AVX512-BF16 every register-tile shape (few, some
and many rows of x, a short last group of panels, odd K, N not a multiple of 16), bias, strided x
and both thread counts; without it, the kernel refuses (and the tuner leaves it out, see
test_cpu_linear.py). Also the tuner's cold timing: candidates sharing weight copies never read a
copy another one just brought into cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_server.kernels.cpu import linear_tuning
from model_server.kernels.cpu.panel_gemm import pack_panels, panel_linear, panels_available

AVAILABLE = panels_available()
# (M, N, K): 1-3 rows (four panels, two accumulator sets), 4-6 (four panels), 7+ (two panels, up
# to 12 rows per tile, several row tiles); N = 37: three panels, a short last group; K odd.
SHAPES = [(1, 576, 576), (2, 37, 33), (3, 100, 577), (5, 64, 64), (6, 200, 15), (7, 48, 1),
          (13, 37, 130), (40, 96, 577), (300, 17, 64)]  # fmt: skip


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """fp32 products and sums, rounded once to bf16 (the kernel's contract)."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("min_work", [0, 1 << 40], ids=["all-threads", "one-thread"])
def test_panel_matmul_equals_f_linear(m: int, n: int, k: int, bias: bool, min_work: int) -> None:
    torch.manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    # A slice of wider rows: the kernel reads x with its row stride.
    x = torch.randn(m, k + 5).bfloat16()[:, 2 : 2 + k]
    if not AVAILABLE:
        with pytest.raises(ValueError, match="AVX512-BF16"):
            pack_panels(w)
        return
    before = w.clone()
    got = panel_linear(x, pack_panels(w), b, min_work_per_thread=min_work)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16 and got.is_contiguous()
    assert torch.equal(w, before)
    want = _reference(x, w, b)
    # fp32 sums in another order: at most one bf16 step apart.
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=8e-3)


def test_panel_matmul_takes_3d_inputs_and_refuses_what_it_cannot_run() -> None:
    w = torch.randn(40, 24).bfloat16()
    if not AVAILABLE:
        with pytest.raises(ValueError):
            pack_panels(w)
        return
    panels = pack_panels(w)
    x = torch.randn(2, 3, 24).bfloat16()
    torch.testing.assert_close(
        panel_linear(x, panels).float(), _reference(x, w, None).float(), atol=1e-2, rtol=8e-3
    )
    with pytest.raises(ValueError, match="bf16"):
        pack_panels(w.float())
    with pytest.raises(ValueError, match=r"x must be bf16 \[M, 24\]"):
        panel_linear(torch.randn(2, 24), panels)
    with pytest.raises(ValueError, match=r"x must be bf16 \[M, 24\]"):
        panel_linear(torch.randn(2, 23).bfloat16(), panels)
    assert panel_linear(torch.empty(0, 24, dtype=torch.bfloat16), panels).shape == (0, 40)


@pytest.mark.parametrize(("readers", "copies"), [(4, 19), (5, 32), (2, 2), (6, 4)])
def test_readers_of_shared_copies_are_spread_round_them(readers: int, copies: int) -> None:
    """Each reader starts 1/R further round the copies, as the tuner builds them: within a
    round no two readers read the same copy (where there are as many copies as readers), and a
    copy is read again only after the readers read at least C - R other copies in between."""
    seen: list[int] = []
    rotations = [
        linear_tuning._Rotating(lambda x, w, b: seen.append(w), None, list(range(copies)), start)
        for start in (j * copies // readers for j in range(readers))
    ]
    for _ in range(3 * copies):
        for rotation in rotations:
            rotation()
    if copies >= readers:
        for r in range(0, len(seen), readers):
            assert len(set(seen[r : r + readers])) == readers
    last: dict[int, int] = {}
    for t, copy in enumerate(seen):
        if copy in last:
            assert t - last[copy] >= copies - readers
        last[copy] = t
