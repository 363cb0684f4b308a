"""The GGUF int8 dot-product matmul (kernels/cpu/gguf_q8.c through gguf_linear.py) and the GGUF
candidates of the CPU startup tuner (kernels/cpu/linear_tuning.py).

The kernel rounds x to int8 per block of 32 values (one fp32 scale each) and multiplies the
weights' integer codes with those. So it is checked twice: against dequantize-then-matmul on
the rounded x the kernel reports (`quantize_activations`, itself checked against a torch
reference of the rounding), which must agree to fp32 summation order; and against the true x
within the bound the rounding allows (|x - xq| <= scale / 2 per value, so each output is off
by at most sum |W| * scale / 2). Every type it takes, on every ISA path this machine runs
(AVX-512 VNNI, AVX-512 and AVX2 forced on an AVX-512 machine, generic), fp32 and bf16 x,
odd row counts (tiles of 4 end short), odd N, K an odd number of blocks (not a multiple of 256
for the 32-value formats: the blocks after the last group of 8 take their own path). And a
row's outputs must have the same bits alone and in any batch, on every path (row-invariance:
a request's tokens never depend on its batch)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model_server.kernels.cpu import isa as isa_mod
from model_server.kernels.cpu import linear_tuning, native
from model_server.kernels.cpu.gguf_linear import (
    INT8_DOT_ENV,
    Q8_TYPES,
    dequant_gemm,
    fixed_gguf_linear,
    gguf_gemm,
    gguf_q8_gemm,
    int8_dot_mode,
    q8_supports,
    quantize_activations,
)
from model_server.kernels.cpu.linear_tuning import (
    DEQUANT,
    GGUF_FLOAT,
    GGUF_Q8,
    tune_cpu_linears,
)
from model_server.kernels.cpu.tuning_cache import TuningCache, machine_identity
from model_server.kernels.linear_sites import LinearSite
from model_server.kernels.planned_weight import GGUFSegmentDispatch
from model_server.platforms import get_platform
from tests.kernels.gguf_packing import ALL_TYPES, block_shape, dequantize, random_blocks

RUNNABLE = [i.name for i in isa_mod.supported_isas(isa_mod.cpu_flags())]
TYPES = sorted(Q8_TYPES)
ROWS = [1, 3, 4, 5, 9, 17]  # 17: the column panels of the VNNI build (from 10 rows)
DTYPES = [torch.float32, torch.bfloat16]


def _kernels(isa: str) -> native.NativeKernels:
    kernels = native.load_kernels(isa)
    assert kernels is not None and kernels.isa == isa
    return kernels


def _case(qtype: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Random valid blocks [n, row_bytes], their fp32 values [n, k], and k: 11 blocks of 32
    (352: one group of 8 blocks, transposed, and 3 in order) or 3 super-blocks of 256."""
    elems, _ = block_shape(qtype)
    k = 3 * elems if elems == 256 else 11 * elems
    raw = random_blocks(qtype, n, k, seed)
    values = torch.from_numpy(dequantize(raw, qtype).reshape(n, k).astype(np.float32))
    return torch.from_numpy(raw), values, k


