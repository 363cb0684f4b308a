"""The CPU's tuned matmuls (kernels/cpu/linear_tuning.py): every candidate the tuner can pick,
at every row bucket, equals F.linear; the timings are cached on disk and a second start times
nothing; a corrupt cache is ignored; `--dtype auto` follows the flags and the (faked)
measurement. No test asserts on a timing: the timer is replaced where a choice is forced."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model_server.kernels import portable
from model_server.kernels.cpu import dtype_choice, isa, linear_tuning
from model_server.kernels.cpu.dtype_choice import AUTO_DTYPE_ENV, DtypeFigures
from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.cpu.linear import pack_onednn_weight
from model_server.kernels.cpu.linear_tuning import (
    BMM_SPLIT,
    DEQUANT,
    INT8_KERNEL,
    MM_T,
    NATIVE,
    PACKED,
    PANELS,
    PANELS_HWPF,
    ROW_BLOCKS,
    TORCH,
    TUNING_ENV,
    row_buckets,
)
from model_server.kernels.cpu.tuning_cache import TuningCache, machine_identity
from model_server.kernels.linear_sites import LinearSite
from model_server.kernels.planned_weight import PlannedWeight, bucket_index, bucket_ranges
from model_server.kernels.portable import int8_linear_dequant
from model_server.layers.quantization import Int8Weight
from model_server.platforms import cpu as cpu_platform
from model_server.platforms import get_platform
from tests.kernels.helpers import Planned, force, force_prefetch_split

AVX2_FLAGS = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2"
ZEN4_FLAGS = AVX2_FLAGS + " avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16"
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
ROWS = [1, 2, 3, 8, 13, 64, 100, 300]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the bmm split needs more than one thread
    yield
    torch.set_num_threads(before)


class FakeWindow:
    """Stands in for kernels/cpu/cpu_load.py's LoadWindow: other processes' share is fixed."""

    share = 0.0

    def others_share(self) -> float:
        return self.share

    def busy_machine(self) -> bool:
        return self.share > 0.25


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> type[FakeWindow]:
    """Timings count as taken on a quiet machine (so they are cached), whatever else runs."""
    window = type("Window", (FakeWindow,), {"share": 0.0})
    monkeypatch.setattr(linear_tuning, "LoadWindow", window)
    monkeypatch.setattr(dtype_choice, "LoadWindow", window)
    return window


@pytest.fixture
def cache(tmp_path: Path) -> TuningCache:
    return TuningCache.open(machine_identity(frozenset()), tmp_path)


def test_row_buckets() -> None:
    assert row_buckets(1) == (1,)
    assert row_buckets(5) == (1, 2, 4, 8)
    assert row_buckets(2048) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    buckets = row_buckets(2048)
    assert [buckets[bucket_index(r, len(buckets))] for r in (1, 2, 3, 5, 256, 257, 4000)] == [
        1, 2, 4, 8, 256, 256, 256,
    ]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("winner", [TORCH, MM_T, BMM_SPLIT, ROW_BLOCKS, NATIVE, PACKED, PANELS])
@pytest.mark.parametrize(("n", "k"), [(96, 48), (97, 33)])  # N odd (not split by 2), K odd
@pytest.mark.parametrize("bias", [False, True])
def test_every_candidate_equals_f_linear(
    monkeypatch: pytest.MonkeyPatch,
    cache: TuningCache,
    two_threads: None,
    dtype: torch.dtype,
    winner: str,
    n: int,
    k: int,
    bias: bool,
) -> None:
    # Row blocks only apply to large weights: make 5 rows of W "large".
    monkeypatch.setattr(linear_tuning, "_BLOCK_BYTES", 5 * k * 2)
    monkeypatch.setattr("model_server.kernels.cpu.linear._BLOCK_BYTES", 5 * k * 2)
    force(monkeypatch, winner)
    torch.manual_seed(n + k)
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    reference = w.clone()
    linear = Planned([LinearSite(w, 300, exclusive=True)], dtype, cache)
    for rows in ROWS:
        x = torch.randn(rows, k).to(dtype)
        got = linear(x, w, b)
        assert got.shape == (rows, n) and got.dtype == dtype and got.is_contiguous()
        want = F.linear(x.float(), reference.float(), None if b is None else b.float())
        torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype])
    # 3-D inputs go through the same plans; a weight without a plan runs the fixed table's.
    x3 = torch.randn(2, 3, k).to(dtype)
    want3 = F.linear(x3.float(), reference.float(), None if b is None else b.float())
    torch.testing.assert_close(linear(x3, w, b).float(), want3, **TOLERANCE[dtype])
    other = torch.randn(n, k).to(dtype)
    x = torch.randn(5, k).to(dtype)
    torch.testing.assert_close(
        linear(x, other).float(), F.linear(x.float(), other.float()), **TOLERANCE[dtype]
    )


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [(PACKED, torch.float32), (PANELS, torch.bfloat16)],
    ids=["onednn-fp32", "panels-bf16"],
)
def test_packed_exclusive_weight_is_relaid_out_in_place(
    monkeypatch: pytest.MonkeyPatch, cache: TuningCache, kind: str, dtype: torch.dtype
) -> None:
    """A packed kind winning everywhere: an exclusive weight's planned weight keeps the packed
    copy alone (no dense tensor: nothing is hollowed, and `dequantize` gives the matrix back
    exactly), a shared one keeps the dense tensor beside its copy and the extra bytes are
    reported. Without the native build the panels cannot pack, and both stay dense."""
    force(monkeypatch, kind)
    w = torch.nn.Parameter(torch.randn(64, 32).to(dtype), requires_grad=False)
    shared = torch.randn(64, 32).to(dtype)
    ref_w, ref_shared = w.detach().clone(), shared.clone()
    sites = [LinearSite(w, 16, exclusive=True), LinearSite(shared, 16, exclusive=False)]
    linear = Planned(sites, dtype, cache)
    report = linear.report
    packs = kind == PACKED or default_kernels() is not None
    planned_w, planned_shared = linear.weight_of(w), linear.weight_of(shared)
    assert isinstance(planned_w, PlannedWeight) and planned_w.shape == (64, 32)
    assert planned_w.dtype == dtype
    assert (planned_w.source is None) == packs  # the values moved into the packed copy
    assert torch.equal(w, ref_w)  # the tensor itself is never overwritten
    assert torch.equal(planned_w.dequantize(), ref_w)  # the truth, through the kernel
    assert planned_shared.source.data_ptr() == shared.data_ptr()  # the same bytes, kept
    assert torch.equal(shared, ref_shared)
    assert report.extra_bytes == (shared.numel() * shared.element_size() if packs else 0)
    names = {n for n, _ in planned_w.named_parameters()}
    assert names == (
        {"packed_data"} if packs and kind == PANELS else set() if packs else {"source"}
    )
    x = torch.randn(7, 32).to(dtype)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(linear(x, w).float(), F.linear(x, ref_w).float(), **tol)
    torch.testing.assert_close(linear(x, shared).float(), F.linear(x, shared).float(), **tol)
    assert any(f"{kind} [packed" in line for line in report.lines) == packs


def test_a_shared_weight_runs_its_packed_copy_wherever_it_beats_dense(
    monkeypatch: pytest.MonkeyPatch, cache: TuningCache
) -> None:
    """The tied LM head: panels win buckets 1-4 and get the one packed copy; at 8 rows oneDNN
    wins, but the panels still beat the best dense kernel there, so they run (not F.linear);
    at 16 rows F.linear beats the panels and runs."""
    per_bucket = [
        {PANELS: 1.0, PACKED: 2.0, TORCH: 2.0},
        {PANELS: 1.0, PACKED: 2.0, TORCH: 2.0},
        {PANELS: 1.0, PACKED: 2.0, TORCH: 2.0},
        {PANELS: 1.1, PACKED: 0.9, TORCH: 1.25},
        {PANELS: 1.2, PACKED: 0.9, TORCH: 1.0},
    ]

    def fake(calls, pair_budget_s=0.0):
        times = per_bucket[min(len(seen), len(per_bucket) - 1)]
        seen.append(1)
        return {name: times.get(name, 3.0) for name in calls}

    seen: list[int] = []
    monkeypatch.setattr(linear_tuning, "time_candidates", fake)
    shared = torch.randn(64, 32)
    report = Planned([LinearSite(shared, 16, exclusive=False)], torch.float32, cache).report
    assert len(seen) == len(per_bucket)
    if default_kernels() is None:  # the panels cannot pack: dense throughout
        return
    assert any(f"rows 1-8 {PANELS}, 9-16 {TORCH} [packed + dense" in line for line in report.lines)


@pytest.mark.parametrize(
    ("panels", "lm_head", "chosen"),
    [(1.05, False, PANELS), (1.3, False, PACKED), (1.05, True, PACKED)],
    ids=["decoder-near-tie", "decoder-clear-loss", "lm-head"],
)
def test_the_decoder_layers_keep_a_kernel_the_native_step_calls_unless_another_clearly_wins(
    monkeypatch: pytest.MonkeyPatch, cache: TuningCache, panels: float, lm_head: bool, chosen: str
) -> None:
    """oneDNN's packed kernel times 5 % faster than the panels at every bucket: a decoder
    layer's weight still runs the panels (a matmul without a native kernel would send the
    whole step through the modules; NATIVE_STEP_MARGIN), the LM head (outside the step) runs
    the faster kernel, and a kernel 30 % faster wins in the layers too."""
    if default_kernels() is None:  # the panels cannot pack without the native build
        pytest.skip("the native kernels did not build on this machine")

    def fake(calls, pair_budget_s=0.0):
        return {name: {PANELS: panels, PACKED: 1.0}.get(name, 3.0) for name in calls}

    monkeypatch.setattr(linear_tuning, "time_candidates", fake)
    dtype = torch.bfloat16
    try:
        pack_onednn_weight(torch.zeros(64, 32, dtype=dtype))
    except RuntimeError:  # oneDNN packs no bf16 without AVX-512 (or AVX-NE-CONVERT)
        dtype = torch.float32
    w = torch.nn.Parameter(torch.randn(64, 32).to(dtype), requires_grad=False)
    site = LinearSite(w, 16, exclusive=True, lm_head=lm_head)
    report = Planned([site], dtype, cache).report
    assert any(f"rows 1-16 {chosen} [packed]" in line for line in report.lines), report.lines


@pytest.mark.parametrize("shared", [False, True], ids=["exclusive", "shared"])
def test_speculation_keeps_the_verification_buckets_on_one_row_invariant_kernel(
    monkeypatch: pytest.MonkeyPatch, cache: TuningCache, shared: bool
) -> None:
    """F.linear wins every bucket by the timings; with `row_invariant_rows` 10 (speculative
    verification: up to 10 rows a step) the buckets holding 1-10 rows (1-16) run the panels
    (ROW_INVARIANT) instead and the plan's line says so: a shared weight keeps F.linear on the
    rest, an exclusive one moves its values into the panels (no second copy) and runs them at
    every bucket. Without it, F.linear throughout."""
    if default_kernels() is None:
        pytest.skip("the panels need the native build")

    def fake(calls, pair_budget_s=0.0):
        return {name: 1.0 if name == TORCH else 2.0 for name in calls}

    monkeypatch.setattr(linear_tuning, "time_candidates", fake)
    w = torch.randn(64, 32).bfloat16()
    site = LinearSite(w, 64, exclusive=not shared)
    plain = Planned([site], torch.bfloat16, cache)
    assert plain.plans[0].names == (TORCH,) * 7
    spec = Planned([site], torch.bfloat16, cache, row_invariant_rows=10)
    # buckets 1..16, then 32 and 64
    assert spec.plans[0].names == (PANELS,) * 5 + ((TORCH,) * 2 if shared else (PANELS,) * 2)
    assert any("rows 1-10 row-invariant" in line for line in spec.report.lines)
    assert {PANELS, PANELS_HWPF} == linear_tuning.ROW_INVARIANT
    x = torch.randn(13, 32).bfloat16()
    torch.testing.assert_close(spec(x, w).float(), F.linear(x, w).float(), **TOLERANCE[w.dtype])


@pytest.mark.parametrize("hwpf_rows", [0, 2, 64], ids=["prefetch", "split", "hardware"])
def test_the_tuner_chooses_the_panels_prefetch_per_bucket(
    monkeypatch: pytest.MonkeyPatch, cache: TuningCache, hwpf_rows: int
) -> None:
    """The panels with and without software prefetch are timed on the same packed copies; each
    bucket runs whichever timed faster (one packed copy, the values moved into it), the plan's
    line and kernel names say which, the fused SiLU takes the same choice per bucket, and the
    outputs are the same bits either way. Without the pair layout (no AVX512-BF16 build) the
    variant raises, is dropped, and the panels run throughout."""
    from model_server.kernels.cpu.panel_gemm import (
        pack_panels,
        pairs_available,
        panel_linear,
        panel_silu_and_mul,
    )

    if default_kernels() is None:
        pytest.skip("the panels need the native build")
    rows_seen = force_prefetch_split(monkeypatch, hwpf_rows)
    torch.manual_seed(hwpf_rows)
    w = torch.randn(64, 32).bfloat16()
    panels = pack_panels(w)
    linear = Planned([LinearSite(w, 16, exclusive=True)], torch.bfloat16, cache)
    assert rows_seen == [1, 2, 4, 8, 16]
    pairs = pairs_available()
    buckets = (1, 2, 4, 8, 16)
    want = tuple(PANELS_HWPF if pairs and b <= hwpf_rows else PANELS for b in buckets)
    plan = linear.plans[0]
    assert plan.names == want and plan.values_moved and plan.packed_kind == PANELS
    line = f"{bucket_ranges(want, open_end=False)} [packed]"
    assert any(line in text for text in linear.report.lines), linear.report.lines
    if pairs and hwpf_rows == 2:
        assert f"rows 1-2 {PANELS_HWPF}, 3-16 {PANELS} [packed]" in line
    planned = linear.weight_of(w)
    assert planned.kernel_names == want
    fused = planned.fused_silu_and_mul
    assert fused is not None and fused.args[1] == tuple(name == PANELS for name in want)
    for rows in (1, 2, 3, 16):
        x = torch.randn(rows, 32).bfloat16()
        assert torch.equal(linear(x, w), panel_linear(x, panels))
        assert torch.equal(planned.silu_and_mul(x), panel_silu_and_mul(x, panels))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_swiglu_mlp_fuses_its_silu_into_the_panels(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, dtype: torch.dtype
) -> None:
    """A SwiGLU MLP on the CPU platform's table, its planned weights installed: its gate/up
    matmul and SiLU-and-mul run as one kernel (either panel layout), and its output equals the
    unfused ops'. Rows of another dtype are never fused."""
    from model_server.engine.execution.kernel_tuning import linear_sites
    from model_server.engine.execution.model_preparation import install_planned_weights
    from model_server.models.decoder_parts import GatedMLP

    monkeypatch.setenv(TUNING_ENV, "1")
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path))
    force(monkeypatch, PANELS)
    platform = get_platform("cpu")
    table = platform.kernel_table()
    mlp = GatedMLP(64, 48, "silu", False, table).to(dtype)
    torch.manual_seed(0)
    for p in mlp.parameters():
        p.data = torch.randn(p.shape).to(dtype) / 8
    x = torch.randn(5, 64).to(dtype)
    gate_up = mlp.gate_up_proj.weight.detach().clone()
    down = mlp.down_proj.weight.detach().clone()
    expected = F.linear(portable.silu_and_mul_torch(F.linear(x, gate_up)), down)
    plan = platform.plan_linears(table, linear_sites(mlp, 16, 16), dtype)
    install_planned_weights(mlp, plan)
    assert set(plan.weights) == {"gate_up_proj", "down_proj"}
    planned = mlp.gate_up_proj.weight
    assert isinstance(planned, PlannedWeight)
    calls: list[int] = []
    fused_fn = planned.fused_silu_and_mul
    if fused_fn is not None:
        planned.fused_silu_and_mul = lambda *a: calls.append(1) or fused_fn(*a)
    out = mlp(x)
    assert calls == ([1] if default_kernels() is not None else [])
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])
    other = x.float() if dtype == torch.bfloat16 else x.bfloat16()
    assert planned.silu_and_mul(other) is None
    torch.testing.assert_close(planned.dequantize(), gate_up)


