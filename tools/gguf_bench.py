"""Times the matmuls of one decode step with GGUF weights kept in their blocks against the same
weights dequantized (what `--gguf-weights quantized` and `dequantized` run), on the CPU
kernels Wick runs.

    python -m tools.gguf_bench                        # SmolLM2-135M Q4_1 + Q8_0 head, bf16
    python -m tools.gguf_bench --rows 1,8,32 --type q4_k --head-type q6_k --dtype fp32

A step is every layer's qkv, o, gate_up and down matmul (SmolLM2-135M's shapes by default:
hidden 576, intermediate 1536), each layer with its own weights so that they stream from memory
as in a real step, plus the LM head (`--vocab`, 0 for none). Weights are random valid blocks.
Variants, timed interleaved (a noisy neighbour slows all alike):
  - kept int8-dot: kernels/cpu/gguf_q8.c (x rounded to int8 per 32 values, integer dots);
  - kept float: kernels/cpu/gguf_gemm.c (codes widened to fp32);
  - kept dequantize: W dequantized in chunks on every call, then PyTorch's GEMM;
  - kept tuned / dense tuned: what the startup tuner (kernels/cpu/linear_tuning.py) picks per
    shape and row bucket among the kept candidates above, or among the float kernels on the
    dequantized weights (F.linear, the native skinny and panel matmuls, oneDNN packed), timed
    here with a fresh in-memory cache.
A line gives each one's median step time, the fastest in parentheses, and the weight bytes a
step reads. Note the machine's load (`uptime`) with any figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

from model_server.kernels.cpu.gguf_linear import (
    dequant_gemm,
    fixed_gguf_linear,
    gguf_dequantize,
    gguf_gemm,
    gguf_q8_gemm,
    q8_supports,
)
from model_server.kernels.cpu.linear_tuning import tune_cpu_linears
from model_server.kernels.cpu.tuning_cache import TuningCache
from model_server.kernels.gguf_blocks import block_shape, row_bytes
from model_server.kernels.linear_sites import LinearSite
from model_server.kernels.planned_weight import GGUFSegmentDispatch, RowBucketDispatch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q2_k": 10, "q3_k": 11,
         "q4_k": 12, "q5_k": 13, "q6_k": 14}  # fmt: skip
# Byte ranges of each type's f16 scale fields, set to small finite values in random blocks.
_F16_FIELDS = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 10: [80, 82], 11: [108],
               12: [0, 2], 13: [0, 2], 14: [208]}  # fmt: skip


def layer_shapes(
    hidden: int, intermediate: int, heads: int, kv_heads: int
) -> list[tuple[int, int]]:
    """(N, K) of one decoder layer's qkv, o, gate_up and down projections."""
    head_dim = hidden // heads
    qkv = hidden + 2 * kv_heads * head_dim
    return [(qkv, hidden), (hidden, hidden), (2 * intermediate, hidden), (hidden, intermediate)]


