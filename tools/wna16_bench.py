"""Times the linear layers of one decode step with GPTQ/AWQ-style w4 (or w8) weights against the
same step with float weights, on the CPU kernels Wick runs.

    python -m tools.wna16_bench                          # SmolLM2-135M: 30 layers, w4 g128, bf16
    python -m tools.wna16_bench --rows 1,8,32 --bits 8 --group-size 64 --dtype fp32

A step is every layer's qkv, o, gate_up and down matmul (SmolLM2-135M's shapes by default: hidden
576, intermediate 1536), each layer with its own weights, so that they stream from memory as in a
real step. Float: the native skinny matmul (kernels/cpu/gemm.c) up to 64 rows, else F.linear;
quantized: the native wNa16 kernel (kernels/cpu/wna16_gemm.c) and dequantize-then-matmul; the
faster of each pair is reported, as the startup timing would pick. Variants run interleaved (a
noisy neighbour slows all alike); a line gives each one's median step time, the fastest in
parentheses, and the weight bytes a step reads. Note the machine's load (`uptime`) with any
figure.
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

from model_server.kernels.cpu.gemm import gemm_linear
from model_server.kernels.cpu.wna16 import wna16_dequantized_linear, wna16_native_linear
from model_server.kernels.portable import pack_int4

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def smollm2_shapes(
    hidden: int, intermediate: int, heads: int, kv_heads: int
) -> list[tuple[int, int]]:
    """(N, K) of one decoder layer's qkv, o, gate_up and down projections."""
    head_dim = hidden // heads
    qkv = hidden + 2 * kv_heads * head_dim
    return [(qkv, hidden), (hidden, hidden), (2 * intermediate, hidden), (hidden, intermediate)]


def _random_wna16(n: int, k: int, bits: int, group_size: int, gen: torch.Generator):
    groups = -(-k // group_size)
    q = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    codes = pack_int4(q) if bits == 4 else q
    scales = torch.rand(n, groups, generator=gen) * 0.01
    offsets = -scales * (1 << (bits - 1))
    return codes, scales, offsets


Step = Callable[[torch.Tensor], None]


def steps(
    shapes: Sequence[tuple[int, int]],
    layers: int,
    dtype: torch.dtype,
    bits: int,
    group_size: int,
    rows: int,
) -> tuple[dict[str, Step], dict[str, int]]:
    """The step variants for x of `rows` rows, and the weight bytes each reads per step."""
    gen = torch.Generator().manual_seed(0)
    floats = [
        [torch.randn(n, k, generator=gen).mul_(0.02).to(dtype) for n, k in shapes]
        for _ in range(layers)
    ]
    quants = [
        [_random_wna16(n, k, bits, group_size, gen) for n, k in shapes] for _ in range(layers)
    ]

    def float_step(fn: Callable[..., torch.Tensor]) -> Step:
        def run(x: torch.Tensor) -> None:
            for layer in floats:
                for w in layer:
                    fn(x[:, : w.shape[1]], w)

        return run

    def quant_step(fn: Callable[..., torch.Tensor]) -> Step:
        def run(x: torch.Tensor) -> None:
            for layer in quants:
                for (_, k), (codes, scales, offsets) in zip(shapes, layer, strict=True):
                    fn(x[:, :k].contiguous(), codes, scales, offsets, bits, group_size)

        return run

    variants: dict[str, Step] = {"float torch": float_step(F.linear)}
    if rows <= 64:
        variants["float native"] = float_step(gemm_linear)
    variants[f"w{bits} native"] = quant_step(wna16_native_linear)
    variants[f"w{bits} dequantize"] = quant_step(wna16_dequantized_linear)
    float_bytes = sum(w.numel() * w.element_size() for layer in floats for w in layer)
    quant_bytes = sum(
        sum(t.numel() * t.element_size() for t in parts) for layer in quants for parts in layer
    )
    sizes = {name: float_bytes if name.startswith("float") else quant_bytes for name in variants}
    return variants, sizes


def time_interleaved(
    variants: dict[str, Step], x: torch.Tensor, rounds: int, clock: Callable[[], float]
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for step in variants.values():
        step(x)  # warm-up: builds, one-time costs
    for _ in range(rounds):
        for name, step in variants.items():
            start = clock()
            step(x)
            times[name].append(clock() - start)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32", help="Rows of x (sequences in the step).")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="Default: torch's.")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="Time steps by this process's CPU time instead of the wall clock: on a machine "
        "other jobs keep busy, with --threads 1, the time the step computed, not the time it "
        "waited for a core (memory and cache contention still count).",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    shapes = smollm2_shapes(args.hidden, args.intermediate, args.heads, args.kv_heads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{args.layers} layers of {shapes} (N, K), {args.dtype} activations, "
        f"w{args.bits} g{args.group_size}, {torch.get_num_threads()} threads, load {load:.2f}"
        + (", CPU time" if args.cpu_time else "")
    )
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            variants, sizes = steps(shapes, args.layers, dtype, args.bits, args.group_size, rows)
            x = torch.randn(rows, max(k for _, k in shapes)).to(dtype)
            clock = time.process_time if args.cpu_time else time.perf_counter
            times = time_interleaved(variants, x, args.rounds, clock)
            medians = {name: statistics.median(t) for name, t in times.items()}
            for name, t in times.items():
                print(
                    f"rows {rows:3d} {name:16s} {1e3 * medians[name]:8.2f} ms/step "
                    f"({1e3 * min(t):.2f}) {sizes[name] / 1e6:6.1f} MB"
                )
            best_float = min(v for k, v in medians.items() if k.startswith("float"))
            best_quant = min(v for k, v in medians.items() if not k.startswith("float"))
            print(f"rows {rows:3d} w{args.bits} vs float: {best_float / best_quant:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