@pytest.mark.parametrize("winner", [INT8_KERNEL, DEQUANT])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_candidates_equal_the_portable_kernel(
    monkeypatch: pytest.MonkeyPatch, cache: TuningCache, winner: str, dtype: torch.dtype
) -> None:
    force(monkeypatch, winner)
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (97, 48), dtype=torch.int8)
    scale = (torch.rand(97) / 100).to(torch.bfloat16)
    holder = Int8Weight(q, scale)
    site = LinearSite(holder.qweight, 64, True, holder.scale, holder=holder)
    planned = Planned([site], dtype, cache).weight_of(holder.qweight)
    assert planned.source is holder and planned.kernel_names == (winner,) * 7
    for rows in (1, 5, 64, 70):
        x = torch.randn(rows, 48).to(dtype)
        b = torch.randn(97).to(dtype)
        # Both paths round x to bf16 or compute in x's dtype: compare at bf16 precision.
        torch.testing.assert_close(
            planned.apply(x, b).float(),
            int8_linear_dequant(x, q, scale, b).float(),
            atol=5e-2,
            rtol=2e-2,
        )


def test_the_cache_round_trips_and_a_second_start_times_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    counter = force(monkeypatch, MM_T)
    identity = machine_identity(frozenset({"avx2"}))
    w = torch.randn(40, 24)
    site = LinearSite(w, 32, exclusive=True)
    first = Planned([site], torch.float32, TuningCache.open(identity, tmp_path))
    report = first.report
    assert report.timed == 1 and report.cached == 0 and len(counter) == len(row_buckets(32))
    files = list((tmp_path / "cpu_tuning").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["identity"] == identity

    timed_before = len(counter)
    cache = TuningCache.open(identity, tmp_path)
    second = Planned([site], torch.float32, cache)
    report = second.report
    assert len(counter) == timed_before  # nothing timed
    assert report.timed == 0 and report.cached == 1 and "(cached)" in report.lines[0]
    assert "mm_t" in report.lines[0]
    x = torch.randn(3, 24)
    torch.testing.assert_close(second(x, w), first(x, w))
    # More rows than cached: the shape is timed again.
    Planned([LinearSite(w, 64, True)], torch.float32, cache)
    assert len(counter) == timed_before + len(row_buckets(64))
    # Another machine identity (thread count, torch, CPU) has its own file.
    other = TuningCache.open({**identity, "threads": "99"}, tmp_path)
    assert other.entries == {} and other.path != files[0]


@pytest.mark.parametrize(
    "content", ["{not json", json.dumps({"version": 0}), json.dumps([1, 2]), "\x00\xff"]
)
def test_a_corrupt_cache_file_is_ignored_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    content: str,
) -> None:
    counter = force(monkeypatch, TORCH)
    identity = machine_identity(frozenset())
    path = TuningCache.open(identity, tmp_path).path
    assert path is not None
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with caplog.at_level(logging.WARNING):
        cache = TuningCache.open(identity, tmp_path)
    assert len([r for r in caplog.records if "ignoring the CPU tuning cache" in r.message]) == 1
    w = torch.randn(8, 8)
    linear = Planned([LinearSite(w, 4, True)], torch.float32, cache)
    assert counter  # timed again, and the file rewritten valid
    assert json.loads(path.read_text())["entries"]
    x = torch.randn(2, 8)
    torch.testing.assert_close(linear(x, w), F.linear(x, w))


