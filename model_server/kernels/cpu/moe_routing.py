"""The CPU kernel table's `moe_grouped_topk` on kernels/cpu/moe_routing.c (DeepSeek's router;
contract in wick_moe_routing.h), and the router's struct the native decoder step reads
(`grouped_topk_struct`, decoder_stack.py).

Both paths run wick_moe_grouped_topk with the same arguments, so the modules and the step choose
the same experts with the same weights, ties included (torch.topk's order of ties and of its
unsorted output is its implementation's; the C router's is best first, a tie to the lower id).
A router the C code does not take (`grouped_topk_reason`) runs the portable `grouped_topk_of`.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from model_server.kernels.cpu import abi
from model_server.kernels.cpu.gemm import MIN_WORK_PER_THREAD as GEMM_MIN_WORK
from model_server.kernels.cpu.native import DTYPE_CODES, NativeKernels
from model_server.kernels.fused_moe_torch import GroupedTopk, grouped_topk_of

# wick_moe_routing.h's MOE_SCORING_* and MOE_TOPK_* constants by the configs' names.
_SCORING = {"softmax": "MOE_SCORING_SOFTMAX", "sigmoid": "MOE_SCORING_SIGMOID"}
_METHODS = {
    ("softmax", "greedy"): "MOE_TOPK_GREEDY",
    ("softmax", "group_limited_greedy"): "MOE_TOPK_GROUP_LIMITED_GREEDY",
    ("sigmoid", "noaux_tc"): "MOE_TOPK_NOAUX_TC",
}


def _grouped(router: GroupedTopk) -> bool:
    """Whether the router limits a token to its best expert groups (grouped_topk's condition)."""
    if router.topk_method == "group_limited_greedy":
        return True
    groups, limit = router.n_group or 0, router.topk_group or 0
    return router.topk_method == "noaux_tc" and groups > 1 and limit > 0


def grouped_topk_reason(router: GroupedTopk) -> str | None:
    """What of the router moe_routing.c does not take, or None."""
    method = (router.scoring, router.topk_method)
    if method not in _METHODS:
        return f"{router.scoring} scoring with topk_method {router.topk_method}"
    weight, bias = router.weight, router.correction_bias
    if weight.dim() != 2 or weight.dtype != torch.float32 or not weight.is_contiguous():
        return "a router weight that is not a contiguous float32 [E, hidden] tensor"
    if not weight.is_cpu:
        return "a router weight off the CPU"
    num_experts = weight.shape[0]
    if bias is not None and (
        tuple(bias.shape) != (num_experts,)
        or bias.dtype != torch.float32
        or not bias.is_contiguous()
        or not bias.is_cpu
    ):
        return "a correction bias that is not a contiguous float32 [E] CPU tensor"
    if not 1 <= router.top_k <= num_experts:
        return f"top {router.top_k} of {num_experts} experts"
    if _grouped(router):
        groups, limit = router.n_group or 0, router.topk_group or 0
        if groups < 1 or num_experts % groups or not 1 <= limit <= groups:
            return f"the best {limit} of {groups} groups of {num_experts} experts"
        if router.scoring == "sigmoid" and num_experts // groups < 2:
            return "groups of one expert (noaux_tc ranks a group by its two best)"
    return None


def grouped_topk_struct(router: GroupedTopk) -> Any:
    """wick_moe_routing.h's WickGroupedTopk of a router `grouped_topk_reason` takes (it points
    at the router's tensors: keep them alive while it is used)."""
    out = abi.structure("WickGroupedTopk")()
    out.scoring = abi.constant(_SCORING[router.scoring])
    out.topk_method = abi.constant(_METHODS[(router.scoring, router.topk_method)])
    out.num_experts, out.top_k = int(router.weight.shape[0]), router.top_k
    out.n_group, out.topk_group = router.n_group or 0, router.topk_group or 0
    out.norm_topk_prob = int(router.norm_topk_prob)
    out.routed_scaling_factor = float(router.routed_scaling_factor)
    out.weight = router.weight.data_ptr()
    bias = router.correction_bias
    out.correction_bias = None if bias is None else bias.data_ptr()
    return out


def native_grouped_topk(
    kernels: NativeKernels, x: torch.Tensor, router: GroupedTopk
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden] -> (weights [T, k] float32, ids [T, k] int64, best first): the kernel
    table's `moe_grouped_topk` (`grouped_topk_of`'s contract)."""
    code = DTYPE_CODES.get(x.dtype)
    if (
        code is None
        or not x.is_cpu
        or x.dim() != 2
        or x.shape[1] != router.weight.shape[-1]
        or grouped_topk_reason(router) is not None
    ):
        return grouped_topk_of(x, router)
    x = x.contiguous()
    num_tokens, hidden = x.shape
    struct = grouped_topk_struct(router)
    weights = torch.empty((num_tokens, router.top_k), dtype=torch.float32)
    ids = torch.empty((num_tokens, router.top_k), dtype=torch.int64)
    lib = kernels.lib
    scratch = torch.empty(
        lib.wick_moe_grouped_topk_bytes(code, num_tokens, hidden, struct.num_experts),
        dtype=torch.uint8,
    )
    status = lib.wick_moe_grouped_topk(
        code, x.data_ptr(), num_tokens, hidden, ctypes.addressof(struct), weights.data_ptr(),
        ids.data_ptr(), scratch.data_ptr(), torch.get_num_threads(), GEMM_MIN_WORK,
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"grouped top-k routing failed (status {status})")
    return weights, ids
