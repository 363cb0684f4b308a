"""Times CPU matmuls at decode's few rows: the native skinny matmul (kernels/cpu/gemm.c) against
F.linear, oneDNN with a prepacked weight, and the fixed fp32 table's `skinny_linear`.

    python -m tools.cpu_linear_bench                          # SmolLM2-135M's shapes, 2 threads
    python -m tools.cpu_linear_bench --shapes 576x49152 --rows 1,16 --dtypes bf16

Each (shape, dtype) cycles through copies of the weight that together exceed the last-level
cache (`--footprint-mb`), as a model's layers do, so that the weight streams from memory rather
than from L3. Candidates run interleaved (a noisy neighbour slows all alike); a line gives each
one's median time per call, the fastest call in parentheses, and the weight bytes streamed per
second at the median. `native_shift` is the native kernel's bf16 path without vdpbf16ps. Note
the machine's load (`uptime`) next to any figure: on a shared machine timings move by 2x, and
with more runnable threads than cores a threaded call can wait a scheduler tick (4-16 ms) for a
descheduled thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# SmolLM2-135M's linears as K x N: qkv, o_proj, gate_up, down, the LM head.
SMOLLM2_SHAPES = "576x960,576x576,576x3072,1536x576,576x49152"

LinearCall = Callable[[torch.Tensor, int], torch.Tensor]  # (x, weight copy index) -> y


def _shape_list(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        k, n = part.lower().split("x")
        shapes.append((int(k), int(n)))
    return shapes


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def candidates(weights: Sequence[torch.Tensor], dtype: torch.dtype) -> dict[str, LinearCall]:
    """The matmuls to time, each over its own layout of the same weight copies."""
    from model_server.kernels.cpu.gemm import gemm_applies, gemm_linear
    from model_server.kernels.cpu.linear import (
        onednn_packed_linear,
        pack_onednn_weight,
        skinny_linear,
    )

    calls: dict[str, LinearCall] = {"F.linear": lambda x, i: F.linear(x, weights[i])}
    try:
        packed = [pack_onednn_weight(w) for w in weights]
        calls["onednn_packed"] = lambda x, i: onednn_packed_linear(x, packed[i])
    except Exception as exc:  # no oneDNN kernel for this dtype here
        print(f"  (onednn_packed unavailable: {exc})")
    if dtype == torch.float32:
        calls["skinny_linear"] = lambda x, i: skinny_linear(x, weights[i])
    if gemm_applies(weights[0]):
        calls["native_gemm"] = lambda x, i: gemm_linear(x, weights[i])
        if dtype == torch.bfloat16:
            calls["native_shift"] = lambda x, i: gemm_linear(x, weights[i], use_dpbf16=False)
    return calls


def time_interleaved(
    calls: dict[str, LinearCall], x: torch.Tensor, copies: int, seconds: float
) -> dict[str, tuple[float, float]]:
    """(median, min) seconds per call of each candidate: rounds of one call each, for about
    `seconds` (at least 5 rounds). Every call reads the next weight copy, so that no call finds
    the weight its predecessor just pulled into the cache."""
    for call in calls.values():  # warm-up: oneDNN primitives, the native build
        for i in range(min(copies, 2)):
            call(x, i)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    start = time.perf_counter()
    rounds = calls_made = 0
    while rounds < 5 or time.perf_counter() - start < seconds:
        for name, call in calls.items():
            t0 = time.perf_counter()
            call(x, calls_made % copies)
            samples[name].append(time.perf_counter() - t0)
            calls_made += 1
        rounds += 1
    return {name: (statistics.median(s), min(s)) for name, s in samples.items()}


def bench_shape(
    k: int, n: int, dtype: torch.dtype, rows: Sequence[int], footprint: int, seconds: float
) -> None:
    weight_bytes = n * k * dtype.itemsize
    copies = max(1, footprint // weight_bytes)
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) * k**-0.5).to(dtype) for _ in range(copies)]
    calls = candidates(weights, dtype)
    for m in rows:
        x = torch.randn(m, k, generator=gen).to(dtype)
        times = time_interleaved(calls, x, copies, seconds)
        cells = [
            f"{name} {med * 1e6:7.1f} us ({low * 1e6:7.1f}) {weight_bytes / med / 1e9:5.1f} GB/s"
            for name, (med, low) in times.items()
        ]
        print(f"{k:>5}x{n:<6} {str(dtype)[6:]:<8} M={m:<3} | " + " | ".join(cells), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.cpu_linear_bench",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--shapes", default=SMOLLM2_SHAPES, help="K x N list, e.g. 576x960,1536x576")
    p.add_argument("--rows", default="1,2,4,8,16", help="rows of x (a list)")
    p.add_argument("--dtypes", default="bf16,fp32", help="bf16 and/or fp32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--footprint-mb", type=int, default=96, help="weight copies cycled, in all")
    p.add_argument("--seconds", type=float, default=0.3, help="timing per (shape, dtype, rows)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    print(f"threads {args.threads} | load {load:.2f} (1 min) | torch {torch.__version__}")
    for dtype_name in args.dtypes.split(","):
        for k, n in _shape_list(args.shapes):
            bench_shape(
                k,
                n,
                DTYPES[dtype_name],
                _int_list(args.rows),
                args.footprint_mb << 20,
                args.seconds,
            )
    print(f"load {os.getloadavg()[0]:.2f} (1 min) at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