def _save_keys(root: str, identity: dict[str, str], prefix: str, count: int) -> None:
    """One process of the concurrent-save test: opens the cache once (as a rank does at start)
    and saves after every entry it adds."""
    cache = TuningCache.open(identity, Path(root))
    for i in range(count):
        cache.put(f"{prefix}/{i}", {"times": [i]})
        cache.save()


def test_concurrent_savers_each_add_their_entries(tmp_path: Path) -> None:
    """Two ranks open the cache before either has timed, then each saves its own shapes: the
    file holds both (the last writer used to drop the other's, which timed them again at every
    start); four processes saving 25 entries each at once lose none."""
    import multiprocessing

    identity = machine_identity(frozenset())
    rank0 = TuningCache.open(identity, tmp_path)
    rank1 = TuningCache.open(identity, tmp_path)
    rank0.put("linear/float32/640x576", {"times": [1]})
    rank1.put("linear/float32/320x576", {"times": [2]})
    rank1.save()
    rank0.save()
    merged = TuningCache.open(identity, tmp_path).entries
    assert set(merged) == {"linear/float32/640x576", "linear/float32/320x576"}
    assert rank0.changed == set() and set(rank0.entries) == set(merged)

    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_save_keys, args=(str(tmp_path), identity, f"p{n}", 25))
        for n in range(4)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    entries = TuningCache.open(identity, tmp_path).entries
    assert {f"p{n}/{i}" for n in range(4) for i in range(25)} <= set(entries)
    assert len(entries) == 102


