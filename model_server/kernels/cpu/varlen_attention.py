"""The CPU platform's `varlen_attention` slot (kernels/varlen_attention.py has the contract) on
the native kernel (kernels/cpu/varlen_attention.c): each sequence's tokens attend over their
own, no padding, no mask tensor, so a step of 32 sentences of mixed lengths computes sum(len^2)
scores instead of 32 * longest^2. q, k, v are read in place (row-strided views of a fused qkv
projection), fp32 or bf16 with fp32 accumulation. Where the library is not built, or for
another device or dtype, `varlen_attention_torch` runs SDPA per sequence.
"""

from __future__ import annotations

import torch

from model_server.kernels.cpu import native
from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.varlen_attention import varlen_attention_torch

# Multiply-adds worth another thread (~0.1 ms of this kernel on one Zen 5 thread): a sentence of
# 70 tokens (MiniLM: 3.8M per layer) stays on the calling thread. On a loaded 2-core box its
# fork/join took 1.06 ms against 0.10 ms on one thread (busy-machine figures).
MIN_WORK_PER_THREAD = 1 << 22


def _row_stride(t: torch.Tensor, width: int, name: str) -> int:
    if t.dim() != 2 or t.shape[1] != width or (t.stride(1) != 1 and width > 1):
        raise ValueError(f"varlen attention: {name} must be [T, {width}] with contiguous rows")
    return t.stride(0)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    causal: bool = False,
    kernels: native.NativeKernels | None = None,
    min_work_per_thread: int = MIN_WORK_PER_THREAD,
) -> torch.Tensor:
    """See the module docstring; on up to torch's thread count (fewer for a small step)."""
    kernels = kernels or default_kernels()
    dtype = q.dtype
    if kernels is None or not q.is_cpu or dtype not in native.DTYPE_CODES:
        return varlen_attention_torch(q, k, v, cu_seqlens, num_heads, num_kv_heads, scale, causal)
    if k.dtype != dtype or v.dtype != dtype:
        raise ValueError(f"varlen attention: q, k and v must share a dtype ({dtype})")
    if num_heads % num_kv_heads or q.shape[1] % num_heads:
        raise ValueError(
            f"varlen attention: {q.shape[1]} query values are not {num_heads} heads over "
            f"{num_kv_heads} kv heads"
        )
    d = q.shape[1] // num_heads
    q_stride = _row_stride(q, num_heads * d, "q")
    k_stride = _row_stride(k, num_kv_heads * d, "k")
    v_stride = _row_stride(v, num_kv_heads * d, "v")
    if cu_seqlens.dtype != torch.int32 or not cu_seqlens.is_cpu or cu_seqlens.dim() != 1:
        raise ValueError("varlen attention: cu_seqlens must be a 1-D int32 CPU tensor")
    cu_seqlens = cu_seqlens.contiguous()
    if cu_seqlens.shape[0] < 1 or int(cu_seqlens[0]) < 0 or int(cu_seqlens[-1]) > q.shape[0]:
        raise ValueError(f"varlen attention: cu_seqlens must lie within the {q.shape[0]} rows")
    out = q.new_empty((q.shape[0], num_heads * d))
    status = kernels.lib.wick_varlen_attention(
        native.DTYPE_CODES[dtype], q.data_ptr(), q_stride, k.data_ptr(), k_stride, v.data_ptr(),
        v_stride, out.data_ptr(), out.stride(0), cu_seqlens.data_ptr(), cu_seqlens.shape[0] - 1,
        num_heads, num_kv_heads, d, float(scale), int(causal), torch.get_num_threads(),
        min_work_per_thread,
    )  # fmt: skip
    if status == -1:
        raise MemoryError("varlen attention: out of memory for the scratch buffers")
    if status == -2:
        raise ValueError("varlen attention: cu_seqlens must not decrease")
    if status != 0:
        raise ValueError(
            f"varlen attention: bad arguments (heads {num_heads}/{num_kv_heads}, head_dim {d})"
        )
    return out
