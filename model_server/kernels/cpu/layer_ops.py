"""The decoder layer's small ops on the native CPU library (kernels/cpu/layer_ops.c): RMSNorm,
fused add + RMSNorm, SiLU-and-mul and the neox rotary embedding, each one ctypes call where
PyTorch runs 3 to 17 ops (their dispatch, not their arithmetic, is most of a small decode
step's host time).

Each function takes the loaded library first (`native_kernel_table` binds it) and otherwise has
its `KernelTable` slot's signature and the numerics of kernels/portable.py. Inputs the C kernels
do not take (fp16, mixed dtypes, shapes the portable op would broadcast) run the portable op
after ONE warning per kernel and reason; layouts they cannot address in place are copied first.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import cache, partial

import torch

from model_server.kernels.cpu.native import NativeKernels
from model_server.kernels.portable import (
    fused_add_rms_norm_torch,
    rms_norm_torch,
    rotary_embedding_torch,
    silu_and_mul_torch,
)
from model_server.kernels.table import KernelTable

logger = logging.getLogger(__name__)

# Values of the kernels' `dtype` argument (as in native.py).
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# Elements (read or written) worth another thread: these ops stream memory at a few elements
# per nanosecond, so 2^18 is ~0.1 ms, well above a fork/join. A decode step's rows (a few
# thousand elements) and a short prompt's stay on the calling thread.
MIN_ELEMENTS_PER_THREAD = 1 << 18


@cache
def _warn_fallback(kernel: str, reason: str) -> None:
    """Once per process, kernel and reason: every layer and step would repeat it."""
    logger.warning(
        "native CPU %s (kernels/cpu/layer_ops.c) is not used: %s; the portable PyTorch ops "
        "run instead, which are slower",
        kernel,
        reason,
    )


def _dtype_reason(tensors: dict[str, torch.Tensor]) -> str | None:
    """Why the C kernels cannot take these tensors (named for the message), or None."""
    first_name, first = next(iter(tensors.items()))
    if first.device.type != "cpu":
        return f"runs on the CPU only, not {first.device.type}"
    if first.dtype not in _DTYPE_CODES:
        return f"dtype {first.dtype} is not supported (float32 and bfloat16 are)"
    for name, t in tensors.items():
        if t.dtype != first.dtype:
            return f"{name} is {t.dtype} while {first_name} is {first.dtype}"
    return None


def _row_layout(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(t or a copy, inner_rows, outer_stride, inner_stride): row r of t [..., N] starts at
    (r // inner_rows) * outer_stride + (r % inner_rows) * inner_stride elements, as
    layer_ops.c's `Rows` addresses it. Copies only when the last dim is strided or the leading
    dims do not merge into two."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t, 1, 0, 0
    if t.dim() > 3:
        t = t.reshape(-1, *t.shape[-2:])  # a view when the leading dims merge, else a copy
    if t.dim() == 2:
        return t, 1, t.stride(0), 0
    a, b, _ = t.shape
    if b == 1:
        return t, 1, t.stride(0), 0
    if a == 1 or t.stride(0) == b * t.stride(1):  # evenly spaced rows
        return t, 1, t.stride(1), 0
    return t, b, t.stride(0), t.stride(1)  # e.g. Qwen3's [T, H, D] heads of the fused qkv


def _norm_reason(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None
) -> str | None:
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        tensors["residual"] = residual
        if residual.shape != x.shape:
            return f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ in shape"
    if weight.shape != x.shape[-1:]:
        return f"weight {tuple(weight.shape)} does not match x's last dim {x.shape[-1]}"
    return _dtype_reason(tensors)


def _rms_norm_call(
    kernels: NativeKernels,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    min_work_per_thread: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normalized, x + residual or None) as new contiguous tensors of x's shape; x has rows."""
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype)
    sum_out = None if residual is None else torch.empty(x.shape, dtype=x.dtype)
    x, x_inner, x_outer, x_inner_stride = _row_layout(x)
    r_layout = (None, 1, 0, 0) if residual is None else _row_layout(residual)
    weight = weight.contiguous()
    kernels.lib.wick_rms_norm(
        _DTYPE_CODES[x.dtype],
        x.data_ptr(),
        x_inner,
        x_outer,
        x_inner_stride,
        None if r_layout[0] is None else r_layout[0].data_ptr(),
        *r_layout[1:],
        weight.data_ptr(),
        out.data_ptr(),
        None if sum_out is None else sum_out.data_ptr(),
        out.numel() // n,
        n,
        eps,
        torch.get_num_threads(),
        min_work_per_thread,
    )
    return out, sum_out


def rms_norm(
    kernels: NativeKernels,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    min_work_per_thread: int = MIN_ELEMENTS_PER_THREAD,
) -> torch.Tensor:
    """x [..., N] (any layout with unit stride along N is read in place), weight [N] ->
    weight * normalized x, a new contiguous tensor: `rms_norm_torch`'s numerics."""
    reason = _norm_reason(x, weight, None)
    if reason is not None:
        _warn_fallback("rms_norm", reason)
        return rms_norm_torch(x, weight, eps)
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=x.dtype)
    return _rms_norm_call(kernels, x, None, weight, eps, min_work_per_thread)[0]


