"""Applying grammar token bitmasks to the logits of the rows that have a grammar.

A bitmask row is `ceil(V / 32)` int32 words; bit `t % 32` of word `t // 32` is 1 when token `t`
is allowed (the layout xgrammar fills). The step's bitmask has one row per sampling row; only
the constrained rows' are filled and read. A batch without a grammar row never reaches this
module, and in a mixed batch the free rows' logits are not touched (bit for bit).

The mask is applied in place: the runner never reads the logits again, and a copy of
`rows x vocabulary` floats per step would cost more than the mask. On CPU, xgrammar's own kernel
does it (one single-threaded pass per constrained row, no temporaries): PyTorch ops need several
passes and temporaries, and as intra-op parallel work they stalled for tens of milliseconds when
the cores were shared. Other devices use the PyTorch ops.
"""

from __future__ import annotations

import torch

from model_server.kernels.cpu.token_bitmask import apply_token_bitmask_cpu

_BITS_CACHE: dict[torch.device, torch.Tensor] = {}


def _bit_positions(device: torch.device) -> torch.Tensor:
    bits = _BITS_CACHE.get(device)
    if bits is None:
        bits = torch.arange(32, dtype=torch.int32, device=device)
        _BITS_CACHE[device] = bits
    return bits


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool, True where the token is allowed."""
    rows, words = bitmask.shape
    if words * 32 < vocab_size:
        raise ValueError(f"a bitmask of {words} words cannot cover a vocabulary of {vocab_size}")
    bits = (bitmask.unsqueeze(-1) >> _bit_positions(bitmask.device)) & 1
    return bits.view(rows, words * 32)[:, :vocab_size].bool()


def apply_grammar_bitmask(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> torch.Tensor:
    """In place: in each row `r` of `rows` ([R] int64, distinct), the tokens that `bitmask[r]`
    forbids are set to -inf. `logits` [B, V]; `bitmask` [B, ceil(V / 32)] int32 (rows not in
    `rows` are never read). Returns `logits`."""
    batch, vocab_size = logits.shape
    if bitmask.shape[0] != batch or bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(
            f"a bitmask of shape {tuple(bitmask.shape)} does not cover logits of shape "
            f"{tuple(logits.shape)}"
        )
    if apply_token_bitmask_cpu(logits, rows, bitmask):
        return logits
    allowed = unpack_bitmask(bitmask.index_select(0, rows), vocab_size)
    constrained = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, rows, constrained)
