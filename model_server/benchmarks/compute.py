"""The compute bound of a decode step, for `bench latency` on CPUs.

A step of B sequences multiplies B rows by every linear weight: 2 * B * N * K flops per weight
[N, K]. On a CPU with few cores that can cost more than streaming the weights, so next to the
bandwidth bound (bandwidth.py) the benchmark prints the GEMM rate `torch.mm` reaches on the
model's own shapes at B rows in the run's dtype, and how much of it the step achieves.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch stays out of import time
    import torch

# A timed weight has at most this many elements (rows cut, the time scaled back up): a large
# model's LM head would otherwise cost a GiB of scratch.
MAX_TIMED_ELEMENTS = 16 << 20


@dataclass(slots=True, frozen=True)
class ComputeRate:
    """What `torch.mm` reaches on a model's linear shapes at `rows` rows."""

    rows: int
    flops_per_step: float  # 2 * rows * sum(N * K) over the linear weights
    flops_per_s: float  # measured

    def bound_tokens_per_s(self, batch_size: int) -> float:
        """Output tokens/s of the batch if every step ran its matmuls at the measured rate."""
        return batch_size * self.flops_per_s / self.flops_per_step


def linear_shape_counts(shapes: Iterable[tuple[int, int]]) -> dict[tuple[int, int], int]:
    return dict(Counter((int(n), int(k)) for n, k in shapes))


def measure_gemm_rate(
    shape_counts: dict[tuple[int, int], int], rows: int, dtype: torch.dtype, trials: int = 5
) -> ComputeRate:
    """FLOP/s of `torch.mm(x [rows, K], W^T)` over the shapes (weighted by their counts), the
    best of `trials` timings of each."""
    import torch

    flops = seconds = 0.0
    gen = torch.Generator().manual_seed(0)
    for (n, k), count in shape_counts.items():
        timed_n = max(1, min(n, MAX_TIMED_ELEMENTS // max(k, 1)))
        weight = torch.randn(timed_n, k, generator=gen).to(dtype)
        x = torch.randn(rows, k, generator=gen).to(dtype)
        torch.mm(x, weight.t())  # first call: allocations, kernel selection
        best = float("inf")
        for _ in range(trials):
            start = time.perf_counter()
            torch.mm(x, weight.t())
            best = min(best, time.perf_counter() - start)
        flops += count * 2.0 * rows * n * k
        seconds += count * best * n / timed_n
    return ComputeRate(rows, flops, flops / seconds if seconds > 0 else float("inf"))


def format_compute_bound(achieved: float, batch_size: int, rate: ComputeRate, dtype: str) -> str:
    """The `compute:` line: the measured GEMM rate and the step's share of it."""
    step_s = batch_size / achieved
    achieved_flops = rate.flops_per_step / step_s
    return (
        f"compute: torch.mm {dtype} at {rate.rows} rows on the model's shapes "
        f"{rate.flops_per_s / 1e9:.4g} GFLOP/s; decode step {rate.flops_per_step / 1e9:.4g} GFLOP "
        f"at {achieved_flops / 1e9:.4g} GFLOP/s = {100 * achieved_flops / rate.flops_per_s:.1f}% "
        f"of it ({rate.bound_tokens_per_s(batch_size):.1f} tok/s compute bound)"
    )
