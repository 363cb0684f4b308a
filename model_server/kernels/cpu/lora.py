"""The CPU's batched LoRA (kernels/cpu/lora.c, punica-style shrink/expand over rows grouped by
adapter slot): `lora_struct` describes a layer's slots (kernels/lora_weights.py's StackedLoRA)
as wick_lora.h's WickLoRA, once; `lora_add` adds the step's adapters' products to a layer's
output. The per-module path (model_server/lora/layers.py) calls `lora_add`; the native decoder
step reads the same struct from each WickLinear (decoder_stack.c's run_linear), so both paths
give the same bits."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from model_server.kernels.cpu import abi, native
from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.lora_weights import StackedLoRA

# Multiply-adds worth a second thread (the kernel counts a slot's rows in whole register tiles
# of 4, the work its weights' read costs). A layer's adapters run 120 times per step on a
# 30-layer model, each call a few hundred thousand multiply-adds at 16 decode rows, and what
# they cost is the ~38 MB of 4 adapters' bf16 weights read per step. Busy 2-core Zen 5,
# SmolLM2's 120 calls of a 16-row step over 4 rank-16 bf16 adapters (ctypes calls, no Python
# checks): 2.3 ms on one thread, 1.3 ms on two at 2^17 (the machine streams ~40 GB/s); 4 rows
# (one per adapter): 1.9 / 1.2 ms. On a loaded machine a fork/join per call can cost more than
# it saves, as for every kernel here; the threshold is chosen for a machine the server has to
# itself.
MIN_WORK_PER_THREAD = 1 << 17
# wick_lora_add's refusals.
_ERRORS = {
    -1: "out of memory",
    -2: "a row's slot is outside [-1, max_loras)",
    -3: "a malformed layer description",
}


def lora_struct(stack: StackedLoRA) -> ctypes.Structure:
    """wick_lora.h's WickLoRA for `stack` (its tensors must outlive it: the struct holds their
    addresses). ValueError where the kernel cannot read them."""
    max_slices = abi.constant("MAX_LORA_SLICES")
    tensors = (stack.a, stack.b, stack.ranks)
    if len(stack.slices) > max_slices:
        raise ValueError(f"LoRA: {len(stack.slices)} slices, the kernel takes {max_slices}")
    if any(not t.is_cpu or not t.is_contiguous() for t in tensors):
        raise ValueError("LoRA slots: the native kernel reads contiguous CPU tensors")
    if stack.a.dtype not in native.DTYPE_CODES or stack.b.dtype != stack.a.dtype:
        raise ValueError(
            f"LoRA slots: A {stack.a.dtype} and B {stack.b.dtype} (the native kernel reads both "
            "float32 or both bfloat16)"
        )
    out = abi.structure("WickLoRA")()
    out.num_slices = len(stack.slices)
    out.max_loras, out.max_rank = stack.max_loras, stack.max_rank
    out.k, out.n = int(stack.a.shape[2]), int(stack.b.shape[2])
    out.a, out.b, out.ranks = stack.a.data_ptr(), stack.b.data_ptr(), stack.ranks.data_ptr()
    for i, (offset, size) in enumerate(stack.slices):
        out.slice_offset[i], out.slice_size[i] = offset, size
    out.min_work_per_thread = MIN_WORK_PER_THREAD
    out.weight_dtype = native.DTYPE_CODES[stack.a.dtype]
    return out


def lora_kernels(x: torch.Tensor) -> native.NativeKernels | None:
    """The build that runs `lora_add` on activations like `x`, or None (another dtype or
    device, or no native build)."""
    if x.dtype not in native.DTYPE_CODES or not x.is_cpu:
        return None
    return default_kernels()


def lora_add(
    kernels: native.NativeKernels,
    x: torch.Tensor,
    y: torch.Tensor,
    token_slots: torch.Tensor,
    lora: Any,
) -> None:
    """y [T, out] += each row's slot's product of x [T, in] (token_slots [T] int32, -1: none),
    in place; `lora` is `lora_struct`'s. x and y in one dtype, rows with unit column stride."""
    m = x.shape[0]
    if x.dim() != 2 or y.dim() != 2 or y.shape[0] != m or x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError(f"LoRA: x {tuple(x.shape)} and y {tuple(y.shape)} are not [T, n] rows")
    if y.dtype != x.dtype or x.shape[1] != lora.k or y.shape[1] != lora.n:
        raise ValueError(
            f"LoRA: x {tuple(x.shape)} {x.dtype} and y {tuple(y.shape)} {y.dtype} for a layer "
            f"of {lora.k} inputs and {lora.n} outputs"
        )
    if token_slots.dtype != torch.int32 or token_slots.shape != (m,):
        raise ValueError(f"LoRA: token slots {tuple(token_slots.shape)} {token_slots.dtype}")
    slots = token_slots.contiguous()  # alive until the call returns
    status = kernels.lib.wick_lora_add(
        native.DTYPE_CODES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        y.data_ptr(),
        y.stride(0),
        m,
        slots.data_ptr(),
        ctypes.addressof(lora),
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"wick_lora_add: {_ERRORS.get(status, status)}")
