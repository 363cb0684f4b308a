"""The compute bound of a decode step, for `bench latency` on CPUs.

A step of B sequences multiplies B rows by every linear weight: 2 * B * N * K flops per weight
[N, K]. On a CPU with few cores that can cost more than streaming the weights, so next to the
bandwidth bound (bandwidth.py) the benchmark prints the GEMM rate this machine reaches on the
model's own shapes at B rows in the run's dtype (per shape the faster of `torch.mm` and oneDNN
with a prepacked weight, the two kernels the CPU linear tuner mostly picks between), and how much
of it the step achieves.
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
    """What the best GEMM reaches on a model's linear shapes at `rows` rows."""

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
    """FLOP/s over the shapes (weighted by their counts) of the faster of `torch.mm(x [rows, K],
    W^T)` and oneDNN's prepacked linear (where torch has it for `dtype`), the best of `trials`
    timings of each."""
    import torch

    from model_server.kernels.cpu.linear import onednn_packed_linear, pack_onednn_weight

    flops = seconds = 0.0
    gen = torch.Generator().manual_seed(0)
    for (n, k), count in shape_counts.items():
        timed_n = max(1, min(n, MAX_TIMED_ELEMENTS // max(k, 1)))
        weight = torch.randn(timed_n, k, generator=gen).to(dtype)
        x = torch.randn(rows, k, generator=gen).to(dtype)
        kernels = [lambda x=x, w=weight: torch.mm(x, w.t())]
        try:
            packed = pack_onednn_weight(weight)
            onednn_packed_linear(x, packed)
            kernels.append(lambda x=x, p=packed: onednn_packed_linear(x, p))
        except Exception:  # no oneDNN kernel for this dtype or build
            pass
        best = float("inf")
        for kernel in kernels:
            kernel()  # first call: allocations, kernel selection
            for _ in range(trials):
                start = time.perf_counter()
                kernel()
                best = min(best, time.perf_counter() - start)
        flops += count * 2.0 * rows * n * k
        seconds += count * best * n / timed_n
    return ComputeRate(rows, flops, flops / seconds if seconds > 0 else float("inf"))


def format_compute_bound(achieved: float, batch_size: int, rate: ComputeRate, dtype: str) -> str:
    """The `compute:` line: the measured GEMM rate and the step's share of it."""
    step_s = batch_size / achieved
    achieved_flops = rate.flops_per_step / step_s
    return (
        f"compute: best GEMM {dtype} at {rate.rows} rows on the model's shapes "
        f"{rate.flops_per_s / 1e9:.4g} GFLOP/s; decode step {rate.flops_per_step / 1e9:.4g} GFLOP "
        f"at {achieved_flops / 1e9:.4g} GFLOP/s = {100 * achieved_flops / rate.flops_per_s:.1f}% "
        f"of it ({rate.bound_tokens_per_s(batch_size):.1f} tok/s compute bound)"
    )
