"""The CPU kernel table's mixture-of-experts slots on kernels/cpu/moe.c (`moe_softmax_topk`,
`fused_experts`, `shared_expert_add`; contracts in kernels/table.py and wick_moe.h).

The native decoder step (decoder_stack.c) runs an MoE layer through these same C functions with
the same arguments, so the modules and the step give the same bits. Inputs the C code does not
take (another dtype or device) run the portable PyTorch functions;
GPTQ / AWQ experts run kernels/cpu/moe_wna16.c, experts packed into panels by the preparation's
`ExpertsPlan` (kernels/cpu/experts_plan.py) wick_moe_panel_experts.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from model_server.kernels.cpu.experts_plan import PanelExperts
from model_server.kernels.cpu.gemm import MIN_WORK_PER_THREAD as GEMM_MIN_WORK
from model_server.kernels.cpu.layer_ops import MIN_ELEMENTS_PER_THREAD
from model_server.kernels.cpu.moe_wna16 import native_wna16_experts
from model_server.kernels.cpu.native import DTYPE_CODES, NativeKernels
from model_server.kernels.fused_moe_torch import (
    fused_experts_grouped,
    shared_expert_add,
    softmax_topk,
)

# wick_moe_panel_experts' refusals (wick_moe.h).
_PANEL_ERRORS = {
    -1: "out of memory",
    -3: "w13 and w2 of mismatched shapes",
    -4: "k-pair panels with float32 activations or on a build without AVX512-BF16",
}


def _code(*tensors: torch.Tensor) -> int | None:
    """wick_moe.h's dtype of these tensors when all are CPU tensors of one dtype it takes."""
    first = tensors[0]
    code = DTYPE_CODES.get(first.dtype)
    if code is None or any(not t.is_cpu or t.dtype != first.dtype for t in tensors):
        return None
    return code


def native_softmax_topk(
    kernels: NativeKernels, router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, ids [T, k] int64): `softmax_topk`'s
    contract (ties to the lower expert id)."""
    code = _code(router_logits)
    if code is None or router_logits.dim() != 2 or not 1 <= top_k <= router_logits.shape[1]:
        return softmax_topk(router_logits, top_k, renormalize)
    logits = router_logits.contiguous()
    num_tokens, num_experts = logits.shape
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64)
    status = kernels.lib.wick_moe_softmax_topk(
        code, logits.data_ptr(), num_tokens, num_experts, top_k, int(renormalize),
        weights.data_ptr(), ids.data_ptr(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"moe routing: top {top_k} of {num_experts} experts")
    return weights, ids


def native_fused_experts(
    kernels: NativeKernels,
    x: torch.Tensor,
    w13: Any,
    w2: Any,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    table: Any,
) -> torch.Tensor:
    """`fused_experts_grouped`'s contract (kernels/fused_moe_torch.py) on moe.c: float experts
    in x's dtype; GPTQ / AWQ experts (`WNA16Experts`) on moe_wna16.c (kernels/cpu/
    moe_wna16.py); act-order experts and other dtypes run the grouped PyTorch path on `table`'s
    kernels."""
    if not isinstance(w13, torch.Tensor):  # GPTQ / AWQ codes: moe_wna16.c, where it applies
        out = native_wna16_experts(kernels, x, w13, w2, topk_weights, topk_ids)
        if out is not None:
            return out
    if isinstance(w13, PanelExperts) and isinstance(w2, PanelExperts):  # the experts' plan
        out = native_panel_experts(kernels, x, w13, w2, topk_weights, topk_ids)
        if out is not None:
            return out
        w13, w2 = w13.dequantize(x.dtype), w2.dequantize(x.dtype)  # another dtype: slow path
    float_experts = isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
    code = _code(x, w13, w2) if float_experts else None
    if code is None or x.dim() != 2:
        return fused_experts_grouped(x, w13, w2, topk_weights, topk_ids, table)
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()  # the parameters themselves (already so)
    weights = topk_weights.to(torch.float32).contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    out = torch.empty((num_tokens, hidden), dtype=x.dtype)
    scratch = torch.empty(
        kernels.lib.wick_moe_scratch_bytes(code, num_tokens, top_k, hidden, inter),
        dtype=torch.uint8,
    )
    status = kernels.lib.wick_moe_experts(
        code, x.data_ptr(), num_tokens, hidden, w13.data_ptr(), w2.data_ptr(), num_experts,
        inter, weights.data_ptr(), ids.data_ptr(), top_k, out.data_ptr(), scratch.data_ptr(),
        torch.get_num_threads(), GEMM_MIN_WORK, MIN_ELEMENTS_PER_THREAD,
    )  # fmt: skip
    if status == -2:
        raise IndexError(f"fused experts: an expert id outside [0, {num_experts})")
    if status != 0:
        raise MemoryError("fused experts: the native matmul could not allocate its scratch")
    return out


def native_panel_experts(
    kernels: NativeKernels,
    x: torch.Tensor,
    w13: PanelExperts,
    w2: PanelExperts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor | None:
    """`fused_experts_grouped`'s contract on experts packed into panels (wick_moe.h's
    wick_moe_panel_experts); None where x is not a 2-D CPU tensor of the panels' dtype."""
    code = _code(x, w13.panels, w2.panels)
    if code is None or x.dim() != 2:
        return None
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.k
    top_k = topk_ids.shape[1]
    x = x.contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    out = torch.empty((num_tokens, hidden), dtype=x.dtype)
    lib = kernels.lib
    scratch = torch.empty(
        lib.wick_moe_scratch_bytes(code, num_tokens, top_k, hidden, inter), dtype=torch.uint8
    )
    s13, s2 = w13.struct(), w2.struct()
    status = lib.wick_moe_panel_experts(
        code, x.data_ptr(), num_tokens, ctypes.addressof(s13), ctypes.addressof(s2),
        num_experts, weights.data_ptr(), ids.data_ptr(), top_k, out.data_ptr(),
        scratch.data_ptr(), torch.get_num_threads(), MIN_ELEMENTS_PER_THREAD,
    )  # fmt: skip
    if status == -2:
        raise IndexError(f"fused experts: an expert id outside [0, {num_experts})")
    if status != 0:
        raise RuntimeError(f"wick_moe_panel_experts: {_PANEL_ERRORS.get(status, status)}")
    return out


def native_shared_expert_add(
    kernels: NativeKernels, routed: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor
) -> torch.Tensor:
    """routed [T, H] + sigmoid(gate [T, 1]) * shared [T, H]: `shared_expert_add`'s contract."""
    code = _code(routed, gate, shared)
    if (
        code is None
        or routed.dim() != 2
        or shared.shape != routed.shape
        or gate.shape != (routed.shape[0], 1)
    ):
        return shared_expert_add(routed, gate, shared)
    routed, gate, shared = routed.contiguous(), gate.contiguous(), shared.contiguous()
    out = torch.empty_like(routed)
    kernels.lib.wick_moe_shared_expert_add(
        code, routed.data_ptr(), gate.data_ptr(), shared.data_ptr(), out.data_ptr(),
        routed.shape[0], routed.shape[1],
    )  # fmt: skip
    return out