def test_buckets_that_inherit_times_drop_kernels_their_rows_cannot_run(
    monkeypatch: pytest.MonkeyPatch, cache: TuningCache, two_threads: None
) -> None:
    """With no time budget every bucket after the first copies the one-row timings, where
    bmm_split (one row only) won: the larger buckets must not choose it (it used to crash any
    step with 2-16 rows on a busy or slow machine)."""
    force(monkeypatch, BMM_SPLIT)
    w = torch.randn(64, 40)
    linear = Planned([LinearSite(w, 16, True)], torch.float32, cache, budget_s=0.0)
    report = linear.report
    assert "budget spent: 2+ rows inherit" in report.lines[0]
    assert "): rows 1 bmm_split, 2-16 " in report.lines[0]
    for rows in (1, 2, 3, 16):
        x = torch.randn(rows, 40)
        torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_timings_from_a_busy_machine_are_used_but_not_cached(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, quiet_machine: type[FakeWindow]
) -> None:
    counter = force(monkeypatch, MM_T)
    quiet_machine.share = 0.6
    identity = machine_identity(frozenset({"avx2"}))
    w = torch.randn(40, 24)
    linear = Planned([LinearSite(w, 4, True)], torch.float32, TuningCache.open(identity, tmp_path))
    report = linear.report
    assert report.busy and report.others_share == 0.6 and "mm_t" in report.lines[0]
    assert not list(tmp_path.glob("cpu_tuning/*.json"))  # nothing written
    x = torch.randn(3, 24)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    timed = len(counter)
    quiet_machine.share = 0.0  # the next start times again, and caches
    cache = TuningCache.open(identity, tmp_path)
    report = Planned([LinearSite(w, 4, True)], torch.float32, cache).report
    assert len(counter) > timed and not report.busy and report.timed == 1
    assert list(tmp_path.glob("cpu_tuning/*.json"))


