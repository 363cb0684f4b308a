"""Applying grammar token bitmasks to the logits of the rows that have a grammar.

A bitmask row is `ceil(V / 32)` int32 words; bit `t % 32` of word `t // 32` is 1 when token `t`
is allowed (the layout both xgrammar and llguidance fill). Only the constrained rows are read and
written: a batch without a grammar row never reaches this module, and in a mixed batch the free
rows' logits are left as they are (bit for bit).
"""

from __future__ import annotations

import torch

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
    """`logits` [B, V] with the tokens that `bitmask` [R, W] forbids set to -inf in rows `rows`
    [R] int64 (distinct). Returns a new tensor: the input is not modified."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    constrained = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, rows, constrained)
