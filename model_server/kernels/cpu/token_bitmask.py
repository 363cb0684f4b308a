"""xgrammar's CPU kernel for applying a token bitmask in place (layers/sampling/grammar_mask.py).

Kept with the per-device kernels: it runs on fp32 CPU logits only; elsewhere the caller's
PyTorch ops apply the mask.
"""

from __future__ import annotations

import torch


def apply_token_bitmask_cpu(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> bool:
    """In place, when `logits` are fp32 on the CPU: the tokens `bitmask[r]` forbids in each row
    `r` of `rows` become -inf, and True is returned; False (nothing done) otherwise."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return False
    import xgrammar  # installed wherever a grammar exists: it filled the bitmask

    xgrammar.apply_token_bitmask_inplace(
        logits, bitmask, vocab_size=logits.shape[1], indices=rows.tolist()
    )
    return True