def test_the_load_window_counts_our_own_children_as_ours() -> None:
    """A child we run and wait for (the compiler building the native kernels) is not a busy
    neighbour."""
    import subprocess
    import sys

    from model_server.kernels.cpu.cpu_load import LoadWindow, _own_seconds

    # Spins for 0.5 s of its own CPU time (not wall time: neighbours may slow it down). What
    # is checked is the accounting, not the machine's quiet: the child's CPU time is counted
    # as ours, so it is subtracted from the busy time that makes `others_share` (the test once
    # compared the share itself with a bound, and failed whenever other jobs ran beside it).
    window = LoadWindow()
    spin = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)
    assert _own_seconds() - window.own >= 0.5
    assert 0.0 <= window.others_share() <= 1.0


def test_the_load_window_sees_another_process_busy() -> None:
    """The real LoadWindow: another process spinning on one core for the whole window counts as
    others' use (at least half a core's share, for scheduler noise). Read before the spinner is
    reaped: until then it is not one of our children (whose time is ours)."""
    import subprocess
    import sys

    from model_server.kernels.cpu.cpu_load import LoadWindow, _num_cpus

    window = LoadWindow()
    spin = "import time\nend = time.perf_counter() + 0.6\nwhile time.perf_counter() < end: pass"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    time.sleep(0.8)
    share = window.others_share()
    assert proc.wait() == 0
    assert share >= 0.5 / _num_cpus()