def _reference_rounding(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of 32: scale = max|x| / 127, codes = round-half-even(x * (1 / scale))."""
    m, k = x.shape
    blocks = x.float().view(m, k // 32, 32)
    scale = blocks.abs().amax(dim=2) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = torch.round(blocks * inv.unsqueeze(2)).to(torch.int8)
    return codes.view(m, k), scale


def _rounded_x(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    m, k = codes.shape
    return (codes.float().view(m, -1, 32) * scales.unsqueeze(2)).view(m, k)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_activation_rounding_is_the_reference(isa: str, dtype: torch.dtype) -> None:
    kernels = _kernels(isa)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 256, generator=gen) * torch.logspace(-3, 2, 256)).to(dtype)
    x[2, 32:64] = 0  # an all-zero block: scale 0, codes 0
    x[3, :32] = 1e-30  # tiny values (subnormal scale in fp32; bf16 keeps them normal)
    codes, scales = quantize_activations(x, kernels)
    want_codes, want_scales = _reference_rounding(x)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes, want_codes)
    assert codes.abs().max().item() <= 127 and scales[2, 1].item() == 0.0


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_q8_gemm_is_dequantize_then_matmul_on_the_rounded_x(
    isa: str, qtype: int, dtype: torch.dtype
) -> None:
    kernels = _kernels(isa)
    blocks, w, k = _case(qtype, 37, seed=qtype)
    gen = torch.Generator().manual_seed(qtype)
    bias = torch.randn(37, generator=gen).to(dtype)
    before = blocks.clone()
    for m in ROWS:
        x = torch.randn(m, k, generator=gen).to(dtype)
        codes, scales = quantize_activations(x, kernels)
        xq = _rounded_x(codes, scales)
        for b in (None, bias):
            got = gguf_q8_gemm(x, blocks, qtype, b, kernels)
            assert got.dtype == dtype and got.shape == (m, 37)
            want = F.linear(xq, w, None if b is None else b.float())
            scale = want.abs().max().item()
            # fp32: summation order only; bf16: the output rounded to bf16 (2^-9 relative)
            rel = 1e-5 if dtype == torch.float32 else 2**-8
            torch.testing.assert_close(got.float(), want, atol=rel * scale, rtol=rel)
            # Against the true x: within what rounding x can move each output.
            exact = F.linear(x.float(), w, None if b is None else b.float())
            step = scales.repeat_interleave(32, dim=1)  # [m, k]: each value's scale
            bound = (step / 2) @ w.abs().T  # [m, n]
            slack = rel * exact.abs().max().item()
            assert ((got.float() - exact).abs() <= bound + slack).all()
    assert torch.equal(blocks, before)  # inputs are never written


@pytest.mark.parametrize("qtype", TYPES)
def test_every_isa_and_thread_count_agree(qtype: int) -> None:
    """Each output is one thread's sum in a fixed order: 1 and 2 threads give equal bits;
    ISA paths differ only in fp32 summation order."""
    blocks, _, k = _case(qtype, 301, seed=7)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(2))
    results = {}
    before = torch.get_num_threads()
    try:
        for isa in RUNNABLE:
            kernels = _kernels(isa)
            outs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                outs.append(gguf_q8_gemm(x, blocks, qtype, None, kernels))
            assert torch.equal(outs[0], outs[1])
            results[isa] = outs[0]
    finally:
        torch.set_num_threads(before)
    first = next(iter(results.values()))
    for out in results.values():
        torch.testing.assert_close(out, first, atol=1e-5 * first.abs().max().item(), rtol=1e-5)


# Batch sizes crossing every path: 1-2 rows decode W in registers, more rows unpack each W row
# once (tiles of 4 end short), and from 10 rows the VNNI build's column panels (16 W rows,
# tiles of 4 x rows) take over.
BATCHES = [1, 2, 3, 5, 8, 13, 16, 33]


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_a_row_has_the_same_bits_alone_and_in_any_batch(
    isa: str, qtype: int, dtype: torch.dtype
) -> None:
    """Each row's activations are rounded on their own and every output summed in one order
    whatever the row count, the path (registers, row buffer, column panels) or the threads:
    a request's tokens never depend on its batch."""
    kernels = _kernels(isa)
    n = 45  # two panels and 13 columns: odd, short of a panel
    blocks, _, k = _case(qtype, n, seed=qtype + 100)
    gen = torch.Generator().manual_seed(qtype)
    x = torch.randn(max(BATCHES), k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    alone = torch.cat(
        [gguf_q8_gemm(x[i : i + 1], blocks, qtype, bias, kernels) for i in range(len(x))]
    )
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in BATCHES:
                for start in (0, len(x) - m):  # two different batches holding each row
                    got = gguf_q8_gemm(x[start : start + m], blocks, qtype, bias, kernels)
                    assert torch.equal(got, alone[start : start + m]), (m, start, threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", RUNNABLE)
def test_vnni_only_in_the_avx512_bf16_build(isa: str) -> None:
    # isa.py builds avx512_bf16 with -mavx512vnni (every CPU with avx512_bf16 has it).
    assert _kernels(isa).lib.wick_gguf_q8_has_vnni() == (isa == "avx512_bf16")


def test_types_without_an_integer_path_are_refused() -> None:
    kernels = native.load_kernels()
    assert kernels is not None
    for qtype in ALL_TYPES:
        assert q8_supports(qtype) == bool(kernels.lib.wick_gguf_q8_supports(qtype))
    blocks, _, k = _case(10, 4, seed=0)  # Q2_K
    with pytest.raises(ValueError, match="not supported"):
        gguf_q8_gemm(torch.randn(2, k), blocks, 10, None, kernels)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quantize_activations(torch.randn(2, 48), kernels)


# ---- the tuner ----------------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path: Path) -> TuningCache:
    return TuningCache.open(machine_identity(frozenset()), tmp_path)


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    class Quiet:
        def others_share(self) -> float:
            return 0.0

        def busy_machine(self) -> bool:
            return False

    monkeypatch.setattr(linear_tuning, "LoadWindow", Quiet)


def _force(monkeypatch: pytest.MonkeyPatch, winner_by_rows: dict[int, str]) -> list[set[str]]:
    """Replace the timer: every candidate runs once, and the one `winner_by_rows` names for
    the rows of its x (else the first) times fastest. Returns each call's candidate names."""
    offered: list[set[str]] = []

    def fake(calls, pair_budget_s=0.0):
        offered.append(set(calls))
        times = {}
        for name, call in calls.items():
            out = call()
            rows = out.shape[0]
            times[name] = 1.0 if name == winner_by_rows.get(rows, GGUF_Q8) else 2.0
        return times

    monkeypatch.setattr(linear_tuning, "time_candidates", fake)
    return offered


def _plan(
    sites: list[LinearSite], dtype: torch.dtype, cache: TuningCache, int8_dot: str = "auto"
) -> tuple[linear_tuning.TuningReport, GGUFSegmentDispatch]:
    """The tuner's report and its plans as the slot a planned GGUF weight runs (a segment the
    plans do not name runs the fixed choice)."""
    report, plans = tune_cpu_linears(sites, dtype, cache, int8_dot=int8_dot)
    by_segment = tuple(((p.site.ggml_type, p.site.weight.shape[0]), p.fns) for p in plans)
    return report, GGUFSegmentDispatch(by_segment, fixed_gguf_linear(int8_dot))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_the_tuner_plans_gguf_segments_per_bucket(
    monkeypatch: pytest.MonkeyPatch, cache: TuningCache, dtype: torch.dtype
) -> None:
    offered = _force(monkeypatch, {1: GGUF_Q8, 2: GGUF_Q8, 4: GGUF_FLOAT, 8: DEQUANT})
    q41, w41, k = _case(3, 40, seed=1)  # Q4_1: all three candidates
    q3k, _, k3 = _case(11, 24, seed=2)  # Q3_K: no integer path
    sites = [
        LinearSite(q41, 8, True, None, "a", ggml_type=3, k=k),
        LinearSite(q3k, 8, True, None, "b", ggml_type=11, k=k3),
    ]
    assert [site.matrix_shape() for site in sites] == [(40, k), (24, k3)]  # not the bytes
    report, gguf = _plan(sites, dtype, cache)
    assert report.timed == 2
    lines = sorted(report.lines)
    assert lines[0].startswith("gguf-q3_k-") and GGUF_Q8 not in lines[0]
    assert lines[1].startswith("gguf-q4_1-")
    assert "rows 1-2 gguf_q8, 3-4 gguf_float, 5-8 dequantize" in lines[1]
    assert {GGUF_Q8, GGUF_FLOAT, DEQUANT} in offered and {GGUF_FLOAT, DEQUANT} in offered
    bias = torch.randn(40).to(dtype)
    for rows in (1, 3, 8, 20):
        x = torch.randn(rows, k).to(dtype)
        got = gguf(x, q41, 3, bias)
        want = F.linear(x.float(), w41, bias.float())
        tol = 2e-2 * want.abs().max().item()  # int8 x / bf16 rounding
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=2e-2)
    # rows 1-2 ran the int8 kernel: its exact result
    x = torch.randn(2, k).to(dtype)
    assert torch.equal(gguf(x, q41, 3, None), gguf_q8_gemm(x, q41, 3, None))
    x = torch.randn(3, k).to(dtype)
    assert torch.equal(gguf(x, q41, 3, None), gguf_gemm(x, q41, 3, None))
    # an untuned shape runs the fixed choice
    other, wo, ko = _case(3, 8, seed=3)
    x = torch.randn(2, ko).to(dtype)
    tol = 2e-2 * wo.abs().max().item() * ko
    torch.testing.assert_close(gguf(x, other, 3, None).float(), x.float() @ wo.T, atol=tol, rtol=0)


def test_gguf_timings_are_cached(
    monkeypatch: pytest.MonkeyPatch, cache: TuningCache, tmp_path: Path
) -> None:
    offered = _force(monkeypatch, {})
    blocks, _, k = _case(8, 16, seed=4)
    site = LinearSite(blocks, 4, True, None, "q8", ggml_type=8, k=k)
    _plan([site], torch.float32, cache)
    timed = len(offered)
    again = TuningCache.open(cache.identity, tmp_path)
    report, _ = _plan([site], torch.float32, again)
    assert len(offered) == timed and report.cached == 1 and "(cached)" in report.lines[0]
    payload = json.loads(next((tmp_path / "cpu_tuning").glob("*.json")).read_text())
    assert any(key.startswith("linear/gguf-q8_0-float32/") for key in payload["entries"])


@pytest.mark.parametrize("int8_dot", ["on", "off"])
def test_int8_dot_on_and_off_pin_the_kernel(
    monkeypatch: pytest.MonkeyPatch, cache: TuningCache, int8_dot: str
) -> None:
    """on: the int8 kernel at every bucket whatever the timings; off: never offered, and its
    timings are cached under their own key."""
    offered = _force(monkeypatch, {1: GGUF_FLOAT, 2: DEQUANT, 4: DEQUANT})
    blocks, _, k = _case(12, 16, seed=5)  # Q4_K
    site = LinearSite(blocks, 4, True, None, "q4k", ggml_type=12, k=k)
    report, gguf = _plan([site], torch.float32, cache, int8_dot)
    x = torch.randn(3, k)
    if int8_dot == "on":
        assert "rows 1-4 gguf_q8" in report.lines[0]
        assert torch.equal(gguf(x, blocks, 12, None), gguf_q8_gemm(x, blocks, 12, None))
    else:
        assert all(GGUF_Q8 not in names for names in offered)
        assert report.lines[0].startswith("gguf-q4_k-noint8-float32")
        assert "rows 1 gguf_float, 2-4 dequantize" in report.lines[0]
        assert torch.equal(gguf(x, blocks, 12, None), dequant_gemm(x, blocks, 12, None))


def test_the_mode_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, mode in [("", "auto"), ("1", "on"), ("OFF", "off"), ("no", "off")]:
        monkeypatch.setenv(INT8_DOT_ENV, value)
        assert int8_dot_mode() == mode
    monkeypatch.setenv(INT8_DOT_ENV, "x")  # read as --gguf-int8-dot is: an error naming it
    with pytest.raises(ValueError, match=f"{INT8_DOT_ENV}='x' \\(--gguf-int8-dot\\)"):
        int8_dot_mode()
    platform = get_platform("cpu")
    blocks, _, k = _case(3, 8, seed=6)
    x = torch.randn(2, k)
    for mode, kernel in (("on", gguf_q8_gemm), ("off", gguf_gemm)):
        monkeypatch.setenv(INT8_DOT_ENV, mode)
        fixed = platform.kernel_table().gguf_linear  # weights without a plan run it
        assert torch.equal(fixed(x, blocks, 3, None), kernel(x, blocks, 3, None))
