"""CPU matmuls chosen for the machine at startup: `tune_cpu_linears` times the candidate
kernels of every linear weight's shape on this CPU, at this thread count, in this dtype, and
returns one `SitePlan` per weight (a kernel per row bucket); the model-preparation stage turns
them into `PlannedWeight`s (kernels/planned_weight.py, kernels/cpu/linear_plan.py).

Why: which matmul is fastest differs by CPU (MKL picks slow kernels on AMD; oneDNN's prepacked
weights win on AVX-512 but not everywhere), by dtype, by shape and by row count. Rows are
bucketed to the next power of two (1, 2, 4, ..., 256; more rows use the 256 bucket).

Candidates (kernels/cpu/linear.py): F.linear (torch's own BLAS/oneDNN choice), `W @ x^T`, the
one-row bmm split, `W @ x^T` in blocks of rows, up to NATIVE_MAX_ROWS rows the native skinny
matmul (kernels/cpu/gemm.py, where its library builds), and two kernels on a weight re-laid out
once (PACKED_KINDS): oneDNN with a prepacked weight, and in bf16 on AVX512-BF16 builds the
native panel matmul (kernels/cpu/panel_gemm.py), timed with and without its software prefetch
(PACKED_VARIANTS: the same packed copy, so a weight's panels run either at each row bucket);
for int8 weights PyTorch's int8 kernel and
dequantize-then-matmul; for GPTQ/AWQ (wNa16) weights the native kernel that dequantizes in
registers (kernels/cpu/wna16_gemm.c) and blocked dequantize-then-matmul; for GGUF weights kept
in their blocks (`CpuGGUFLinear`, the table's `gguf_linear`) the int8 dot-product kernel
(kernels/cpu/gguf_q8.c), the float kernel (gguf_gemm.c) and chunked dequantize-then-matmul. A
candidate that raises is dropped (debug log).

GGUF weights under `--gguf-weights auto` (`blocks_beside_float`): each kept weight is also
timed as its float twin (the dequantized matrix, the float candidates above); per row bucket
the weight runs whichever is faster, its blocks on their float kernel (gguf_gemm.c: the blocks'
values times x, no int8 rounding, so the output does not hinge on the row count) or the twin.
Blocks win at few rows, where a decode streams weights, if at all; a weight whose blocks win
nowhere keeps only the twin, one whose twin wins nowhere only its blocks (`BlocksBesideFloat`).

Memory: a packed weight holds the same bytes in another layout. Where only the layer reads the
weight (`LinearSite.exclusive`) and one packed kind at every bucket beats the best dense kernel
per bucket, that kind's copy takes the values' place (`SitePlan.values_moved`: the planned
weight keeps the copy alone, and gives the matrix back through it), so memory does not grow.
A weight another module reads (a tied embedding) keeps its dense values; it is packed as well
(one kind) only where packed wins, and that extra memory is logged.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from model_server.kernels.cpu.cpu_load import LoadWindow
from model_server.kernels.cpu.gemm import gemm_applies, gemm_linear
from model_server.kernels.cpu.gguf_linear import (
    dequant_gemm,
    gguf_gemm,
    gguf_q8_gemm,
    q8_supports,
)
from model_server.kernels.cpu.linear import (
    _BLOCK_BYTES,
    bmm_row_split,
    bmm_row_split_applies,
    dequantized_linear,
    int8_kernel_linear,
    mm_transposed,
    onednn_packed_linear,
    pack_onednn_weight,
    row_blocks,
)
from model_server.kernels.cpu.panel_gemm import (
    Panels,
    pack_panels,
    panel_linear,
    panel_linear_hwpf,
)
from model_server.kernels.cpu.tuning_cache import TuningCache
from model_server.kernels.cpu.wna16 import (
    wna16_dequantized_linear,
    wna16_native_linear,
)
from model_server.kernels.gguf_blocks import type_name
from model_server.kernels.linear_sites import LinearSite
from model_server.kernels.planned_weight import bucket_ranges
from model_server.kernels.table import GGUFLinearFn, Int8LinearFn, LinearFn, WNA16LinearFn
from model_server.settings_spec import SETTINGS_BY_NAME, resolve_setting

logger = logging.getLogger(__name__)

# --cpu-linear-tuning (settings_spec.py; KernelOptions.linear_tuning), whose variable this is:
# on unless off; then the fixed kernels of kernels/cpu/linear.py, nothing timed. Timings taken
# while other processes kept the machine busy (kernels/cpu/cpu_load.py) are used for that start
# only, never cached: on a 2-core box under another job's load the plans
# favoured single-thread kernels (fp32 batch-1 decode 24-26 tok/s against the fixed table's 35).
TUNING_ENV = "WICK_CPU_LINEAR_TUNING"
# Seconds of timing at most per start (all shapes together; --cpu-linear-tuning-budget); buckets
# left untimed take the choice of the largest timed one.
BUDGET_ENV = "WICK_CPU_LINEAR_TUNING_BUDGET_S"
DEFAULT_BUDGET_S: float = SETTINGS_BY_NAME["cpu_linear_tuning_budget"].unset
# Timing of one (shape, bucket): interleaved rounds of every live candidate until about this
# long, 2 to 10 rounds after the first call (more rounds: more chances of a quiet moment on a
# shared machine).
PAIR_BUDGET_S = 0.03
MIN_ROUNDS, MAX_ROUNDS = 2, 10
# Another candidate replaces F.linear only when at least this much faster: near-ties are noise,
# and switching kernels between neighbouring buckets for nothing makes the plan hard to read.
MARGIN = 0.03
# A candidate this many times slower than the best on its first call is not timed further.
DOMINATED = 3.0
MAX_BUCKET = 256
# The decode tricks (W @ x^T, the bmm split, row blocks) only for this few rows.
SKINNY_MAX_ROWS = 64
# The native skinny matmul only for this few rows. On a 2-thread Zen 4 with SmolLM2's shapes, W
# streamed from memory (docs/benchmarks.md): bf16 1.5-2.2x F.linear and 1.2-1.8x oneDNN's packed
# kernel at 1-8 rows; fp32 even with the bmm split at 1 row, ahead of every other candidate
# from 2; about even with packed at 16 rows (its tiles reduce over K, the packed layout does not).
# Timed cold (COLD_BYTES), as 30 layers' distinct weights are, PyTorch's bf16 kernels took
# 400-800 us at 2-16 rows on SmolLM2's shapes against native's 20-200, so it is offered up to
# 64 rows and the timings decide.
NATIVE_MAX_ROWS = 64

TORCH = "torch"
MM_T = "mm_t"
BMM_SPLIT = "bmm_split"
ROW_BLOCKS = "row_blocks"
NATIVE = "native_gemm"
PACKED = "onednn_packed"
PANELS = "native_panels"
# The panels without software prefetch, left to the hardware prefetcher (bf16 pair layout).
PANELS_HWPF = "native_panels_hwpf"
INT8_KERNEL = "int8_kernel"
DEQUANT = "dequantize"

DENSE_FNS: dict[str, LinearFn] = {
    TORCH: F.linear,
    MM_T: mm_transposed,
    BMM_SPLIT: bmm_row_split,
    ROW_BLOCKS: row_blocks,
    NATIVE: gemm_linear,
}
INT8_FNS: dict[str, Int8LinearFn] = {INT8_KERNEL: int8_kernel_linear, DEQUANT: dequantized_linear}
# Kernels on a re-laid-out weight: name -> (pack a weight [N, K], the matmul on the packed copy
# with F.linear's (x, weight, bias) order). Packing raises where the kind does not apply.
PACKED_KINDS: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[..., torch.Tensor]]] = {
    PACKED: (pack_onednn_weight, onednn_packed_linear),
    PANELS: (pack_panels, panel_linear),
}
# Other matmuls on a packed kind's copy: name -> (the kind, the matmul). They are timed on the
# kind's copies and chosen per bucket like it; a site packs the kind once and each bucket runs
# whichever of the kind and its variants timed fastest. Where they run the same bits as the
# kind, mixing them across buckets keeps a row's output the same at every row count.
PACKED_VARIANTS: dict[str, tuple[str, Callable[..., torch.Tensor]]] = {
    PANELS_HWPF: (PANELS, panel_linear_hwpf),
}


def panels_prefetch(name: str) -> bool:
    """Whether the panel kernel named `name` prefetches in software (False: PANELS_HWPF)."""
    return name != PANELS_HWPF


def kind_of(name: str) -> str:
    """The packed kind whose copy `name` runs on (itself for every other kernel)."""
    variant = PACKED_VARIANTS.get(name)
    return name if variant is None else variant[0]


def packed_fn(name: str) -> Callable[..., torch.Tensor]:
    """The matmul of a packed kind or variant, (x, packed, bias)."""
    variant = PACKED_VARIANTS.get(name)
    return PACKED_KINDS[name][1] if variant is None else variant[1]


# Kernels whose output row depends on that row of x alone, bit for bit, whatever the rows of
# the call (tests/kernels check it): the panels sum K in one order at every tile shape
# (panel_gemm.c, panel_gemm_f32.c). The others may not: gemm.c switches to vdpbf16ps at 4 rows,
# torch's kernels promise nothing. Speculative verification needs them (`row_invariant_rows`;
# engine/spec_decode/row_invariance.py).
ROW_INVARIANT: frozenset[str] = frozenset({PANELS, PANELS_HWPF})
# GPTQ / AWQ weights (wNa16): the native kernel dequantizing in registers (kernels/cpu/
# wna16_gemm.c) and dequantize-then-matmul in cache-sized blocks (big prefills).
WNA16_NATIVE = "wna16_native"
WNA16_FNS: dict[str, WNA16LinearFn] = {
    WNA16_NATIVE: wna16_native_linear,
    DEQUANT: wna16_dequantized_linear,
}

# GGUF weights kept in their blocks: the int8 dot-product kernel (kernels/cpu/gguf_q8.c, x
# rounded to int8 per 32 values; the types `q8_supports`), the float kernel (gguf_gemm.c, codes
# widened to fp32) and dequantize-then-matmul in chunks of W rows. No dense copy is kept: that
# is `--gguf-weights dequantized`, and keeping one beside the blocks would cost more memory
# than either.
GGUF_Q8 = "gguf_q8"
GGUF_FLOAT = "gguf_float"
GGUF_FNS: dict[str, GGUFLinearFn] = {
    GGUF_Q8: gguf_q8_gemm,
    GGUF_FLOAT: gguf_gemm,
    DEQUANT: dequant_gemm,
}

# Timings of one shape: per bucket, candidate name -> best seconds.
BucketTimes = list[dict[str, float]]


def tuning_enabled() -> bool:
    """WICK_CPU_LINEAR_TUNING as the settings read it, for callers given no KernelOptions."""
    return bool(resolve_setting("cpu_linear_tuning"))


def tuning_budget_s() -> float:
    """WICK_CPU_LINEAR_TUNING_BUDGET_S as the settings read it (for `budget_s=None`)."""
    return float(resolve_setting("cpu_linear_tuning_budget"))


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """Powers of two from 1 up to the first that holds `max_rows` (at most MAX_BUCKET)."""
    buckets = [1]
    while buckets[-1] < min(max_rows, MAX_BUCKET):
        buckets.append(buckets[-1] * 2)
    return tuple(buckets)


def _packed_call(
    fn: Callable[..., torch.Tensor],
    packed: Any,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return fn(x, packed, bias)


@dataclass(slots=True, frozen=True)
class SitePlan:
    """What the tuner chose for one site: per row bucket a kernel's name and function (with the
    kernel-table slot's signature: `LinearFn`, `Int8LinearFn`, `WNA16LinearFn`,
    `GGUFLinearFn`). A float site may run a packed copy at some buckets (`packed`, of kind
    `packed_kind`: its functions read it and ignore the weight argument); `values_moved`: the
    site is exclusive and runs the copy at every bucket, so the copy alone keeps the values."""

    site: LinearSite
    names: tuple[str, ...]
    fns: tuple[Callable[..., torch.Tensor], ...]
    packed: Any = None
    packed_kind: str | None = None
    values_moved: bool = False

    @property
    def panels(self) -> Panels | None:
        """The native panels every bucket runs (the native step and the fused SiLU read them)."""
        if self.values_moved and isinstance(self.packed, Panels):
            return self.packed
        return None


@dataclass(slots=True, frozen=True)
class BlocksBesideFloat:
    """A GGUF weight planned beside its float twin (`--gguf-weights auto`): its blocks run the
    row buckets below `blocks_buckets` (`blocks`: one plan per segment, GGUF_FLOAT there), the
    twin's plan (`twin`: a float site of the dequantized matrix) the others. 0: the twin
    alone keeps the values; len(twin.names): the blocks alone."""

    module: str
    blocks: tuple[SitePlan, ...]
    twin: SitePlan
    blocks_buckets: int


# ---- timing -------------------------------------------------------------------------------


def time_candidates(
    calls: dict[str, Callable[[], object]], pair_budget_s: float = PAIR_BUDGET_S
) -> dict[str, float]:
    """Best seconds of each call: one untimed warm-up call each (a raising one is dropped; it
    pays one-time costs such as oneDNN's kernel generation), one timed call each, then
    interleaved rounds (so a noisy neighbour slows all alike) of those within DOMINATED of the
    best, about `pair_budget_s` in all. The minimum is kept: noise only ever adds time."""
    live_calls: dict[str, Callable[[], object]] = {}
    for name, call in calls.items():
        try:
            call()
            live_calls[name] = call
        except Exception as exc:  # a kernel this CPU or torch build lacks
            logger.debug("cpu linear candidate %s dropped: %s", name, exc)
    times: dict[str, float] = {}
    for name, call in live_calls.items():
        start = time.perf_counter()
        call()
        times[name] = time.perf_counter() - start
    if not times:
        return times
    best = min(times.values())
    live = [name for name, t in times.items() if t <= DOMINATED * best]
    round_s = sum(times[name] for name in live)
    rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, int(pair_budget_s / max(round_s, 1e-9))))
    for _ in range(rounds):
        for name in live:
            start = time.perf_counter()
            calls[name]()
            times[name] = min(times[name], time.perf_counter() - start)
    return times


def float_candidates(rows: int, weight: torch.Tensor) -> list[str]:
    """Dense candidates worth timing at `rows` (the packed one is added by the caller)."""
    names = [TORCH]
    if rows <= SKINNY_MAX_ROWS:
        names.append(MM_T)
        if bmm_row_split_applies(rows, weight):
            names.append(BMM_SPLIT)
        if rows >= 8 and weight.numel() * weight.element_size() > 2 * _BLOCK_BYTES:
            names.append(ROW_BLOCKS)
    if rows <= NATIVE_MAX_ROWS and gemm_applies(weight):
        names.append(NATIVE)
    return names


@dataclass(slots=True)
class _Group:
    """Sites of one (kind, dtype, shape): timed once, planned per site."""

    key: str
    sites: list[LinearSite]
    act_dtype: torch.dtype
    buckets: tuple[int, ...] = ()
    times: BucketTimes = field(default_factory=list)
    from_cache: bool = False
    inherited_from: int | None = None  # first bucket index that copied a smaller one's times
    int8_dot: str = "auto"  # GGUF only: CpuGGUFLinear.int8_dot

    @property
    def int8(self) -> bool:
        return self.sites[0].weight.dtype == torch.int8

    @property
    def wna16(self) -> bool:
        return self.sites[0].bits > 0

    @property
    def gguf(self) -> bool:
        return self.sites[0].ggml_type is not None

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the float matrix the weight stands for."""
        return self.sites[0].matrix_shape()


# Float weights are timed cold, as a decode step reads them (each layer's weight is evicted by
# the others' before it comes round again): every call reads the next of several copies that
# together hold at least COLD_BYTES (more than a server CPU's last-level cache), at most
# MAX_COPIES of them. Timed hot, the same weight over and over, kernels that compute well from
# cache win over kernels that stream memory well, which is what a decode needs.
COLD_BYTES = 64 << 20
MAX_COPIES = 32


class _Rotating:
    """`fn(x, weights[i], None)` with i advancing by one per call, round the copies, from
    `start`."""

    __slots__ = ("fn", "i", "weights", "x")

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        x: torch.Tensor,
        weights: Sequence[Any],
        start: int = 0,
    ) -> None:
        self.fn, self.x, self.weights, self.i = fn, x, weights, start % len(weights)

    def __call__(self) -> torch.Tensor:
        weight = self.weights[self.i]
        self.i = (self.i + 1) % len(self.weights)
        return self.fn(self.x, weight, None)