def test_a_timing_on_part_of_the_cores_leaves_the_rest_to_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tensor-parallel rank times on its share of the node's cores while the other ranks time
    theirs: their load on the other cores is expected, not a busy machine. On all the cores,
    a quarter of the machine busy elsewhere is the limit; on one of four, the other three
    cores plus a quarter of ours."""
    from model_server.kernels.cpu import cpu_load

    monkeypatch.setattr(cpu_load, "_num_cpus", lambda: 4)

    def busy(threads: int, share: float) -> bool:
        window = cpu_load.LoadWindow(threads=threads)
        monkeypatch.setattr(cpu_load.LoadWindow, "others_share", lambda self: share)
        return window.busy_machine()

    assert not busy(4, 0.25) and busy(4, 0.26)
    assert not busy(2, 0.6) and busy(2, 0.65)  # two ranks of two threads: 0.5 + 0.125
    assert not busy(1, 0.8) and busy(1, 0.82)  # 0.75 + 0.0625
    assert not busy(8, 0.25) and busy(8, 0.26)  # more threads than cores: all of them
    assert cpu_load.LoadWindow().threads == torch.get_num_threads()


def test_a_malformed_entry_is_timed_again(
    monkeypatch: pytest.MonkeyPatch, cache: TuningCache
) -> None:
    counter = force(monkeypatch, TORCH)
    cache.put("linear/float32/8x8", {"buckets": [1, 2, 4], "times": ["x", None, 3]})
    Planned([LinearSite(torch.randn(8, 8), 4, True)], torch.float32, cache)
    assert len(counter) == 3


def test_the_real_timer_drops_failing_candidates_and_keeps_the_minimum() -> None:
    calls = {"ok": lambda: None, "fails": lambda: 1 / 0}
    times = linear_tuning.time_candidates(calls)
    assert set(times) == {"ok"} and times["ok"] >= 0


def test_the_table_is_one_immutable_table_and_tuning_off_plans_nothing(
    monkeypatch: pytest.MonkeyPatch, cache: TuningCache
) -> None:
    """Every model shares the CPU's one table (the fixed matmuls serve weights without a plan);
    what a weight runs is its planned weight's business. Tuning off: no plan at all."""
    platform = get_platform("cpu")
    monkeypatch.delenv(TUNING_ENV, raising=False)  # on unless turned off
    table = platform.kernel_table()
    assert platform.kernel_table() is table
    fixed_matmuls = (cpu_platform.skinny_linear, cpu_platform.int8_linear)
    assert (table.linear, table.int8_linear) == fixed_matmuls
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.linear = F.linear  # type: ignore[misc]
    force(monkeypatch, TORCH)
    site = LinearSite(torch.randn(8, 8), 4, True, module="proj")
    monkeypatch.setenv("WICK_CACHE_DIR", str(cache.path.parent.parent if cache.path else "."))
    assert set(platform.plan_linears(table, [site], torch.float32).weights) == {"proj"}
    monkeypatch.setenv(TUNING_ENV, "0")
    assert platform.kernel_table() is table
    assert platform.plan_linears(table, [site], torch.float32).weights == {}


