"""A pooling step's inputs as the pooling models take them: the B sequences' tokens packed one
after another (T tokens in all, no padding), with where each sequence starts."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PackedBatch:
    """`input_ids`, `positions` (0 .. len - 1 within each sequence) and `token_type_ids` are
    [T] int64 on the model's device; `cu_seqlens` [B + 1] int32 on the CPU (sequence s owns
    rows cu[s]:cu[s + 1], what the native attention reads); `lengths` [B] int64 on the device."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    token_type_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def build(
        cls,
        token_ids: list[list[int]],
        token_type_ids: list[list[int] | None],
        device: torch.device,
    ) -> PackedBatch:
        """From each sequence's ids (and segment ids, None: all 0); O(T) list work."""
        lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
        cu = torch.zeros(len(token_ids) + 1, dtype=torch.int32)
        torch.cumsum(lengths, 0, out=cu[1:])
        flat = [t for ids in token_ids for t in ids]
        total = len(flat)
        if all(segs is None for segs in token_type_ids):
            types = torch.zeros(total, dtype=torch.int64)
        else:
            types = torch.tensor(
                [
                    t
                    for ids, segs in zip(token_ids, token_type_ids, strict=True)
                    for t in (segs if segs is not None else [0] * len(ids))
                ],
                dtype=torch.int64,
            )
        starts = torch.repeat_interleave(cu[:-1].to(torch.int64), lengths, output_size=total)
        positions = torch.arange(total, dtype=torch.int64) - starts
        return cls(
            input_ids=torch.tensor(flat, dtype=torch.int64).to(device),
            positions=positions.to(device),
            token_type_ids=types.to(device),
            cu_seqlens=cu,
            lengths=lengths.to(device),
        )

    @property
    def num_seqs(self) -> int:
        return self.lengths.shape[0]

    def first_rows(self) -> torch.Tensor:
        """[B] each sequence's first row (its [CLS] / <s>)."""
        return self.cu_seqlens[:-1].to(device=self.lengths.device, dtype=torch.int64)

    def last_rows(self) -> torch.Tensor:
        """[B] each sequence's last row."""
        return self.cu_seqlens[1:].to(device=self.lengths.device, dtype=torch.int64) - 1
