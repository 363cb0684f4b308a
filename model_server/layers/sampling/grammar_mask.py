"""Applying grammar token bitmasks to the logits of the rows that have a grammar.

A bitmask row is `ceil(V / 32)` int32 words; bit `t % 32` of word `t // 32` is 1 when token `t`
is allowed (the layout xgrammar fills). Only the constrained rows are read and written: a batch
without a grammar row never reaches this module, and in a mixed batch the free rows' logits are
left as they are (bit for bit).

On CPU the mask is applied by xgrammar's own kernel (one single-threaded pass per row, about
0.1 ms for a 49k vocabulary): unpacking the bits with PyTorch ops takes several passes over
`R x V` elements and, as intra-op parallel work, stalls badly when the cores are shared. Other
devices use the PyTorch ops.
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


def mask_rows_inplace(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """`logits` [R, V] (a tensor of the caller's own): forbidden tokens -> -inf, in place."""
    vocab_size = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(
            f"a bitmask of {bitmask.shape[1]} words cannot cover a vocabulary of {vocab_size}"
        )
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        import xgrammar  # installed wherever a grammar exists: it filled the bitmask

        xgrammar.apply_token_bitmask_inplace(logits, bitmask.cpu(), vocab_size=vocab_size)
        return
    allowed = unpack_bitmask(bitmask.to(logits.device), vocab_size)
    logits.masked_fill_(~allowed, float("-inf"))


def apply_grammar_bitmask(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> torch.Tensor:
    """`logits` [B, V] with the tokens that `bitmask` [R, W] forbids set to -inf in rows `rows`
    [R] int64 (distinct). Returns a new tensor: the input is not modified."""
    constrained = logits.index_select(0, rows)
    mask_rows_inplace(constrained, bitmask)
    return logits.index_copy(0, rows, constrained)