# ---- --dtype auto ---------------------------------------------------------------------------

SHAPES = [(960, 576, 30), (576, 576, 30), (49152, 576, 1)]


def fake_figures(monkeypatch: pytest.MonkeyPatch, bf16_faster: bool) -> list[int]:
    calls: list[int] = []

    def measure(shapes):
        calls.append(1)
        fast, slow = 1.0, 2.0
        bf16 = fast if bf16_faster else slow
        fp32 = slow if bf16_faster else fast
        return DtypeFigures(fp32, bf16, fp32, bf16)

    monkeypatch.setattr(dtype_choice, "measure_dtype_speed", measure)
    return calls


@pytest.fixture
def isolated_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)
    monkeypatch.setenv(TUNING_ENV, "1")  # --dtype auto measures only with tuning on
    return tmp_path


@pytest.mark.parametrize("stored", [None, torch.float32, torch.float16])
def test_auto_without_native_bf16_is_fp32_without_measuring(
    monkeypatch: pytest.MonkeyPatch, isolated_cache: Path, stored: torch.dtype | None
) -> None:
    """Without native bf16, a checkpoint not stored in bf16 (a float32 or float16 one, a
    quantized one: None) runs fp32, nothing timed."""
    calls = fake_figures(monkeypatch, bf16_faster=True)
    monkeypatch.setenv(isa.CPU_FLAGS_ENV, AVX2_FLAGS)
    assert get_platform("cpu").resolve_dtype("auto", SHAPES, None, stored) == torch.float32
    monkeypatch.setenv(AUTO_DTYPE_ENV, "bfloat16")  # a measured winner cannot add the flags
    assert get_platform("cpu").resolve_dtype("auto", SHAPES, None, stored) == torch.float32
    assert calls == []


@pytest.mark.parametrize("bf16_faster", [True, False])
def test_auto_without_native_bf16_measures_a_bf16_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
    isolated_cache: Path,
    caplog: pytest.LogCaptureFixture,
    bf16_faster: bool,
) -> None:
    """A checkpoint stored in bf16 on an AVX2 CPU: the native panels read its bf16 weights (half
    fp32's bytes), so the measurement decides; without shapes or tuning the flags do (fp32)."""
    calls = fake_figures(monkeypatch, bf16_faster)
    monkeypatch.setenv(isa.CPU_FLAGS_ENV, AVX2_FLAGS)
    platform = get_platform("cpu")
    expected = torch.bfloat16 if bf16_faster else torch.float32
    with caplog.at_level(logging.INFO):
        assert platform.resolve_dtype("auto", SHAPES, None, torch.bfloat16) == expected
    assert any("the native panels' bf16 weights" in r.message for r in caplog.records)
    assert platform.resolve_dtype("auto", (), None, torch.bfloat16) == torch.float32
    assert len(calls) == 1
    monkeypatch.setenv(AUTO_DTYPE_ENV, "bfloat16")  # stands in for the measurement here too
    assert platform.resolve_dtype("auto", SHAPES, None, torch.bfloat16) == torch.bfloat16
    assert len(calls) == 1


@pytest.mark.parametrize("bf16_faster", [True, False])
def test_auto_with_native_bf16_follows_the_measurement(
    monkeypatch: pytest.MonkeyPatch,
    isolated_cache: Path,
    caplog: pytest.LogCaptureFixture,
    bf16_faster: bool,
) -> None:
    calls = fake_figures(monkeypatch, bf16_faster)
    monkeypatch.setenv(isa.CPU_FLAGS_ENV, ZEN4_FLAGS)
    platform = get_platform("cpu")
    expected = torch.bfloat16 if bf16_faster else torch.float32
    with caplog.at_level(logging.INFO):
        assert platform.resolve_dtype("auto", SHAPES) == expected
    assert any(r.message.startswith("dtype auto: ") for r in caplog.records)
    assert platform.resolve_dtype("auto", SHAPES) == expected  # cached: measured once
    assert len(calls) == 1
    assert platform.resolve_dtype("float32", SHAPES) == torch.float32  # pinned dtypes are kept
    assert platform.resolve_dtype("bfloat16", SHAPES) == torch.bfloat16


