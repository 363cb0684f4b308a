"""`--dtype auto` on CPUs: bf16 only where the model's matmuls run faster in it.

Native bf16 instructions (avx512_bf16, amx_bf16) make bf16 possible, not necessarily faster:
whether it is depends on the kernels this CPU has. Without them the native panels still read
bf16 weights and multiply in fp32 (kernels/cpu/panel_gemm_f32.c): half the bytes of fp32, which
is what a decode step is bound by (platforms/cpu.py says when bf16 is a candidate there). So
the model's linear shapes are timed in both dtypes, at a decode row count and a prefill row
count, each with the fastest of the candidates `tune_cpu_linears` will choose from (F.linear,
oneDNN's prepacked kernel, the native skinny and panel matmuls...), timed cold as it times
them, and weighted by how many layers have that shape. The figures are cached with the linear
timings (kernels/cpu/tuning_cache.py). `--cpu-auto-dtype bfloat16|float32`
(`WICK_CPU_AUTO_DTYPE`) stands in for the measurement (tests; pinning the choice without
`--dtype`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from model_server.kernels.cpu.cpu_load import LoadWindow
from model_server.kernels.cpu.linear_tuning import cold_float_calls, time_candidates
from model_server.kernels.cpu.tuning_cache import TuningCache
from model_server.settings_spec import resolve_setting

AUTO_DTYPE_ENV = "WICK_CPU_AUTO_DTYPE"
DECODE_ROWS = 1
PREFILL_ROWS = 64
# A timed weight has at most this many elements (rows are cut, the time scaled back up), so a
# large model's LM head costs neither a GiB of scratch nor seconds.
MAX_TIMED_ELEMENTS = 8 << 20

# (N, K, how many layers have it)
LinearShape = tuple[int, int, int]


@dataclass(slots=True, frozen=True)
class DtypeFigures:
    """Seconds of one pass over the model's linears, per dtype and row count."""

    fp32_decode_s: float
    bf16_decode_s: float
    fp32_prefill_s: float
    bf16_prefill_s: float

    @property
    def bf16_speedup(self) -> float:
        """Geometric mean of bf16's speedup at the decode and the prefill row count."""
        return math.sqrt(
            (self.fp32_decode_s / self.bf16_decode_s) * (self.fp32_prefill_s / self.bf16_prefill_s)
        )

    @property
    def bf16_wins(self) -> bool:
        return self.bf16_speedup > 1.0

    def describe(self) -> str:
        return (
            f"linears at {DECODE_ROWS} row(s) {self.fp32_decode_s * 1e3:.2f} ms fp32 vs "
            f"{self.bf16_decode_s * 1e3:.2f} ms bf16, at {PREFILL_ROWS} rows "
            f"{self.fp32_prefill_s * 1e3:.2f} ms fp32 vs {self.bf16_prefill_s * 1e3:.2f} ms bf16 "
            f"(bf16 {self.bf16_speedup:.2f}x)"
        )


def forced_auto_dtype(choice: str | None = None) -> torch.dtype | None:
    """--cpu-auto-dtype as a dtype (`choice`; None: WICK_CPU_AUTO_DTYPE); None: measure."""
    choice = resolve_setting("cpu_auto_dtype", choice)
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(choice)


# Per shape and row count, both dtypes' candidates together: longer than a tuning pair, for more
# rounds.
PAIR_BUDGET_S = 0.1
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure_dtype_speed(shapes: Sequence[LinearShape]) -> DtypeFigures:
    """Time the model's linears (`shapes`) in fp32 and bf16 at DECODE_ROWS and PREFILL_ROWS,
    each with the fastest of the candidates the linear tuner chooses from, timed cold as it
    times them (linear_tuning.cold_float_calls); a dtype whose kernels all fail times as
    infinitely slow. Both dtypes' candidates are timed interleaved, in one `time_candidates`
    call per shape and row count, so that a busy neighbour slows both alike."""
    total = {(name, rows): 0.0 for name in DTYPES for rows in (DECODE_ROWS, PREFILL_ROWS)}
    generator = torch.Generator().manual_seed(0)
    for n, k, count in shapes:
        timed_n = max(1, min(n, MAX_TIMED_ELEMENTS // max(k, 1)))
        calls: dict[int, dict[str, Callable[[], object]]] = {DECODE_ROWS: {}, PREFILL_ROWS: {}}
        for name, dtype in DTYPES.items():
            # Filled, not empty: uninitialized memory may hold denormals or NaNs.
            weight = torch.full((timed_n, k), 0.01, dtype=dtype)
            for rows, candidates in cold_float_calls(weight, tuple(calls), generator).items():
                calls[rows].update({f"{name}/{c}": call for c, call in candidates.items()})
        for rows, row_calls in calls.items():
            times = time_candidates(row_calls, PAIR_BUDGET_S)
            for name in DTYPES:
                prefix = f"{name}/"
                best = min((t for c, t in times.items() if c.startswith(prefix)), default=math.inf)
                total[name, rows] += count * best * n / timed_n
    return DtypeFigures(
        total["fp32", DECODE_ROWS],
        total["bf16", DECODE_ROWS],
        total["fp32", PREFILL_ROWS],
        total["bf16", PREFILL_ROWS],
    )


@dataclass(slots=True, frozen=True)
class DtypeMeasurement:
    figures: DtypeFigures
    cached: bool  # read from the tuning cache, not timed now
    # Timed now while other processes kept more than a quarter of the cores busy: the figures
    # say more about the neighbours than about the kernels (not cached either).
    busy: bool = False


def dtype_figures(shapes: Sequence[LinearShape], cache: TuningCache) -> DtypeMeasurement:
    """The figures for `shapes`, from `cache` when it has them, else measured now and stored
    (unless the machine was busy meanwhile: kernels/cpu/cpu_load.py)."""
    digest = hashlib.sha256(repr(sorted(shapes)).encode()).hexdigest()[:16]
    # "cold": the tuner's candidates timed cold (earlier figures, timed hot, are not read).
    key = f"dtype-cold/{DECODE_ROWS}/{PREFILL_ROWS}/{digest}"
    entry = cache.get(key)
    if isinstance(entry, dict):
        try:
            figures = DtypeFigures(**{name: float(v) for name, v in entry.items()})
            if all(v > 0 for v in entry.values()):
                return DtypeMeasurement(figures, cached=True)
        except (TypeError, ValueError):
            pass
    window = LoadWindow()
    figures = measure_dtype_speed(shapes)
    if window.busy_machine():
        return DtypeMeasurement(figures, cached=False, busy=True)
    cache.put(key, {name: getattr(figures, name) for name in DtypeFigures.__slots__})
    cache.save()
    return DtypeMeasurement(figures, cached=False)
