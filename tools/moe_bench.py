"""Times the CPU mixture-of-experts expert computation: grouped by expert (what the engine runs,
kernels/fused_moe_torch.py) against the naive per-token loop.

    python -m tools.moe_bench                               # Qwen3-30B-A3B's expert shapes
    python -m tools.moe_bench --experts 8 --hidden 4096 --inter 14336 --top-k 2   # Mixtral
    python -m tools.moe_bench --wna16 4 --experts 16 --inter 1408 --top-k 4   # GPTQ w4 g128

Random experts and a softmax top-k routing of --tokens rows (1 is a decode, more a prefill or a
batched decode step); prints the median and the fastest time per call of each path and the ratio
of the fastest. The machine's load average is printed first.

With --wna16 BITS the grouped path runs twice on the same experts: as float experts, and kept
quantized as a GPTQ/AWQ checkpoint's are (layers/quantization/wna16_moe.py: random BITS-bit codes
with float32 scales and offsets per --group-size inputs; the float experts are their
dequantization), each expert's matmuls through the CPU table's wNa16 kernel.
"""

from __future__ import annotations

import argparse
import functools
import os

import torch

from model_server.kernels.fused_moe_torch import fused_experts_grouped, fused_experts_per_token
from model_server.kernels.portable import pack_int4
from model_server.layers.fused_moe import softmax_topk
from model_server.layers.quantization.wna16_moe import WNA16Experts
from model_server.platforms.cpu import CpuPlatform
from tools.cpu_attention_bench import time_call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768, help="Each expert's intermediate size.")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=1.0, help="Timing per path and size.")
    parser.add_argument(
        "--wna16", type=int, choices=(4, 8), default=None, help="Compare float with BITS-bit."
    )
    parser.add_argument("--group-size", type=int, default=128, help="--wna16's group size.")
    args = parser.parse_args(argv)
    if args.wna16:
        return _compare_wna16(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    e, h, i = args.experts, args.hidden, args.inter
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 0.02).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) * 0.02).to(dtype)
    # The engine's CPU table: the native activation, and expert slices (untuned weights) on its
    # fixed skinny matmul, which beats F.linear at a few rows.
    kernels = CpuPlatform().kernel_table()
    print(f"load average {os.getloadavg()[0]:.2f}, {torch.get_num_threads()} threads")
    print(f"experts {e} x (hidden {h}, inter {i}), top-{args.top_k}, {args.dtype}")
    print("tokens  grouped_ms(median/min)  per_token_ms(median/min)  speedup")
    for t in args.tokens:
        x = torch.randn(t, h, generator=gen).to(dtype)
        weights, ids = softmax_topk(torch.randn(t, e, generator=gen), args.top_k, True)
        inputs = (x, w13, w2, weights, ids, kernels)
        with torch.inference_mode():
            g = time_call(functools.partial(fused_experts_grouped, *inputs), args.seconds)
            n = time_call(functools.partial(fused_experts_per_token, *inputs), args.seconds)
        print(
            f"{t:6d}  {g[0] * 1e3:9.2f} / {g[1] * 1e3:8.2f}  "
            f"{n[0] * 1e3:11.2f} / {n[1] * 1e3:9.2f}  {n[1] / g[1]:6.2f}x"
        )
    return 0


def _random_experts(
    e: int, n: int, k: int, bits: int, group_size: int, gen: torch.Generator
) -> WNA16Experts:
    q = torch.randint(0, 1 << bits, (e, n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(e, n, k // group_size, generator=gen) * 0.004 + 0.001
    offsets = -scales * (1 << (bits - 1))
    codes = torch.stack([pack_int4(q[x]) for x in range(e)]) if bits == 4 else q
    return WNA16Experts("gptq", bits, group_size, codes, scales, offsets, None)


def _compare_wna16(args: argparse.Namespace) -> int:
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    e, h, i, bits = args.experts, args.hidden, args.inter, args.wna16
    q13 = _random_experts(e, 2 * i, h, bits, args.group_size, gen)
    q2 = _random_experts(e, h, i, bits, args.group_size, gen)
    w13, w2 = q13.dequantize(dtype), q2.dequantize(dtype)
    kernels = CpuPlatform().kernel_table()
    nbytes = (w13.numel() + w2.numel()) * w13.element_size()
    qbytes = sum(p.numel() * p.element_size() for m in (q13, q2) for p in m.parameters())
    print(f"load average {os.getloadavg()[0]:.2f}, {torch.get_num_threads()} threads")
    print(
        f"experts {e} x (hidden {h}, inter {i}), top-{args.top_k}, {args.dtype} activations; "
        f"weights {nbytes / 2**20:.1f} MiB {args.dtype} against {qbytes / 2**20:.1f} MiB "
        f"w{bits} g{args.group_size}"
    )
    print("tokens  float_ms(median/min)  wna16_ms(median/min)  speedup")
    for t in args.tokens:
        x = torch.randn(t, h, generator=gen).to(dtype)
        weights, ids = softmax_topk(torch.randn(t, e, generator=gen), args.top_k, True)
        with torch.inference_mode():
            f = time_call(
                functools.partial(fused_experts_grouped, x, w13, w2, weights, ids, kernels),
                args.seconds,
            )
            q = time_call(
                functools.partial(fused_experts_grouped, x, q13, q2, weights, ids, kernels),
                args.seconds,
            )
        print(
            f"{t:6d}  {f[0] * 1e3:9.2f} / {f[1] * 1e3:8.2f}  "
            f"{q[0] * 1e3:9.2f} / {q[1] * 1e3:8.2f}  {f[1] / q[1]:6.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
