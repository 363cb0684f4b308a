"""Times the native CPU paged attention (kernels/cpu/paged_attention.c) on decode steps.

    python -m tools.cpu_attention_bench                     # SmolLM2-135M heads, bf16 and fp32
    python -m tools.cpu_attention_bench --batch 16 --ctx 1000 --threads 2 --isa avx2

One query token per sequence, contexts of --ctx tokens in shuffled blocks of --block-size; prints
the median and the fastest time per call over a short run, the KV bytes read per call and the
rate the fastest makes. The machine's load average is printed first: timings on a shared machine
mean little without it.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch

from model_server.kernels.cpu import native


def decode_inputs(
    batch: int,
    ctx: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, ...]:
    """q, k_cache, v_cache, block_tables, query_start_loc, seq_lens of `batch` decodes, each
    seeing `ctx` tokens in blocks shuffled across the cache."""
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator().manual_seed(0)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    return q, k_cache, v_cache, tables.to(torch.int32), starts, lens


def time_call(fn, seconds: float) -> tuple[float, float]:
    """Median and fastest seconds per call over about `seconds` of calls (after a warm-up): on
    a shared machine the fastest is the closer to the kernel's own time."""
    for _ in range(3):
        fn()
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 5:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.cpu_attention_bench")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--ctx", type=int, nargs="+", default=[140, 1000])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", default=None, help="a build of kernels/cpu/isa.py's ISAS")
    parser.add_argument("--seconds", type=float, default=0.5, help="per case")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    kernels = native.load_kernels(args.isa)
    assert kernels is not None, "the native kernels could not be built"
    print(f"isa {kernels.isa}, {args.threads} threads, load average {os.getloadavg()}")
    print(f"{'dtype':>9} {'batch':>5} {'ctx':>5} {'median us':>9} {'min us':>9} {'KV MB':>6} GB/s")
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for batch in args.batch:
            for ctx in args.ctx:
                inputs = decode_inputs(
                    batch, ctx, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype
                )
                out = torch.empty_like(inputs[0])
                call = functools.partial(
                    native.paged_attention, kernels, *inputs, args.head_dim**-0.5, out
                )
                median, fastest = time_call(call, args.seconds)
                kv_bytes = 2 * batch * ctx * args.kv_heads * args.head_dim * out.element_size()
                print(
                    f"{dtype_name:>9} {batch:>5} {ctx:>5} {median * 1e6:>9.1f} "
                    f"{fastest * 1e6:>9.1f} {kv_bytes / 1e6:>6.2f} {kv_bytes / fastest / 1e9:>5.1f}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