def random_blocks(ggml_type: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, row_bytes]: random codes, every f16 scale a small finite value."""
    elems, nbytes = block_shape(ggml_type)
    count = n * k // elems
    blocks = torch.randint(0, 256, (count, nbytes), generator=gen, dtype=torch.uint8)
    for start in _F16_FIELDS[ggml_type]:
        scale = (torch.rand(count, generator=gen) * 0.01 + 0.001).to(torch.float16)
        blocks[:, start : start + 2] = scale.view(torch.uint8).view(count, 2)
    return blocks.view(n, row_bytes(ggml_type, k))


Step = Callable[[torch.Tensor], None]


def steps(
    mats: Sequence[tuple[int, torch.Tensor, int]], dtype: torch.dtype, rows: int
) -> tuple[dict[str, Step], dict[str, int]]:
    """The step variants for x of `rows` rows over `mats` (ggml type, blocks, K), and the weight
    bytes each reads per step."""
    dense = [gguf_dequantize(b, t, k, dtype) for t, b, k in mats]

    def kept(fn: Callable[..., torch.Tensor]) -> Step:
        def run(x: torch.Tensor) -> None:
            for t, b, k in mats:
                fn(x[:, :k], b, t, None)

        return run

    def q8_or_float(x: torch.Tensor, b: torch.Tensor, t: int, bias: None) -> torch.Tensor:
        return (gguf_q8_gemm if q8_supports(t) else gguf_gemm)(x, b, t, bias)

    # The tuner's choices, timed now (a fresh in-memory cache) for these rows only.
    cache = TuningCache(None, {})
    kept_sites = [
        LinearSite(b, rows, True, None, f"m{i}", ggml_type=t, k=k)
        for i, (t, b, k) in enumerate(mats)
    ]
    _, kept_plans = tune_cpu_linears(kept_sites, dtype, cache)
    gguf = GGUFSegmentDispatch(
        tuple(((p.site.ggml_type, p.site.weight.shape[0]), p.fns) for p in kept_plans),
        fixed_gguf_linear("auto"),
    )
    dense_sites = [LinearSite(w, rows, True, None, f"d{i}") for i, w in enumerate(dense)]
    _, dense_plans = tune_cpu_linears(dense_sites, dtype, cache)
    planned = [(plan.site.weight, RowBucketDispatch(plan.fns)) for plan in dense_plans]

    def dense_step(x: torch.Tensor) -> None:
        for w, run in planned:
            run(x[:, : w.shape[1]], w, None)

    variants: dict[str, Step] = {
        "kept int8-dot": kept(q8_or_float),
        "kept float": kept(gguf_gemm),
        "kept dequantize": kept(dequant_gemm),
        "kept tuned": kept(gguf),
        "dense tuned": dense_step,
    }
    kept_bytes = sum(b.numel() for _, b, _ in mats)
    dense_bytes = sum(w.numel() * w.element_size() for w in dense)
    sizes = {name: dense_bytes if name.startswith("dense") else kept_bytes for name in variants}
    return variants, sizes


def time_interleaved(
    variants: dict[str, Step], x: torch.Tensor, rounds: int
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for step in variants.values():
        step(x)  # warm-up: builds, one-time costs
    for _ in range(rounds):
        for name, step in variants.items():
            start = time.perf_counter()
            step(x)
            times[name].append(time.perf_counter() - start)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32", help="Rows of x (sequences in the step).")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--type", choices=sorted(TYPES), default="q4_1", help="Layer weights.")
    parser.add_argument("--head-type", choices=sorted(TYPES), default="q8_0")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=49152, help="LM head rows (0: none).")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="Default: torch's.")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    shapes = layer_shapes(args.hidden, args.intermediate, args.heads, args.kv_heads)
    gen = torch.Generator().manual_seed(0)
    mats = [
        (TYPES[args.type], random_blocks(TYPES[args.type], n, k, gen), k)
        for _ in range(args.layers)
        for n, k in shapes
    ]
    if args.vocab:
        head = TYPES[args.head_type]
        mats.append((head, random_blocks(head, args.vocab, args.hidden, gen), args.hidden))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{args.layers} layers of {shapes} (N, K) {args.type}, head {args.vocab}x{args.hidden} "
        f"{args.head_type}, {args.dtype} activations, {torch.get_num_threads()} threads, "
        f"load {load:.2f}"
    )
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            variants, sizes = steps(mats, dtype, rows)
            x = torch.randn(rows, max(k for _, _, k in mats)).to(dtype)
            times = time_interleaved(variants, x, args.rounds)
            medians = {name: statistics.median(t) for name, t in times.items()}
            for name, t in times.items():
                print(
                    f"rows {rows:3d} {name:16s} {1e3 * medians[name]:8.2f} ms/step "
                    f"({1e3 * min(t):.2f}) {sizes[name] / 1e6:6.1f} MB"
                )
            ratio = medians["dense tuned"] / medians["kept tuned"]
            q8 = medians["kept float"] / medians["kept int8-dot"]
            print(
                f"rows {rows:3d} kept tuned / dense tuned: {ratio:.2f}x; int8-dot / float {q8:.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
