"""Routed experts kept as GPTQ / AWQ codes on kernels/cpu/moe_wna16.c (contract in
wick_moe_wna16.h): the CPU kernel table's `fused_experts` on `WNA16Experts` (kernels/cpu/moe.py
dispatches here) and the native decoder step's MoE layers (decoder_stack.py fills WickMoE's
`w13_wna16` / `w2_wna16` with `experts_struct`) run the same C function with the same
arguments, so the modules and the step give the same bits.

The experts are layers/quantization/wna16_moe.py's `WNA16Experts`, read by attribute (kernels
never import layers): codes [E, N, K / 2 or K] uint8, scales and offsets [E, N, G] float32,
`bits`, `group_size`, `perm` [E, K] int64 or None (act-order: the C code gathers each
expert's input columns in that order, as the torch path's index_select does).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from model_server.kernels.cpu import abi
from model_server.kernels.cpu.layer_ops import MIN_ELEMENTS_PER_THREAD
from model_server.kernels.cpu.native import DTYPE_CODES, NativeKernels
from model_server.kernels.cpu.wna16 import MIN_WORK_PER_THREAD as WNA16_MIN_WORK
from model_server.kernels.portable import WNA16_BLOCK

# wick_moe_wna16.h's refusals.
_ERRORS = {
    -1: "out of memory",
    -3: "w13 and w2 of mismatched shapes",
}


def experts_reason(w13: Any, w2: Any, dtype: torch.dtype) -> str | None:
    """Why moe_wna16.c cannot run these stacked experts with `dtype` activations, or None."""
    for name, w in (("w13", w13), ("w2", w2)):
        codes = getattr(w, "codes", None)
        if not isinstance(codes, torch.Tensor) or codes.dim() != 3:
            return f"experts kept as {type(w).__name__} (native: float or GPTQ/AWQ codes)"
        perm = w.perm
        if perm is not None and (
            perm.dtype != torch.int64 or not perm.is_contiguous() or not perm.is_cpu
        ):
            return f"act-order {name} experts whose perm is not a contiguous CPU int64 tensor"
        _, _, k = w.shape
        if w.bits not in (4, 8) or w.group_size % WNA16_BLOCK or k % WNA16_BLOCK:
            return (
                f"{name} experts of {w.bits} bits, group {w.group_size}, K {k} (native: 4 or "
                f"8 bits, group size and K multiples of {WNA16_BLOCK})"
            )
        tensors = (codes, w.scales, w.offsets)
        if not all(t.is_cpu and t.is_contiguous() for t in tensors) or any(
            t.dtype != torch.float32 for t in tensors[1:]
        ):
            return f"{name} experts' codes, scales or offsets not contiguous CPU float32 tensors"
    (e13, n13, k13), (e2, n2, k2) = w13.shape, w2.shape
    if e13 != e2 or n13 != 2 * k2 or n2 != k13:
        return "experts of mismatched shapes"
    if dtype not in DTYPE_CODES:
        return f"{dtype} activations (native: float32, bfloat16)"
    return None


def experts_struct(w: Any) -> ctypes.Structure:
    """wick_moe_wna16.h's WickExpertsWNA16 of one projection of the experts (it holds their
    tensors' addresses: the tensors must outlive it)."""
    out = abi.structure("WickExpertsWNA16")()
    _, out.n, out.k = w.shape
    out.codes = w.codes.data_ptr()
    out.scales, out.offsets = w.scales.data_ptr(), w.offsets.data_ptr()
    out.bits, out.group_size = w.bits, w.group_size
    out.min_work_per_thread = WNA16_MIN_WORK
    out.perm = None if w.perm is None else w.perm.data_ptr()
    return out


def native_wna16_experts(
    kernels: NativeKernels,
    x: torch.Tensor,
    w13: Any,
    w2: Any,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor | None:
    """`fused_experts_grouped`'s contract (kernels/fused_moe_torch.py) on moe_wna16.c: x [T, H]
    fp32 or bf16 on the CPU; None where the C function does not take these inputs
    (`experts_reason`, x's device or shape)."""
    if x.dim() != 2 or not x.is_cpu or experts_reason(w13, w2, x.dtype) is not None:
        return None
    num_tokens, hidden = x.shape
    num_experts, _, inter = w2.shape
    top_k = topk_ids.shape[1]
    x = x.contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    out = torch.empty((num_tokens, hidden), dtype=x.dtype)
    code = DTYPE_CODES[x.dtype]
    lib = kernels.lib
    scratch = torch.empty(
        lib.wick_moe_wna16_scratch_bytes(code, num_tokens, top_k, hidden, inter),
        dtype=torch.uint8,
    )
    s13, s2 = experts_struct(w13), experts_struct(w2)
    status = lib.wick_moe_wna16_experts(
        code, x.data_ptr(), num_tokens, ctypes.addressof(s13), ctypes.addressof(s2),
        num_experts, weights.data_ptr(), ids.data_ptr(), top_k, out.data_ptr(),
        scratch.data_ptr(), torch.get_num_threads(), MIN_ELEMENTS_PER_THREAD,
    )  # fmt: skip
    if status == -2:  # the layout was checked above
        raise IndexError(f"fused experts: an expert id outside [0, {num_experts})")
    if status != 0:
        raise RuntimeError(f"wick_moe_wna16_experts: {_ERRORS.get(status, status)}")
    return out