def fused_add_rms_norm(
    kernels: NativeKernels,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    min_work_per_thread: int = MIN_ELEMENTS_PER_THREAD,
) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual (same shape, rounded to the dtype) -> (rms_norm(s), s), both new
    tensors: `fused_add_rms_norm_torch`'s numerics."""
    reason = _norm_reason(x, weight, residual)
    if reason is not None:
        _warn_fallback("fused_add_rms_norm", reason)
        return fused_add_rms_norm_torch(x, residual, weight, eps)
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
    out, sum_out = _rms_norm_call(kernels, x, residual, weight, eps, min_work_per_thread)
    assert sum_out is not None
    return out, sum_out


def silu_and_mul(
    kernels: NativeKernels,
    x: torch.Tensor,
    *,
    min_work_per_thread: int = MIN_ELEMENTS_PER_THREAD,
) -> torch.Tensor:
    """x [..., 2d] -> silu(x[..., :d]) * x[..., d:], a new contiguous [..., d] tensor:
    `silu_and_mul_torch`'s numerics (silu rounded to the dtype before the product)."""
    reason = _dtype_reason({"x": x})
    if reason is None and x.shape[-1] % 2:
        reason = f"last dim {x.shape[-1]} is odd"
    if reason is not None:
        _warn_fallback("silu_and_mul", reason)
        return silu_and_mul_torch(x)
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype)
    if out.numel() == 0:
        return out
    rows = x.reshape(-1, 2 * d)  # a view for the MLP's [T, 2d]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    kernels.lib.wick_silu_and_mul(
        _DTYPE_CODES[x.dtype],
        rows.data_ptr(),
        rows.stride(0),
        out.data_ptr(),
        rows.shape[0],
        d,
        torch.get_num_threads(),
        min_work_per_thread,
    )
    return out


def _rotary_reason(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> str | None:
    if query.dim() != 3 or key.dim() != 3 or query.shape[-1] != key.shape[-1]:
        return f"query {tuple(query.shape)} and key {tuple(key.shape)} are not [T, heads, D]"
    if positions.shape != query.shape[:1] or key.shape[0] != query.shape[0]:
        return f"positions {tuple(positions.shape)} do not match the tokens of q and k"
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != query.shape[2]:
        return f"cos_sin_cache {tuple(cos_sin_cache.shape)} does not match head_dim"
    if query.shape[2] % 2:
        return f"head_dim {query.shape[2]} is odd"
    return _dtype_reason({"query": query, "key": key, "cos_sin_cache": cos_sin_cache})


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rotary_embedding(
    kernels: NativeKernels,
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    min_work_per_thread: int = MIN_ELEMENTS_PER_THREAD,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary embedding: query [T, H, D] and key [T, Hkv, D] (token and head strides are
    read in place: views of the fused qkv projection), positions [T] int, cos_sin_cache
    [max_position, D] (cos | sin) -> new contiguous (query, key): `rotary_embedding_torch`'s
    numerics. IndexError for a position outside the cache."""
    reason = _rotary_reason(positions, query, key, cos_sin_cache)
    if reason is not None:
        _warn_fallback("rotary_embedding", reason)
        return rotary_embedding_torch(positions, query, key, cos_sin_cache)
    num_tokens, num_heads, head_dim = query.shape
    q_out = torch.empty(query.shape, dtype=query.dtype)
    k_out = torch.empty(key.shape, dtype=key.dtype)
    if num_tokens == 0:
        return q_out, k_out
    query, key = _unit_last_stride(query), _unit_last_stride(key)
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
    cos_sin_cache = cos_sin_cache.contiguous()
    status = kernels.lib.wick_rotary_neox(
        _DTYPE_CODES[query.dtype],
        positions.data_ptr(),
        num_tokens,
        cos_sin_cache.data_ptr(),
        cos_sin_cache.shape[0],
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        q_out.data_ptr(),
        key.data_ptr(),
        key.stride(0),
        key.stride(1),
        k_out.data_ptr(),
        num_heads,
        key.shape[1],
        head_dim,
        torch.get_num_threads(),
        min_work_per_thread,
    )
    if status == -2:
        raise IndexError(
            f"rotary embedding: a position is outside the cache's {cos_sin_cache.shape[0]}"
        )
    return q_out, k_out


def native_kernel_table(kernels: NativeKernels, base: KernelTable) -> KernelTable:
    """`base` with its norm, activation and rotary slots on `kernels`' C functions."""
    return replace(
        base,
        rms_norm=partial(rms_norm, kernels),
        fused_add_rms_norm=partial(fused_add_rms_norm, kernels),
        silu_and_mul=partial(silu_and_mul, kernels),
        rotary_embedding=partial(rotary_embedding, kernels),
    )
