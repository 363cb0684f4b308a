"""Multi-head latent attention (DeepSeek-V2/V3) on the native kernel (kernels/cpu/mla_attention.c,
wick_mla.h): the step's latents stored into the paged latent cache, then absorbed attention for
every query row. layers/attention/mla.py's MLAAttention runs it on the `cpu` backend, and the
native decoder step (decoder_stack.c) calls the same entry point with the same arguments, so
the two give the same bits."""

from __future__ import annotations

import torch

from model_server.kernels.cpu import native

# Multiply-adds that justify one more thread (paged attention's).
MIN_WORK_PER_THREAD = native.MIN_WORK_PER_THREAD


def unsupported_reason(q_nope: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
    """Why `mla_attention` cannot run these inputs, or None."""
    if q_nope.device.type != "cpu" or kv_cache.device.type != "cpu":
        return "runs on the CPU only"
    if q_nope.dtype not in native.DTYPE_CODES:
        return f"dtype {q_nope.dtype} (float32 and bfloat16 are supported)"
    if kv_cache.dtype != q_nope.dtype:
        return f"a {kv_cache.dtype} latent cache under {q_nope.dtype} queries (the query's dtype)"
    if kv_cache.dim() != 3 or not kv_cache.is_contiguous():
        return "a latent cache that is not a contiguous [blocks, block_size, L + R] tensor"
    return None


def mla_attention(
    kernels: native.NativeKernels,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    w_kv_b: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    v_head_dim: int,
) -> torch.Tensor:
    """q_nope [T, H, Dn] (unit stride per head), q_pe [T, H, R] rotated, latent [T, L]
    normalised, k_pe [T, R] rotated (rows with unit stride), w_kv_b [H (Dn + Dv), L], kv_cache
    [blocks, block_size, L + R] (`unsupported_reason` None) -> [T, H Dv]; stores the step's
    [latent, k_pe] at `slot_mapping` first."""
    num_tokens, num_heads, nope = q_nope.shape
    rope, lora = q_pe.shape[-1], latent.shape[-1]
    out = torch.empty(num_tokens, num_heads * v_head_dim, dtype=q_nope.dtype)
    if num_tokens == 0:
        return out
    if q_nope.stride(2) != 1:
        q_nope = q_nope.contiguous()
    q_pe = q_pe.contiguous()
    if latent.stride(1) != 1:
        latent = latent.contiguous()
    if k_pe.stride(1) != 1:
        k_pe = k_pe.contiguous()
    w_kv_b = w_kv_b.contiguous()
    slots = slot_mapping
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        slots = slots.to(torch.int64).contiguous()
    tables = native._int32(block_tables)
    starts, lens = native._int32(query_start_loc), native._int32(seq_lens)
    status = kernels.lib.wick_mla_attention(
        native.DTYPE_CODES[q_nope.dtype],
        q_nope.data_ptr(),
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.data_ptr(),
        latent.data_ptr(),
        latent.stride(0),
        k_pe.data_ptr(),
        k_pe.stride(0),
        w_kv_b.data_ptr(),
        kv_cache.data_ptr(),
        slots.data_ptr(),
        kv_cache.shape[0] * kv_cache.shape[1],
        tables.data_ptr(),
        tables.stride(0),
        starts.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        lens.shape[0],
        num_heads,
        nope,
        rope,
        v_head_dim,
        lora,
        kv_cache.shape[1],
        scale,
        torch.get_num_threads(),
        MIN_WORK_PER_THREAD,
    )
    if status != 0:
        raise RuntimeError(f"native MLA attention failed (status {status})")
    return out
