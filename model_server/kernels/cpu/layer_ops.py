"""The decoder layer's small ops on the native CPU library (kernels/cpu/layer_ops.c): RMSNorm and
LayerNorm (each with the fused add), SiLU-and-mul, GeGLU (tanh), GELU and the neox rotary
embedding, each one ctypes call where PyTorch runs 3 to 17 ops (their dispatch, not their
arithmetic, is most of a small decode step's host time); and the sampler's greedy argmax.

Each function takes the loaded library first (`native_kernel_table` binds it) and otherwise has
its `KernelTable` slot's signature and the numerics of kernels/portable.py. Inputs the C kernels
do not take (fp16, mixed dtypes, shapes the portable op would broadcast) run the portable op
after ONE warning per kernel and reason; layouts they cannot address in place are copied first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from functools import cache, partial

import torch

from model_server.kernels.cpu.native import DTYPE_CODES, NativeKernels
from model_server.kernels.portable import (
    argmax_torch,
    fused_add_layer_norm_torch,
    fused_add_rms_norm_torch,
    gelu_tanh_and_mul_torch,
    gelu_torch,
    layer_norm_torch,
    rms_norm_torch,
    rotary_embedding_torch,
    silu_and_mul_torch,
)
from model_server.kernels.table import KernelTable

logger = logging.getLogger(__name__)

# Values of the kernels' `dtype` argument (as in native.py).
# Elements (read or written) worth another thread: these ops stream 1-5 elements per
# nanosecond, so 2^14 is 3-16 us of work, a few times a fork/join of threads that are still
# spinning from the step's last matmul (GOMP_SPINCOUNT, model_server/openmp_env.py). Single
# rows stay on the calling thread; from about 16 decode rows on they split. At 2^20 (every
# decode step on one thread) a batch-64 bf16 decode step took 72.4 ms against 71.4 ms now,
# batch 16 26.9 against 26.4 (min of 3, 2-core Zen 4). On a box whose second core is busy the
# step's matmuls wait for it anyway.
MIN_ELEMENTS_PER_THREAD = 1 << 14


@cache
def _warn_fallback(kernel: str, reason: str) -> None:
    """Once per process, kernel and reason: every layer and step would repeat it."""
    logger.warning(
        "native CPU %s (kernels/cpu/layer_ops.c) is not used: %s; the portable PyTorch ops "
        "run instead, which are slower",
        kernel,
        reason,
    )


def _dtype_code(*tensors: torch.Tensor) -> int | None:
    """The kernels' dtype code when the tensors are CPU tensors of one dtype they take, else
    None (`_dtype_reason` then says why). Cheap: it runs on every call."""
    dtype = tensors[0].dtype
    code = DTYPE_CODES.get(dtype)
    if code is None or not all(t.is_cpu and t.dtype == dtype for t in tensors):
        return None
    return code


def _dtype_reason(tensors: dict[str, torch.Tensor]) -> str | None:
    """Why the C kernels cannot take these tensors (named for the message), or None."""
    first_name, first = next(iter(tensors.items()))
    for name, t in tensors.items():
        if not t.is_cpu:
            return f"{name} is on {t.device.type}, not the CPU"
    if first.dtype not in DTYPE_CODES:
        return f"dtype {first.dtype} is not supported (float32 and bfloat16 are)"
    for name, t in tensors.items():
        if t.dtype != first.dtype:
            return f"{name} is {t.dtype} while {first_name} is {first.dtype}"
    return None


def _fallback(kernel: str, reason: str | None) -> None:
    _warn_fallback(kernel, reason or "unsupported inputs")


def _row_layout(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(t or a copy, inner_rows, outer_stride, inner_stride): row r of t [..., N] starts at
    (r // inner_rows) * outer_stride + (r % inner_rows) * inner_stride elements, as
    layer_ops.c's `Rows` addresses it. Copies only when the last dim is strided or the leading
    dims do not merge into two."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 2:  # the hidden states: the common case first
        return t, 1, t.stride(0), 0
    if t.dim() == 1:
        return t, 1, 0, 0
    if t.dim() > 3:
        t = t.reshape(-1, *t.shape[-2:])  # a view when the leading dims merge, else a copy
    a, b, _ = t.shape
    if b == 1:
        return t, 1, t.stride(0), 0
    if a == 1 or t.stride(0) == b * t.stride(1):  # evenly spaced rows
        return t, 1, t.stride(1), 0
    return t, b, t.stride(0), t.stride(1)  # e.g. Qwen3's [T, H, D] heads of the fused qkv


# ---- RMSNorm -----------------------------------------------------------------------------------


def _norm_code(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> int | None:
    """The dtype code when the C RMSNorm takes these inputs, else None (`_norm_reason`)."""
    if weight.shape != x.shape[-1:]:
        return None
    if residual is None:
        return _dtype_code(x, weight)
    return _dtype_code(x, weight, residual) if residual.shape == x.shape else None


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


def _norm_call(
    kernels: NativeKernels,
    code: int,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    min_work_per_thread: int,
    bias: torch.Tensor | None = None,
    layer_norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normalized, x + residual or None) as new contiguous tensors of x's shape: RMSNorm, or
    LayerNorm (`layer_norm`, with `bias` or none)."""
    n = x.shape[-1]
    num_rows = x.numel() // n if n else 0
    out = torch.empty(x.shape, dtype=x.dtype)
    sum_out = None if residual is None else torch.empty(x.shape, dtype=x.dtype)
    if num_rows == 0:
        return out, sum_out
    x, x_inner, x_outer, x_inner_stride = _row_layout(x)
    r_layout = (None, 1, 0, 0) if residual is None else _row_layout(residual)
    if not weight.is_contiguous():
        weight = weight.contiguous()
    params: tuple[int | None, ...] = (weight.data_ptr(),)
    if layer_norm:
        if bias is not None and not bias.is_contiguous():
            bias = bias.contiguous()
        params += (None if bias is None else bias.data_ptr(),)
    entry = kernels.lib.wick_layer_norm if layer_norm else kernels.lib.wick_rms_norm
    entry(
        code,
        x.data_ptr(),
        x_inner,
        x_outer,
        x_inner_stride,
        None if r_layout[0] is None else r_layout[0].data_ptr(),
        *r_layout[1:],
        *params,
        out.data_ptr(),
        None if sum_out is None else sum_out.data_ptr(),
        num_rows,
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
    code = _norm_code(x, weight, None)
    if code is None:
        _fallback("rms_norm", _norm_reason(x, weight, None))
        return rms_norm_torch(x, weight, eps)
    return _norm_call(kernels, code, x, None, weight, eps, min_work_per_thread)[0]


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
    code = _norm_code(x, weight, residual)
    if code is None:
        _fallback("fused_add_rms_norm", _norm_reason(x, weight, residual))
        return fused_add_rms_norm_torch(x, residual, weight, eps)
    out, sum_out = _norm_call(kernels, code, x, residual, weight, eps, min_work_per_thread)
    assert sum_out is not None
    return out, sum_out


# ---- LayerNorm ---------------------------------------------------------------------------------


def _layer_norm_code(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> int | None:
    if bias is not None and (bias.shape != weight.shape or _dtype_code(x, bias) is None):
        return None
    return _norm_code(x, weight, residual)


def _layer_norm_reason(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> str | None:
    if bias is not None:
        if bias.shape != weight.shape:
            return f"bias {tuple(bias.shape)} and weight {tuple(weight.shape)} differ in shape"
        reason = _dtype_reason({"x": x, "bias": bias})
        if reason is not None:
            return reason
    return _norm_reason(x, weight, residual)


def layer_norm(
    kernels: NativeKernels,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    *,
    min_work_per_thread: int = MIN_ELEMENTS_PER_THREAD,
) -> torch.Tensor:
    """x [..., N] (unit stride along N), weight [N], bias [N] or None -> layer_norm(x) * weight
    + bias, a new contiguous tensor: `layer_norm_torch`'s numerics up to the order of the fp32
    sums (layer_ops.c: two passes, one rounding). The native decoder step runs this kernel."""
    code = _layer_norm_code(x, weight, bias, None)
    if code is None:
        _fallback("layer_norm", _layer_norm_reason(x, weight, bias, None))
        return layer_norm_torch(x, weight, bias, eps)
    return _norm_call(
        kernels, code, x, None, weight, eps, min_work_per_thread, bias, layer_norm=True
    )[0]


def fused_add_layer_norm(
    kernels: NativeKernels,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    *,
    min_work_per_thread: int = MIN_ELEMENTS_PER_THREAD,
) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual (same shape, rounded to the dtype) -> (layer_norm(s), s), both new
    tensors: `fused_add_layer_norm_torch`'s numerics (as `layer_norm`)."""
    code = _layer_norm_code(x, weight, bias, residual)
    if code is None:
        _fallback("fused_add_layer_norm", _layer_norm_reason(x, weight, bias, residual))
        return fused_add_layer_norm_torch(x, residual, weight, bias, eps)
    out, sum_out = _norm_call(
        kernels, code, x, residual, weight, eps, min_work_per_thread, bias, layer_norm=True
    )
    assert sum_out is not None
    return out, sum_out


# ---- SiLU-and-mul ------------------------------------------------------------------------------


def _gated(
    kernels: NativeKernels,
    kernel: str,
    fallback: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    min_work_per_thread: int,
) -> torch.Tensor:
    """x [..., 2d] -> act(x[..., :d]) * x[..., d:] on the C entry point `wick_<kernel>`."""
    code = _dtype_code(x)
    if code is None or x.shape[-1] % 2:
        _fallback(kernel, _dtype_reason({"x": x}) or f"last dim {x.shape[-1]} is odd")
        return fallback(x)
    d = x.shape[-1] // 2
    if x.dim() == 2:  # the MLP's [T, 2d], read as it is
        rows, out = x, torch.empty(x.shape[0], d, dtype=x.dtype)
    else:
        rows, out = x.reshape(-1, 2 * d), torch.empty((*x.shape[:-1], d), dtype=x.dtype)
    if out.numel() == 0:
        return out
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    getattr(kernels.lib, f"wick_{kernel}")(
        code,
        rows.data_ptr(),
        rows.stride(0),
        out.data_ptr(),
        rows.shape[0],
        d,
        torch.get_num_threads(),
        min_work_per_thread,
    )
    return out


def silu_and_mul(
    kernels: NativeKernels,
    x: torch.Tensor,
    *,
    min_work_per_thread: int = MIN_ELEMENTS_PER_THREAD,
) -> torch.Tensor:
    """x [..., 2d] -> silu(x[..., :d]) * x[..., d:], a new contiguous [..., d] tensor:
    `silu_and_mul_torch`'s numerics (silu rounded to the dtype before the product)."""
    return _gated(kernels, "silu_and_mul", silu_and_mul_torch, x, min_work_per_thread)


def gelu_tanh_and_mul(
    kernels: NativeKernels,
    x: torch.Tensor,
    *,
    min_work_per_thread: int = MIN_ELEMENTS_PER_THREAD,
) -> torch.Tensor:
    """x [..., 2d] -> gelu_tanh(x[..., :d]) * x[..., d:] (GeGLU), a new contiguous [..., d]
    tensor, each result rounded as `gelu_tanh_and_mul_torch` rounds (its tanh is computed
    otherwise: not PyTorch's bits; the native decoder stack runs this same kernel)."""
    return _gated(kernels, "gelu_tanh_and_mul", gelu_tanh_and_mul_torch, x, min_work_per_thread)


# The kernel's `approximate` codes.
_GELU_APPROXIMATIONS = {"none": 0, "tanh": 1}


def gelu(
    kernels: NativeKernels,
    x: torch.Tensor,
    approximate: str,
    *,
    min_work_per_thread: int = MIN_ELEMENTS_PER_THREAD,
) -> torch.Tensor:
    """gelu(x) ("none": erf, "tanh": the tanh form), a new contiguous tensor rounded once to x's
    dtype: `gelu_torch`'s results up to the last fp32 ulps (layer_ops.c's erfc and tanh are
    computed otherwise: not PyTorch's bits; the native decoder step runs this same kernel)."""
    mode = _GELU_APPROXIMATIONS.get(approximate)
    if mode is None:
        raise ValueError(f"gelu approximate={approximate!r}: 'none' or 'tanh'")
    code = _dtype_code(x)
    if code is None or x.dim() == 0:
        _fallback("gelu", _dtype_reason({"x": x}) or "a 0-d tensor")
        return gelu_torch(x, approximate)
    d = x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    if out.numel() == 0:
        return out
    kernels.lib.wick_gelu(
        code,
        rows.data_ptr(),
        rows.stride(0),
        out.data_ptr(),
        rows.shape[0],
        d,
        mode,
        torch.get_num_threads(),
        min_work_per_thread,
    )
    return out


# ---- Greedy sampling ---------------------------------------------------------------------------


def argmax(
    kernels: NativeKernels,
    logits: torch.Tensor,
    *,
    min_work_per_thread: int = MIN_ELEMENTS_PER_THREAD,
) -> torch.Tensor:
    """logits [B, V] fp32 or bf16 (rows may be strided) -> [B] int64, `argmax_torch`'s answer
    (first index on ties, NaN the largest). torch.argmax took 1.4 ms on 64 rows of 49152 fp32
    logits (2 threads, Zen 4), and 5.7 ms on bf16 ones."""
    code = _dtype_code(logits)
    if code is None or logits.dim() != 2 or logits.shape[1] == 0:
        return argmax_torch(logits)  # other dtypes and shapes: PyTorch's, no warning needed
    rows = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    if rows.shape[0]:
        kernels.lib.wick_argmax(
            code,
            rows.data_ptr(),
            rows.stride(0),
            rows.shape[0],
            rows.shape[1],
            out.data_ptr(),
            torch.get_num_threads(),
            min_work_per_thread,
        )
    return out


# ---- Rotary embedding --------------------------------------------------------------------------


def _rotary_shapes_ok(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> bool:
    """query [T, H, D], key [T, Hkv, D], positions [T], cache [P, D], D even."""
    if query.dim() != 3 or key.dim() != 3 or cos_sin_cache.dim() != 2:
        return False
    num_tokens, _, head_dim = query.shape
    return (
        key.shape[0] == num_tokens
        and key.shape[2] == head_dim
        and cos_sin_cache.shape[1] == head_dim
        and head_dim % 2 == 0
        and positions.shape == query.shape[:1]
    )


def _rotary_reason(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> str | None:
    if not _rotary_shapes_ok(positions, query, key, cos_sin_cache):
        return (
            f"positions {tuple(positions.shape)}, query {tuple(query.shape)}, key "
            f"{tuple(key.shape)} and cos_sin_cache {tuple(cos_sin_cache.shape)} are not "
            "[T], [T, H, D], [T, Hkv, D] and [max_position, D] with an even D"
        )
    return _dtype_reason({"query": query, "key": key, "cos_sin_cache": cos_sin_cache})


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
    code = _dtype_code(query, key, cos_sin_cache)
    if code is None or not _rotary_shapes_ok(positions, query, key, cos_sin_cache):
        _fallback("rotary_embedding", _rotary_reason(positions, query, key, cos_sin_cache))
        return rotary_embedding_torch(positions, query, key, cos_sin_cache)
    num_tokens, num_heads, head_dim = query.shape
    q_out = torch.empty(query.shape, dtype=query.dtype)
    k_out = torch.empty(key.shape, dtype=key.dtype)
    if num_tokens == 0:
        return q_out, k_out
    if query.stride(2) != 1:
        query = query.contiguous()
    if key.stride(2) != 1:
        key = key.contiguous()
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
    if not cos_sin_cache.is_contiguous():
        cos_sin_cache = cos_sin_cache.contiguous()
    status = kernels.lib.wick_rotary_neox(
        code,
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
        head_dim,  # rotary_dim: every dim of the heads given
        torch.get_num_threads(),
        min_work_per_thread,
    )
    if status == -2:
        raise IndexError(
            f"rotary embedding: a position is outside the cache's {cos_sin_cache.shape[0]}"
        )
    return q_out, k_out


def native_kernel_table(kernels: NativeKernels, base: KernelTable) -> KernelTable:
    """`base` with its norm, activation, rotary and argmax slots on `kernels`' C functions."""
    return replace(
        base,
        rms_norm=partial(rms_norm, kernels),
        fused_add_rms_norm=partial(fused_add_rms_norm, kernels),
        layer_norm=partial(layer_norm, kernels),
        fused_add_layer_norm=partial(fused_add_layer_norm, kernels),
        gelu=partial(gelu, kernels),
        silu_and_mul=partial(silu_and_mul, kernels),
        gelu_tanh_and_mul=partial(gelu_tanh_and_mul, kernels),
        rotary_embedding=partial(rotary_embedding, kernels),
        argmax=partial(argmax, kernels),
    )