def _cold_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """`weight` and enough copies of it to time it cold (see COLD_BYTES)."""
    nbytes = max(1, weight.numel() * weight.element_size())
    count = max(1, min(MAX_COPIES, -(-COLD_BYTES // nbytes)))
    return [weight] + [weight.clone() for _ in range(count - 1)]


def _packed_copies(copies: Sequence[torch.Tensor]) -> dict[str, list[Any]]:
    """Each packed kind's copy of every float weight in `copies` (kinds that cannot pack this
    dtype or shape are left out)."""
    packed: dict[str, list[Any]] = {}
    for kind, (pack, _) in PACKED_KINDS.items():
        try:
            packed[kind] = [pack(w) for w in copies]
        except Exception as exc:
            n, k = copies[0].shape
            logger.debug("cpu linear candidate %s dropped for %dx%d: %s", kind, n, k, exc)
    return packed


def _float_calls(
    x: torch.Tensor, copies: Sequence[torch.Tensor], packed: dict[str, list[Any]]
) -> dict[str, Callable[[], object]]:
    """Every float candidate at x's rows, each call reading the next of its weight's copies.
    The dense candidates share the copies: each starts 1/R of the way further round them, so
    that between two reads of one copy every other copy is read once (R readers in step would
    each read the copy the first one just brought into cache)."""
    names = float_candidates(x.shape[0], copies[0])
    calls: dict[str, Callable[[], object]] = {
        name: _Rotating(DENSE_FNS[name], x, copies, j * len(copies) // len(names))
        for j, name in enumerate(names)
    }
    for kind, kind_copies in packed.items():
        calls[kind] = _Rotating(PACKED_KINDS[kind][1], x, kind_copies)
    # A variant reads its kind's copies from half-way round (see the dense ones above).
    for name, (kind, fn) in PACKED_VARIANTS.items():
        if kind in packed:
            calls[name] = _Rotating(fn, x, packed[kind], len(packed[kind]) // 2)
    return calls


def cold_float_calls(
    weight: torch.Tensor, row_counts: Sequence[int], generator: torch.Generator
) -> dict[int, dict[str, Callable[[], object]]]:
    """Per row count, every candidate the tuner times for the float `weight`, timed cold as it
    times them (its copies together hold COLD_BYTES, packed once): for --dtype auto
    (kernels/cpu/dtype_choice.py), which weighs the dtypes by what the plan would run."""
    copies = _cold_copies(weight)
    packed = _packed_copies(copies)
    k = weight.shape[1]
    return {
        rows: _float_calls(
            torch.randn(rows, k, generator=generator).to(weight.dtype), copies, packed
        )
        for rows in row_counts
    }


def _time_group(group: _Group, deadline: float) -> None:
    """Time every bucket of `group` (smallest first) until `deadline`; later buckets copy the
    last timed one. Float weights are timed cold (COLD_BYTES)."""
    site = group.sites[0]
    weight = site.weight
    k = group.shape[1]
    copies = [weight] if group.int8 or group.wna16 else _cold_copies(weight)
    packed = {} if group.int8 or group.wna16 or group.gguf else _packed_copies(copies)
    gen = torch.Generator().manual_seed(0)
    group.times = []
    for index, rows in enumerate(group.buckets):
        if index > 0 and time.perf_counter() > deadline:
            group.inherited_from = index
            group.times.extend(dict(group.times[-1]) for _ in group.buckets[index:])
            break
        x = torch.randn(rows, k, generator=gen).to(group.act_dtype)
        calls: dict[str, Callable[[], object]]
        if group.gguf:
            # Timed cold like float weights: a decode step streams each layer's blocks.
            ggml_type = site.ggml_type
            assert ggml_type is not None
            q8 = q8_supports(ggml_type) and group.int8_dot != "off"
            names = [name for name in GGUF_FNS if name != GGUF_Q8 or q8]
            calls = {
                name: _Rotating(
                    functools.partial(_gguf_call, GGUF_FNS[name], ggml_type),
                    x,
                    copies,
                    j * len(copies) // len(names),
                )
                for j, name in enumerate(names)
            }
        elif group.wna16:
            calls = {
                name: functools.partial(
                    fn, x, weight, site.scale, site.offsets, site.bits, site.group_size, None
                )
                for name, fn in WNA16_FNS.items()
            }
        elif group.int8:
            scale = site.scale
            assert scale is not None
            calls = {
                name: functools.partial(fn, x, weight, scale, None) for name, fn in INT8_FNS.items()
            }
        else:
            calls = _float_calls(x, copies, packed)
        # Nothing ran (no kernel for this dtype): F.linear, as untimed, so plans stay total.
        group.times.append(time_candidates(calls) or {TORCH: float("inf")})


def _gguf_call(
    fn: GGUFLinearFn,
    ggml_type: int,
    x: torch.Tensor,
    blocks: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return fn(x, blocks, ggml_type, bias)


def _valid_entry(entry: Any, buckets: tuple[int, ...]) -> BucketTimes | None:
    """The cached timings of `buckets`, or None when the entry does not cover them."""
    if not isinstance(entry, dict) or not isinstance(entry.get("times"), list):
        return None
    cached = entry.get("buckets")
    if not isinstance(cached, list) or cached[: len(buckets)] != list(buckets):
        return None
    times = entry["times"][: len(buckets)]
    ok = len(times) == len(buckets) and all(
        isinstance(t, dict) and t and all(isinstance(v, float | int) for v in t.values())
        for t in times
    )
    return [{name: float(v) for name, v in t.items()} for t in times] if ok else None


# ---- choosing -----------------------------------------------------------------------------


def _best(times: dict[str, float], allowed: Callable[[str], bool] = lambda _: True) -> str:
    """The fastest allowed candidate; F.linear unless another beats it by MARGIN."""
    usable = {name: t for name, t in times.items() if allowed(name)}
    if not usable:
        return TORCH
    best = min(usable, key=usable.__getitem__)
    if TORCH in usable and usable[best] > usable[TORCH] * (1 - MARGIN):
        return TORCH
    return best


def _is_dense(name: str) -> bool:
    return name in DENSE_FNS


def _kind_time(times: dict[str, float], kind: str) -> float:
    """The best time of packed `kind` or one of its variants (inf: none timed)."""
    return min((t for name, t in times.items() if kind_of(name) == kind), default=float("inf"))


def _kind_name(times: dict[str, float], kind: str) -> str:
    """The fastest of packed `kind` and its variants in one bucket's times (`kind` if none)."""
    names = [name for name in times if kind_of(name) == kind]
    return min(names, key=times.__getitem__) if names else kind


def _packed_only_cost(times: BucketTimes, kind: str) -> float | None:
    """`kind` (each bucket its fastest variant) at every bucket, summed over buckets as ratios to
    each bucket's best (every bucket counts alike), when that beats the best dense kernel per
    bucket; else None."""
    inf = float("inf")
    packed = dense = 0.0
    for t in times:
        best = min(t.values())
        packed += _kind_time(t, kind) / best
        dense += t[_best(t, _is_dense)] / best if any(map(_is_dense, t)) else inf
    return packed if packed <= dense and packed < inf else None


def _ranges(buckets: tuple[int, ...], names: Sequence[str]) -> str:
    """'rows 1-2 mm_t, 3-64 torch, 65+ onednn_packed' from a choice per bucket (`row_buckets`'
    powers of two): the last range is open only at MAX_BUCKET, where more rows run it too."""
    return bucket_ranges(names, open_end=buckets[len(names) - 1] >= MAX_BUCKET)


@dataclass(slots=True)
class TuningReport:
    """What `tune_cpu_linears` did: shapes timed now and read from the cache, the seconds spent
    timing, the bytes of packed copies kept beside dense weights (and of GGUF blocks beside
    float twins), one log line per shape."""

    timed: int = 0
    cached: int = 0
    seconds: float = 0.0
    extra_bytes: int = 0
    # GGUF blocks kept beside their float twins (`blocks_beside_float`), in bytes.
    blocks_beside_bytes: int = 0
    lines: list[str] = field(default_factory=list)
    # Share of the cores other processes used while timing; above BUSY_SHARE nothing was cached.
    others_share: float = 0.0
    busy: bool = False


def _runnable_times(group: _Group) -> BucketTimes:
    """Each bucket's timings less the candidates that cannot run its rows. A bucket that copied a
    smaller bucket's times (the budget ran out) holds kernels timed at fewer rows, and one of
    them may be valid there only: `bmm_split` runs exactly one row, and chosen for a 16-row
    bucket it failed every step that had 16 rows."""
    if group.int8 or group.wna16 or group.gguf:
        return group.times
    weight = group.sites[0].weight
    runnable: BucketTimes = []
    for rows, times in zip(group.buckets, group.times, strict=True):
        allowed = {*float_candidates(rows, weight), *PACKED_KINDS, *PACKED_VARIANTS}
        kept = {name: t for name, t in times.items() if name in allowed}
        runnable.append(kept or {TORCH: float("inf")})
    return runnable


# The kernels the native decoder step (kernels/cpu/decoder_stack.c) calls. One decoder matmul
# without such a kernel at a row bucket sends every layer at that bucket through the modules,
# which costs more than a few percent on that one matmul (the step ran 1.08-1.29x the modules'
# speed, docs/benchmarks.md; a 3 % faster oneDNN kernel for Gemma 3's qkv once kept the whole
# model off the step at every bucket). So in the decoder layers another kernel is chosen over
# these only when it beats them by NATIVE_STEP_MARGIN.
STEP_KERNELS: frozenset[str] = frozenset({NATIVE, PANELS, PANELS_HWPF, WNA16_NATIVE})
NATIVE_STEP_MARGIN = 0.10


def _step_preferred_times(group: _Group, times: BucketTimes) -> BucketTimes:
    """`times` with every kernel the native step cannot call charged NATIVE_STEP_MARGIN more, in
    the buckets where a step kernel was timed (the decoder layers' weights only: the LM head
    runs outside the step)."""
    if group.int8 or group.gguf or all(site.lm_head for site in group.sites):
        return times
    out: BucketTimes = []
    for bucket in times:
        if not STEP_KERNELS.intersection(bucket):
            out.append(bucket)
            continue
        out.append(
            {
                name: t if name in STEP_KERNELS else t * (1 + NATIVE_STEP_MARGIN)
                for name, t in bucket.items()
            }
        )
    return out


def _row_invariant_times(group: _Group, times: BucketTimes, rows: int) -> tuple[BucketTimes, bool]:
    """`times` with the buckets that hold 1..`rows` rows (0: none) left to the row-invariant
    kernels (one packed kind, the fastest over those buckets in all, with its row-invariant
    variants: they run the same bits), so that a row computes the same at every row count a
    verifying step has; and whether one could run them (none timed: the times unchanged, the
    caller notes it)."""
    if rows <= 0 or group.int8 or group.wna16 or group.gguf:
        return times, True
    held = [i for i, bucket in enumerate(group.buckets) if bucket < 2 * rows]
    kinds = {kind_of(name) for name in ROW_INVARIANT}

    def invariant(i: int, kind: str) -> dict[str, float]:
        return {n: t for n, t in times[i].items() if n in ROW_INVARIANT and kind_of(n) == kind}

    candidates = [kind for kind in kinds if held and all(invariant(i, kind) for i in held)]
    if not candidates:
        return times, False
    kind = min(
        sorted(candidates),
        key=lambda kind: sum(min(invariant(i, kind).values()) for i in held),
    )
    out = list(times)
    for i in held:
        out[i] = invariant(i, kind)
    return out, True


def _plan_int8(group: _Group, plans: list[SitePlan]) -> str:
    names = tuple(_best(t) for t in group.times)
    fns = tuple(INT8_FNS[name] for name in names)
    plans.extend(SitePlan(site, names, fns) for site in group.sites)
    return _ranges(group.buckets, names)


def _plan_wna16(group: _Group, plans: list[SitePlan]) -> str:
    names = tuple(_best(t) for t in group.times)
    fns = tuple(WNA16_FNS[name] for name in names)
    plans.extend(SitePlan(site, names, fns) for site in group.sites)
    return _ranges(group.buckets, names)


def _plan_gguf(group: _Group, plans: list[SitePlan]) -> str:
    site = group.sites[0]
    assert site.ggml_type is not None
    if group.int8_dot == "on" and q8_supports(site.ggml_type):
        names = (GGUF_Q8,) * len(group.buckets)
    else:
        names = tuple(
            _best(t, lambda name: name != GGUF_Q8 or group.int8_dot != "off") for t in group.times
        )
    fns = tuple(GGUF_FNS[name] for name in names)
    plans.extend(SitePlan(site, names, fns) for site in group.sites)
    return _ranges(group.buckets, names)


def _plan_float(group: _Group, plans: list[SitePlan], report: TuningReport) -> str:
    best = [_best(t) for t in group.times]
    dense = tuple(_best(t, _is_dense) for t in group.times)
    dense_fns = tuple(DENSE_FNS[name] for name in dense)
    used = [kind_of(name) for name in best if kind_of(name) in PACKED_KINDS]
    if not used:
        plans.extend(SitePlan(site, dense, dense_fns) for site in group.sites)
        return _ranges(group.buckets, dense)
    # Exclusive weights: the packed kind that alone beats dense by the most, if one does.
    costs = {kind: _packed_only_cost(group.times, kind) for kind in PACKED_KINDS}
    paying = {kind: cost for kind, cost in costs.items() if cost is not None}
    only = min(paying, key=paying.__getitem__) if paying else None
    # A shared weight keeps its dense values and gets one packed copy: the kind it wins with
    # most often. Each bucket then runs that copy or its best dense kernel, whichever timed
    # faster (a bucket another packed kind won may still run this one faster than dense: the
    # tied LM head at 64 rows, oneDNN's best, ran F.linear 1.25x slower than the panels' 1.10x).
    shared_kind = max(set(used), key=used.count)
    shared_names = tuple(
        _kind_name(t, shared_kind)
        if _kind_time(t, shared_kind) < t.get(dense[i], float("inf"))
        else dense[i]
        for i, t in enumerate(group.times)
    )
    # Exclusive weights on `only`: per bucket its fastest variant (one packed copy for all).
    only_names = () if only is None else tuple(_kind_name(t, only) for t in group.times)
    layouts: list[str] = []
    for site in group.sites:
        kind = only if site.exclusive else shared_kind
        if kind is None:
            layouts.append("dense")
            plans.append(SitePlan(site, dense, dense_fns))
            continue
        pack = PACKED_KINDS[kind][0]
        try:
            packed = pack(site.weight)
        except Exception as exc:
            logger.debug("cannot pack %s as %s: %s", site.name, kind, exc)
            layouts.append("dense")
            plans.append(SitePlan(site, dense, dense_fns))
            continue
        calls = {
            name: functools.partial(_packed_call, packed_fn(name), packed)
            for name in {*only_names, *shared_names}
            if kind_of(name) == kind
        }
        if site.exclusive:
            # The packed copy alone keeps the values (the dense tensor is dropped by the
            # model-preparation stage when it installs the planned weight).
            plans.append(
                SitePlan(site, only_names, tuple(calls[n] for n in only_names), packed, kind, True)
            )
            layouts.append("packed")
        else:
            fns = tuple(calls.get(name) or DENSE_FNS[name] for name in shared_names)
            plans.append(SitePlan(site, shared_names, fns, packed, kind))
            report.extra_bytes += site.weight.numel() * site.weight.element_size()
            layouts.append("packed + dense (shared weight)")
    chosen: Sequence[str] = only_names if only is not None and "packed" in layouts else dense
    if any(layout.startswith("packed +") for layout in layouts):
        chosen = shared_names
    kinds = sorted(set(layouts))
    return f"{_ranges(group.buckets, chosen)} [{', '.join(kinds)}]"


def _plan_gguf_float_kernel(group: _Group, plans: list[SitePlan]) -> str:
    """Blocks beside a float twin run their float kernel only (see the module docstring)."""
    names = (GGUF_FLOAT,) * len(group.buckets)
    fns = (GGUF_FNS[GGUF_FLOAT],) * len(names)
    plans.extend(SitePlan(site, names, fns) for site in group.sites)
    return _ranges(group.buckets, names) + " [beside the float twin where faster]"


def _float_twins(sites: Sequence[LinearSite], act_dtype: torch.dtype) -> dict[str, LinearSite]:
    """Module name -> a float site of each GGUF weight's dequantized matrix (exclusive: the twin
    is a new tensor no other module reads)."""
    twins: dict[str, LinearSite] = {}
    for site in sites:
        if site.ggml_type is None or site.module in twins:
            continue
        matrix = site.holder.dequantize(act_dtype).contiguous()
        twins[site.module] = LinearSite(
            matrix, site.max_rows, True, None, f"{site.module}.float", module=site.module
        )
    return twins


def _beside_float(
    plans: list[SitePlan],
    groups: dict[str, _Group],
    twins: dict[str, LinearSite],
    report: TuningReport,
) -> list[SitePlan | BlocksBesideFloat]:
    """Each GGUF module's segment plans and twin plan as one `BlocksBesideFloat`: its blocks
    for the leading row buckets where the sum of their segments' times beats the twin's
    chosen kernel by MARGIN, the twin from the first bucket where it does not."""
    times_of: dict[int, BucketTimes] = {}
    for group in groups.values():
        for site in group.sites:
            times_of[id(site)] = group.times
    twin_ids = {id(site): module for module, site in twins.items()}
    blocks: dict[str, list[SitePlan]] = {}
    twin_plans: dict[str, SitePlan] = {}
    out: list[SitePlan | BlocksBesideFloat] = []
    for plan in plans:
        if id(plan.site) in twin_ids:
            twin_plans[twin_ids[id(plan.site)]] = plan
        elif plan.site.ggml_type is not None and plan.site.module in twins:
            blocks.setdefault(plan.site.module, []).append(plan)
        else:
            out.append(plan)
    for module, twin in twin_plans.items():
        twin_times = times_of[id(twin.site)]
        cut = 0
        for i, name in enumerate(twin.names):
            on_blocks = sum(
                times_of[id(p.site)][i].get(GGUF_FLOAT, float("inf")) for p in blocks[module]
            )
            if on_blocks >= twin_times[i].get(name, float("inf")) * (1 - MARGIN):
                break
            cut = i + 1
        if 0 < cut < len(twin.names):
            report.blocks_beside_bytes += sum(p.site.weight.numel() for p in blocks[module])
        out.append(BlocksBesideFloat(module, tuple(blocks[module]), twin, cut))
    return out


def tune_cpu_linears(
    sites: Sequence[LinearSite],
    act_dtype: torch.dtype,
    cache: TuningCache,
    budget_s: float | None = None,
    *,
    int8_dot: str = "auto",
    quantized_kernels: bool = True,
    blocks_beside_float: bool = False,
    row_invariant_rows: int = 0,
) -> tuple[TuningReport, list[SitePlan | BlocksBesideFloat]]:
    """Time the candidates for every distinct (kind, shape) of `sites` in `act_dtype` (or read
    their timings from `cache`) and choose per site and row bucket: returns what was done and
    one `SitePlan` per planned site. Nothing is changed in place: the model-preparation stage
    installs the plans (kernels/planned_weight.py). `int8_dot`: gguf_linear.py's mode for GGUF
    weights; `quantized_kernels` False leaves GPTQ/AWQ and GGUF sites unplanned (no native
    build: the fixed table serves them). Call once per model, after its weights are loaded
    (and quantized), before it runs. `blocks_beside_float`: GGUF weights are planned beside
    their float twins (see the module docstring). `row_invariant_rows`: float weights run one
    kernel of ROW_INVARIANT at the buckets that hold 1..that many rows (speculative decoding's
    verification steps; 0: no such constraint)."""
    report = TuningReport()
    groups: dict[str, _Group] = {}
    twins: dict[str, LinearSite] = {}
    if blocks_beside_float and quantized_kernels:
        twins = _float_twins(sites, act_dtype)
        sites = [*sites, *twins.values()]
    for site in sites:
        is_int8 = site.weight.dtype == torch.int8
        is_wna16 = site.bits > 0
        is_gguf = site.ggml_type is not None
        if (is_wna16 or is_gguf) and not quantized_kernels:
            continue  # no plan to make: the fixed choice serves it
        quantized = is_int8 or is_wna16 or is_gguf
        if site.weight.dim() != 2 or (not quantized and site.weight.dtype != act_dtype):
            continue  # not a matmul weight of this model's dtype: the fallback serves it
        act = str(act_dtype).removeprefix("torch.")
        n, k = site.weight.shape
        if is_gguf:
            assert site.ggml_type is not None
            k = site.k
            # int8 off: its own key, so that cached timings with the int8 kernel stay apart
            off = "-noint8" if int8_dot == "off" else ""
            kind = f"gguf-{type_name(site.ggml_type).lower()}{off}-{act}"
        elif is_wna16:
            k = k * 8 // site.bits
            kind = f"w{site.bits}g{site.group_size}-{act}"
        else:
            kind = f"int8-{act}" if is_int8 else act
        key = f"linear/{kind}/{n}x{k}"
        group = groups.setdefault(key, _Group(key, [], act_dtype))
        if is_gguf:
            group.int8_dot = int8_dot
        group.sites.append(site)
    for group in groups.values():
        group.buckets = row_buckets(max(site.max_rows for site in group.sites))
        times = _valid_entry(cache.get(group.key), group.buckets)
        if times is not None:
            group.times, group.from_cache = times, True
    pending = [g for g in groups.values() if not g.from_cache]
    start = time.perf_counter()
    window = LoadWindow()
    budget = tuning_budget_s() if budget_s is None else budget_s
    for i, group in enumerate(pending):
        # An equal share of what is left to each shape still to time.
        now = time.perf_counter()
        left = budget - (now - start)
        _time_group(group, now + max(0.0, left) / (len(pending) - i))
    report.seconds = time.perf_counter() - start
    report.timed, report.cached = len(pending), len(groups) - len(pending)
    if pending:
        report.others_share = window.others_share()
        report.busy = window.busy_machine()
    if not report.busy:  # busy timings serve this start only (see TUNING_ENV)
        for group in pending:
            cache.put(group.key, {"buckets": list(group.buckets), "times": group.times})
        cache.save()
    plans: list[SitePlan] = []
    for group in groups.values():
        group.times, invariant = _row_invariant_times(
            group, _step_preferred_times(group, _runnable_times(group)), row_invariant_rows
        )
        if group.gguf and twins:
            text = _plan_gguf_float_kernel(group, plans)
        elif group.gguf:
            text = _plan_gguf(group, plans)
        elif group.wna16:
            text = _plan_wna16(group, plans)
        elif group.int8:
            text = _plan_int8(group, plans)
        else:
            text = _plan_float(group, plans, report)
        note = "cached" if group.from_cache else "timed"
        if group.inherited_from is not None:
            note += f", budget spent: {group.buckets[group.inherited_from]}+ rows inherit"
        if row_invariant_rows and not (group.int8 or group.wna16 or group.gguf):
            note += (
                f", rows 1-{row_invariant_rows} row-invariant"
                if invariant
                else f", no row-invariant kernel for rows 1-{row_invariant_rows}"
            )
        report.lines.append(
            f"{group.key.removeprefix('linear/').replace('/', ' ')} x{len(group.sites)} ({note}): "
            f"{text}"
        )
    if not twins:
        return report, list(plans)
    return report, _beside_float(plans, groups, twins, report)
