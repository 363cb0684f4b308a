"""Round-to-nearest quantization into GPTQ and AWQ checkpoint tensors (the writers' side of
wna16.py): what `wick quantize` writes, and what the tests build tiny checkpoints with.

No calibration (GPTQ's Hessian updates, AWQ's activation-aware scaling): each group of
`group_size` input features gets min/max scales and zero points, and every weight its nearest
code. The tensors are laid out exactly as AutoGPTQ/GPTQModel (checkpoint_format "gptq": zeros
stored minus one) and AutoAWQ (GEMM) write them; see wna16.py for the layouts.
"""

from __future__ import annotations

import torch

from model_server.layers.quantization.wna16 import AWQ_ORDER


def quantize_groups(
    w: torch.Tensor, bits: int, group_size: int, sym: bool, g_idx: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] int64 codes, scales [G, N] float16, zeros [G, N] int64), with
    w ~= scales[g] * (q - zeros[g]) for g = g_idx[k] (k // group_size when None; -1: one group).

    Symmetric: zero = 2^(bits-1), scale = 2 max|w| / (2^bits - 1) (GPTQ's sym). Asymmetric:
    scale = (max - min) / (2^bits - 1), zero = round(-min / scale), kept >= 1 so that the
    "zeros minus one" convention can store it."""
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    if g_idx is None:
        g_idx = torch.arange(k) // gs
    groups = -(-k // gs)  # the last group is short where gs does not divide K
    maxq = (1 << bits) - 1
    w = w.float()
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    q = torch.empty(n, k, dtype=torch.int64)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        part = w[:, cols]
        if sym:
            scale = 2 * part.abs().amax(1) / maxq
            scale = torch.where(scale > 0, scale, torch.ones_like(scale)).half().float()
            zero = torch.full((n,), (maxq + 1) // 2, dtype=torch.int64)
        else:
            lo, hi = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
            scale = (hi - lo) / maxq
            scale = torch.where(scale > 0, scale, torch.ones_like(scale)).half().float()
            zero = torch.round(-lo / scale).long().clamp(1, maxq)
        codes = torch.round(part / scale[:, None]) + zero[:, None]
        q[:, cols] = codes.clamp(0, maxq).long()
        scales[g], zeros[g] = scale, zero
    return q, scales.half(), zeros


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> the same bits as int32."""
    return torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32)


def pack_along(
    codes: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """int64 codes -> int32, 32 / bits codes per int32 along `dim`, low bits first; `order[j]`:
    which code of each run of 32 / bits goes into bits [bits j, bits (j + 1)) (AWQ)."""
    pack = 32 // bits
    moved = codes.movedim(dim, -1)
    runs = moved.reshape(*moved.shape[:-1], moved.shape[-1] // pack, pack)
    if order is not None:
        runs = runs[..., list(order)]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    packed = ((runs & ((1 << bits) - 1)) << shifts).sum(-1)
    return _to_int32(packed).movedim(-1, dim)


def gptq_tensors(
    w: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool = True,
    g_idx: torch.Tensor | None = None,
    v2: bool = False,
) -> dict[str, torch.Tensor]:
    """A Linear's weight [N, K] -> {qweight, qzeros, scales, g_idx} as GPTQ checkpoints store
    them (zeros minus one unless `v2`)."""
    k = w.shape[1]
    gs = k if group_size == -1 else group_size
    if g_idx is None:
        g_idx = torch.arange(k) // gs
    q, scales, zeros = quantize_groups(w, bits, group_size, sym, g_idx)
    stored = zeros if v2 else zeros - 1
    return {
        "qweight": pack_along(q.t(), bits, 0),  # [K / pack, N]
        "qzeros": pack_along(stored, bits, 1),  # [G, N / pack]
        "scales": scales,  # [G, N]
        "g_idx": g_idx.to(torch.int32),
    }


def awq_tensors(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """A Linear's weight [N, K] -> {qweight, qzeros, scales} as AutoAWQ (GEMM, 4 bits) stores
    them."""
    q, scales, zeros = quantize_groups(w, 4, group_size, sym=False)
    return {
        "qweight": pack_along(q.t(), 4, 1, AWQ_ORDER),  # [K, N / 8]
        "qzeros": pack_along(zeros, 4, 1, AWQ_ORDER),  # [G, N / 8]
        "scales": scales,
    }