def test_auto_on_a_busy_machine_takes_bf16_on_the_flags_and_times_again(
    monkeypatch: pytest.MonkeyPatch,
    isolated_cache: Path,
    caplog: pytest.LogCaptureFixture,
    quiet_machine: type[FakeWindow],
) -> None:
    calls = fake_figures(monkeypatch, bf16_faster=False)  # what a busy neighbour can make it
    monkeypatch.setenv(isa.CPU_FLAGS_ENV, ZEN4_FLAGS)
    quiet_machine.share = 0.6
    with caplog.at_level(logging.INFO):
        assert get_platform("cpu").resolve_dtype("auto", SHAPES) == torch.bfloat16
    assert any("busy" in r.message for r in caplog.records if r.levelno == logging.WARNING)
    quiet_machine.share = 0.0  # nothing was cached: a quiet start measures, and follows it
    assert get_platform("cpu").resolve_dtype("auto", SHAPES) == torch.float32
    assert len(calls) == 2


@pytest.mark.parametrize(
    ("forced", "expected"), [("bf16", torch.bfloat16), ("float32", torch.float32)]
)
def test_auto_dtype_env_stands_in_for_the_measurement(
    monkeypatch: pytest.MonkeyPatch, isolated_cache: Path, forced: str, expected: torch.dtype
) -> None:
    calls = fake_figures(monkeypatch, bf16_faster=expected != torch.bfloat16)
    monkeypatch.setenv(isa.CPU_FLAGS_ENV, ZEN4_FLAGS)
    monkeypatch.setenv(AUTO_DTYPE_ENV, forced)
    assert get_platform("cpu").resolve_dtype("auto", SHAPES) == expected and calls == []


def test_the_real_dtype_measurement_runs_on_small_shapes(
    isolated_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both dtypes are timed with the tuner's candidates, the native panels among them, cold
    (every call reads the next of the weight's copies)."""
    timed: list[set[str]] = []
    real = dtype_choice.time_candidates

    def spy(calls: dict, budget: float) -> dict:
        timed.append(set(calls))
        return real(calls, budget)

    monkeypatch.setattr(dtype_choice, "time_candidates", spy)
    figures = dtype_choice.measure_dtype_speed([(64, 32, 2), (16, 32, 1)])
    assert figures.fp32_decode_s > 0 and figures.bf16_prefill_s > 0
    assert "bf16" in figures.describe()
    assert len(timed) == 4  # two shapes x two row counts, both dtypes in each call
    if default_kernels() is not None:
        assert {"fp32/native_panels", "bf16/native_panels", "fp32/torch"} <= timed[0]


def test_int8_kernel_with_k_not_a_multiple_of_16_does_not_crash() -> None:
    """torch's int8 pack kernel segfaults at K % 16 != 0 with several rows (DeepSeek's tiny
    q_lora_rank 24 under --quantization int8): the candidate dequantizes there instead."""
    from model_server.kernels.cpu.linear import int8_kernel_linear

    gen = torch.Generator().manual_seed(0)
    qweight = torch.randint(-127, 127, (96, 24), dtype=torch.int8, generator=gen)
    scale = torch.rand(96, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, 24, generator=gen)
    expected = int8_linear_dequant(x, qweight, scale, None)
    got = int8_kernel_linear(x, qweight, scale, None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_each_native_build_keeps_its_own_timings(tmp_path: Path) -> None:
    # WICK_CPU_ISA=avx2 on an AVX512-BF16 CPU runs other kernels (lanes panels, no variant
    # without prefetch): timings of the avx512_bf16 build must not choose its kernels.
    flags = frozenset({"avx2", "avx512f", "avx512_bf16"})
    wide, narrow = machine_identity(flags, "avx512_bf16"), machine_identity(flags, "avx2")
    assert wide["isa"] == "avx512_bf16" and narrow["isa"] == "avx2"
    a, b = TuningCache.open(wide, tmp_path), TuningCache.open(narrow, tmp_path)
    a.put("k", {"times": [1.0]})
    a.save()
    assert TuningCache.open(wide, tmp_path).get("k") is not None
    assert b.get("k") is None and TuningCache.open(narrow, tmp_path).get("k") is None
