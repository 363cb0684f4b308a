"""Times the Triton attention kernels against the torch backend on a CUDA GPU.

    python -m tools.kernel_bench                      # llama-8B-like defaults, bf16
    python -m tools.kernel_bench --batch 128 --ctx 4096 --block-size 32

Cases: a decode batch (every request at `--ctx` tokens), a few long decodes (split-K territory),
whole-prompt prefills and chunked prefills after a cached prefix. Each line gives the full
backend forward (store + attention) for both backends, timed eagerly (launch overhead included:
small batches are host-bound) and replayed from a CUDA graph (GPU time only), then the attention
kernels alone (graph) with the achieved KV bandwidth (decode) or attention TFLOP/s (prefill,
causal FLOPs only).

    python -m tools.kernel_bench --fused-ops          # RMSNorm / add+RMSNorm / SiluAndMul

`--fused-ops` times the one-pass Triton kernels of `rms_norm.py` and `activation.py` against the
PyTorch ops they replace (`kernels/portable.py`, what the layers run by default) at `--rows` x
`--hidden` (`--act-dims` for SiluAndMul's d), replayed from CUDA graphs as decode steps are, and
eagerly; GB/s counts the bytes each op must move at least (inputs read once, outputs written once).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Case:
    name: str
    # (num_cached, num_new) per request
    requests: list[tuple[int, int]]


@dataclass
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


def build_case_inputs(case: Case, shape: Shape, device: torch.device):
    """Random caches with shuffled block tables, real metadata, and the step's q/k/v."""
    from model_server.engine.execution.input_batch import SeqChunk, build_model_inputs

    bs = shape.block_size
    needed = [-(-(c + n) // bs) for c, n in case.requests]
    num_blocks = sum(needed) + 1
    perm = torch.randperm(num_blocks).tolist()
    chunks = []
    for (cached, new), nb in zip(case.requests, needed, strict=True):
        table, perm = perm[:nb], perm[nb:]
        chunks.append(SeqChunk(token_ids=[0] * new, num_computed_tokens=cached, block_ids=table))
    md = build_model_inputs(chunks, bs, device).attn_metadata
    cache_shape = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, device=device, dtype=shape.dtype)
    v_cache = torch.randn(cache_shape, device=device, dtype=shape.dtype)
    t = sum(n for _, n in case.requests)
    q = torch.randn(t, shape.num_heads, shape.head_dim, device=device, dtype=shape.dtype)
    k = torch.randn(t, shape.num_kv_heads, shape.head_dim, device=device, dtype=shape.dtype)
    v = torch.randn(t, shape.num_kv_heads, shape.head_dim, device=device, dtype=shape.dtype)
    return md, q, k, v, k_cache, v_cache


def _time_ms(fn: Callable[[], object]) -> float:
    """Eager time per call: includes Python/Triton launch overhead when it exceeds GPU time."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)


USE_GRAPHS = True  # --eager-only turns graph replay off


def _graph_ms(fn: Callable[[], object]) -> float:
    """GPU time per call, replayed from a CUDA graph (no launch overhead); nan if uncapturable."""
    from triton.testing import do_bench_cudagraph

    if not USE_GRAPHS:
        return _time_ms(fn)
    try:
        return do_bench_cudagraph(fn, rep=100)
    except Exception:  # e.g. an op that syncs; report eager time only
        return float("nan")


def run_case(case: Case, shape: Shape, device: torch.device) -> str:
    from model_server.layers.attention.torch_backend import TorchAttentionBackend
    from model_server.layers.attention.triton_backend import TritonAttentionBackend

    md, q, k, v, k_cache, v_cache = build_case_inputs(case, shape, device)
    scale = shape.head_dim**-0.5
    args = (shape.num_heads, shape.num_kv_heads, shape.head_dim, scale)
    triton_be, torch_be = TritonAttentionBackend(*args), TorchAttentionBackend(*args)
    out = torch.empty_like(q)

    def kernel_only() -> None:
        triton_be.attend(q, k_cache, v_cache, md, out=out)

    t_triton = _time_ms(lambda: triton_be.forward(q, k, v, k_cache, v_cache, md))
    t_kernel = _graph_ms(kernel_only)
    t_torch = _time_ms(lambda: torch_be.forward(q, k, v, k_cache, v_cache, md))
    g_triton = _graph_ms(lambda: triton_be.forward(q, k, v, k_cache, v_cache, md))
    g_torch = _graph_ms(lambda: torch_be.forward(q, k, v, k_cache, v_cache, md))

    elt = torch.finfo(shape.dtype).bits // 8
    kv_bytes = sum(md.seq_lens_cpu) * shape.num_kv_heads * shape.head_dim * 2 * elt
    flops = 0
    for cached, new in case.requests:
        # Causal: query j sees cached + j + 1 keys; 2 matmuls of 2 FLOPs per MAC.
        keys = new * cached + new * (new + 1) // 2
        flops += 4 * keys * shape.num_heads * shape.head_dim
    rate = (
        f"{kv_bytes / t_kernel / 1e6:8.1f} GB/s"
        if md.num_prefills == 0
        else f"{flops / t_kernel / 1e9:8.1f} TFLOP/s"
    )
    return (
        f"{case.name:<36} eager: triton {t_triton * 1e3:8.1f} torch {t_torch * 1e3:8.1f} us | "
        f"graph: triton {g_triton * 1e3:8.1f} torch {g_torch * 1e3:8.1f} us "
        f"(x{g_torch / g_triton:5.2f}) | attention kernels {t_kernel * 1e3:8.1f} us ({rate})"
    )


def default_cases(args: argparse.Namespace) -> list[Case]:
    return [
        Case(f"decode b{args.batch} ctx{args.ctx}", [(args.ctx, 1)] * args.batch),
        Case(f"decode b{args.batch // 4} ctx{args.ctx}", [(args.ctx, 1)] * (args.batch // 4)),
        Case(f"decode b4 ctx{args.long_ctx} (split-K)", [(args.long_ctx, 1)] * 4),
        Case(
            f"prefill {args.prefill_batch}x{args.prefill_len}",
            [(0, args.prefill_len)] * args.prefill_batch,
        ),
        Case(
            f"chunk {args.chunk} after {args.prefix_len} cached x{args.prefill_batch}",
            [(args.prefix_len, args.chunk)] * args.prefill_batch,
        ),
        Case(
            f"mixed: b{args.batch} decodes + chunk {args.chunk}",
            [(args.ctx, 1)] * args.batch + [(args.prefix_len, args.chunk)],
        ),
    ]


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def run_fused_op(
    name: str,
    triton_fn: Callable[[], object],
    torch_fn: Callable[[], object],
    num_bytes: int,
) -> str:
    """One line: graph and eager time of the Triton kernel and of the PyTorch ops it replaces."""
    e_triton, e_torch = _time_ms(triton_fn), _time_ms(torch_fn)  # also compiles before capture
    g_triton, g_torch = _graph_ms(triton_fn), _graph_ms(torch_fn)
    return (
        f"{name:<36} graph: triton {g_triton * 1e3:8.1f} us {num_bytes / g_triton / 1e6:7.1f} GB/s"
        f" | torch {g_torch * 1e3:8.1f} us {num_bytes / g_torch / 1e6:7.1f} GB/s"
        f" (x{g_torch / g_triton:5.2f}) | eager: triton {e_triton * 1e3:8.1f} torch "
        f"{e_torch * 1e3:8.1f} us"
    )


def run_fused_ops(
    rows: Sequence[int],
    hiddens: Sequence[int],
    act_dims: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Prints a line per (op, rows, width); see `run_fused_op`."""
    from model_server.kernels.activation import silu_and_mul
    from model_server.kernels.portable import (
        fused_add_rms_norm_torch,
        rms_norm_torch,
        silu_and_mul_torch,
    )
    from model_server.kernels.rms_norm import fused_add_rms_norm, rms_norm

    elt = torch.finfo(dtype).bits // 8
    eps = 1e-6
    for hidden in hiddens:
        weight = 1.0 + 0.1 * torch.randn(hidden, device=device, dtype=dtype)
        for t in rows:
            x = torch.randn(t, hidden, device=device, dtype=dtype)
            residual = torch.randn(t, hidden, device=device, dtype=dtype)
            print(
                run_fused_op(
                    f"rms_norm rows {t} hidden {hidden}",
                    lambda x=x, w=weight: rms_norm(x, w, eps),
                    lambda x=x, w=weight: rms_norm_torch(x, w, eps),
                    (2 * t + 1) * hidden * elt,  # read x, write out, read weight
                ),
                flush=True,
            )
            print(
                run_fused_op(
                    f"add+rms_norm rows {t} hidden {hidden}",
                    lambda x=x, r=residual, w=weight: fused_add_rms_norm(x, r, w, eps),
                    lambda x=x, r=residual, w=weight: fused_add_rms_norm_torch(x, r, w, eps),
                    (4 * t + 1) * hidden * elt,  # read x, residual; write out, sum; weight
                ),
                flush=True,
            )
    for d in act_dims:
        for t in rows:
            gate_up = torch.randn(t, 2 * d, device=device, dtype=dtype)
            print(
                run_fused_op(
                    f"silu_and_mul rows {t} d {d}",
                    lambda x=gate_up: silu_and_mul(x),
                    lambda x=gate_up: silu_and_mul_torch(x),
                    3 * t * d * elt,  # read gate and up, write out
                ),
                flush=True,
            )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.kernel_bench",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--batch", type=int, default=64, help="decode batch size")
    p.add_argument("--ctx", type=int, default=1024, help="decode context length")
    p.add_argument("--long-ctx", type=int, default=16384, help="context of the split-K case")
    p.add_argument("--prefill-batch", type=int, default=4)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--prefix-len", type=int, default=1536, help="cached tokens before a chunk")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument(
        "--eager-only", action="store_true", help="time without CUDA graphs (graph columns too)"
    )
    p.add_argument(
        "--fused-ops",
        action="store_true",
        help="time the fused RMSNorm / add+RMSNorm / SiluAndMul kernels instead of attention",
    )
    p.add_argument("--rows", default="1,32,256,2048", help="--fused-ops: token rows (a list)")
    p.add_argument("--hidden", default="1024,4096", help="--fused-ops: RMSNorm widths (a list)")
    p.add_argument(
        "--act-dims",
        default="3072,14336",
        help="--fused-ops: SiluAndMul output widths d (Qwen3-0.6B's and Llama-3.1-8B's "
        "intermediate sizes; the input is 2d wide)",
    )
    args = p.parse_args(argv)
    global USE_GRAPHS
    USE_GRAPHS = not args.eager_only

    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU (kernels would run under the Triton interpreter)")
        return 2
    device = torch.device("cuda")
    if args.fused_ops:
        torch.manual_seed(0)
        print(f"{torch.cuda.get_device_name(device)} | fused small ops, {args.dtype}")
        run_fused_ops(
            _int_list(args.rows),
            _int_list(args.hidden),
            _int_list(args.act_dims),
            DTYPES[args.dtype],
            device,
        )
        return 0
    shape = Shape(
        args.num_heads, args.num_kv_heads, args.head_dim, args.block_size, DTYPES[args.dtype]
    )
    print(
        f"{torch.cuda.get_device_name(device)} | heads {shape.num_heads}/{shape.num_kv_heads} "
        f"D {shape.head_dim} block {shape.block_size} {args.dtype}"
    )
    torch.manual_seed(0)
    for case in default_cases(args):
        print(run_case(case, shape, device), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
