"""The matmuls on panel-packed weights (kernels/cpu/panel_gemm.c, panel_gemm_f32.c,
panel_gemm.py) against F.linear, on every ISA build this machine runs (AVX2 forced on AVX-512
machines), fp32 and bf16: every register-tile shape (few, some and many rows of x, a short last
group of panels, odd K, N not a multiple of the panel width), bias, strided x and both thread
counts. bf16 takes the vdpbf16ps pair layout where the build has AVX512-BF16, the fp32 lanes
elsewhere. Also the tuner's cold timing: candidates sharing weight copies never read a copy
another one just brought into cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_server.kernels.cpu import isa as isa_mod
from model_server.kernels.cpu import layer_ops, linear_tuning, native
from model_server.kernels.cpu.panel_gemm import (
    pack_panels,
    panel_linear,
    panel_linear_hwpf,
    panel_silu_and_mul,
    silu_and_mul_applies,
)

RUNNABLE = [i.name for i in isa_mod.supported_isas(isa_mod.cpu_flags())]
# (M, N, K): 1-2 rows, 3-6, 7+ (several row tiles); N = 37: a short last group of panels; N =
# 200: 13 panels (a wide tile of 8, a unit of 4, one panel); K odd.
SHAPES = [(1, 576, 576), (2, 37, 33), (2, 200, 33), (3, 100, 577), (5, 64, 64), (6, 200, 15),
          (7, 48, 1), (13, 37, 130), (40, 96, 577), (300, 17, 64)]  # fmt: skip
# fp32: sums in another order; bf16: one output rounding apart.
TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1e-2, "rtol": 8e-3},
}


@pytest.fixture(scope="module", params=RUNNABLE)
def kernels(request: pytest.FixtureRequest) -> native.NativeKernels:
    built = native.load_kernels(request.param)
    assert built is not None and built.lib.wick_isa().decode() == request.param
    return built


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """fp32 products and sums, rounded once to the dtype (the kernels' contract)."""
    out = F.linear(x.float(), w.float(), None if b is None else b.float())
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("min_work", [0, 1 << 40], ids=["all-threads", "one-thread"])
def test_panel_matmul_equals_f_linear(
    kernels: native.NativeKernels,
    dtype: torch.dtype,
    m: int,
    n: int,
    k: int,
    bias: bool,
    min_work: int,
) -> None:
    torch.manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    # A slice of wider rows: the kernels read x with its row stride.
    x = torch.randn(m, k + 5).to(dtype)[:, 2 : 2 + k]
    before = w.clone()
    panels = pack_panels(w, kernels)
    assert panels.pairs == (dtype == torch.bfloat16 and kernels.isa == "avx512_bf16")
    got = panel_linear(x, panels, b, kernels, min_work_per_thread=min_work)
    assert got.shape == (m, n) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(w, before)
    torch.testing.assert_close(got.float(), _reference(x, w, b).float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("m", [1, 2, 3, 16])
@pytest.mark.parametrize(("n", "k"), [(200, 577), (37, 130)])
def test_prefetch_or_not_the_pair_kernel_gives_the_same_bits(
    kernels: native.NativeKernels, m: int, n: int, k: int
) -> None:
    """The pair layout's kernel with and without software prefetch (the linear plan's
    native_panels / native_panels_hwpf): the same bits at 1, 2 (8-panel tiles), 3 (4-panel) and
    16 rows (12 x 2 tiles), with bias, and fused with the SiLU; one thread and all. The lanes
    layout has no such variant: asking for it raises (the tuner drops the candidate)."""
    torch.manual_seed(m * 7 + n)
    w = torch.randn(2 * 96, k).bfloat16() if n == 200 else torch.randn(n, k).bfloat16()
    b = torch.randn(w.shape[0]).bfloat16()
    x = torch.randn(m, k).bfloat16()
    panels = pack_panels(w, kernels)
    if not panels.pairs:
        with pytest.raises(ValueError, match="no variant without prefetch"):
            panel_linear_hwpf(x, panels, b, kernels)
        return
    for min_work in (0, 1 << 40):
        with_pf = panel_linear(x, panels, b, kernels, min_work, prefetch=True)
        without = panel_linear_hwpf(x, panels, b, kernels, min_work)
        assert torch.equal(with_pf, without)
        torch.testing.assert_close(
            without.float(), _reference(x, w, b).float(), **TOLERANCE[torch.bfloat16]
        )
        if silu_and_mul_applies(panels, kernels):
            fused = panel_silu_and_mul(x, panels, kernels, min_work, prefetch=True)
            assert torch.equal(fused, panel_silu_and_mul(x, panels, kernels, min_work, False))


def test_panel_matmul_takes_3d_inputs_and_refuses_what_it_cannot_run(
    kernels: native.NativeKernels,
) -> None:
    w = torch.randn(40, 24).bfloat16()
    panels = pack_panels(w, kernels)
    x = torch.randn(2, 3, 24).bfloat16()
    torch.testing.assert_close(
        panel_linear(x, panels, None, kernels).float(),
        _reference(x, w, None).float(),
        **TOLERANCE[torch.bfloat16],
    )
    with pytest.raises(ValueError, match="fp32 or bf16"):
        pack_panels(w.half(), kernels)
    with pytest.raises(ValueError, match=r"x must be torch.bfloat16 \[M, 24\]"):
        panel_linear(torch.randn(2, 24), panels, None, kernels)
    with pytest.raises(ValueError, match=r"x must be torch.bfloat16 \[M, 24\]"):
        panel_linear(torch.randn(2, 23).bfloat16(), panels, None, kernels)
    with pytest.raises(ValueError, match="bias must be"):
        panel_linear(torch.randn(2, 24).bfloat16(), panels, torch.randn(40), kernels)
    empty = panel_linear(torch.empty(0, 24, dtype=torch.bfloat16), panels, None, kernels)
    assert empty.shape == (0, 40)


# (M, inter, K): every register-tile shape, a short last group of gate panels, odd K.
FUSED_SHAPES = [(1, 16, 64), (2, 48, 577), (3, 1536, 576), (5, 32, 33), (7, 16, 1),
                (12, 64, 130), (13, 48, 64), (64, 1536, 576), (100, 32, 96)]  # fmt: skip


@pytest.mark.parametrize(("m", "inter", "k"), FUSED_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("min_work", [0, 1 << 40], ids=["all-threads", "one-thread"])
def test_fused_silu_equals_the_matmul_then_silu_and_mul(
    kernels: native.NativeKernels, m: int, inter: int, k: int, dtype: torch.dtype, min_work: int
) -> None:
    """The MLP's gate/up matmul with the SiLU in its epilogue, in both panel layouts: bit for
    bit the unfused pair (every register-tile shape, short last groups, odd K, strided x, a
    zero row of x: -0 and +0 alike)."""
    torch.manual_seed(m * 1000 + inter + k)
    w = torch.randn(2 * inter, k).to(dtype)
    x = torch.randn(m, k + 3).to(dtype)[:, 1 : 1 + k]
    x[0] = 0.0
    panels = pack_panels(w, kernels)
    assert silu_and_mul_applies(panels, kernels)  # 16 | inter: whole panels in every layout
    unfused = layer_ops.silu_and_mul(kernels, panel_linear(x, panels, None, kernels))
    fused = panel_silu_and_mul(x, panels, kernels, min_work_per_thread=min_work)
    assert fused.shape == (m, inter) and torch.equal(fused, unfused)


def test_fused_silu_refuses_what_it_cannot_run(kernels: native.NativeKernels) -> None:
    panels = pack_panels(torch.randn(2 * 18, 32).bfloat16(), kernels)  # halves not on a panel
    assert not silu_and_mul_applies(panels, kernels)
    with pytest.raises(ValueError, match="do not start on a panel boundary"):
        panel_silu_and_mul(torch.randn(2, 32).bfloat16(), panels, kernels)
    panels = pack_panels(torch.randn(64, 32).bfloat16(), kernels)
    with pytest.raises(ValueError, match=r"x must be torch.bfloat16 \[M, 32\]"):
        panel_silu_and_mul(torch.randn(2, 32), panels, kernels)
    empty = panel_silu_and_mul(torch.empty(0, 32, dtype=torch.bfloat16), panels, kernels)
    assert empty.shape == (0, 32)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_panel_matmul_is_row_invariant(kernels: native.NativeKernels, dtype: torch.dtype) -> None:
    """A row's output is the same bits whatever the rows of the call, the tile it falls in and
    the threads' split of the panels (linear_tuning.ROW_INVARIANT), fused SiLU included:
    speculative verification of k + 1 rows then computes each row as its one-row decode. bf16
    once summed 1-3 rows over two accumulator sets and 4+ over one, so 2-5 rows of 16
    differed."""
    torch.manual_seed(7)
    n, k = 416, 577  # 26 panels (13 gate panels): wide tiles, units, single panels; odd K
    panels = pack_panels(torch.randn(n, k).to(dtype), kernels)
    x = torch.randn(40, k).to(dtype)
    alone = torch.cat([panel_linear(x[i : i + 1], panels, None, kernels) for i in range(40)])
    fused_alone = torch.cat([panel_silu_and_mul(x[i : i + 1], panels, kernels) for i in range(40)])
    for m in (2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 40):
        for min_work in (0, 1 << 40):
            got = panel_linear(x[:m], panels, None, kernels, min_work_per_thread=min_work)
            assert torch.equal(got, alone[:m]), f"{m} rows, min_work {min_work}"
            fused = panel_silu_and_mul(x[:m], panels, kernels, min_work_per_thread=min_work)
            assert torch.equal(fused, fused_alone[:m]), f"fused, {m} rows, min_work {min_work}"
