"""Speculative decoding counters (vLLM's `vllm:spec_decode_*`), as running totals."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodingStats:
    """Totals since start. A draft is one request's drafts verified in one step; position i
    of `num_accepted_tokens_per_pos` counts the steps whose draft i was accepted (a draft is
    accepted only if every one before it was)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's step: `num_draft_tokens` verified, the first `num_accepted_tokens`
        of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def since(self, base: SpecDecodingStats | None) -> SpecDecodingStats:
        """A copy of these totals counted from `base` (an earlier copy; None: from start)."""
        if base is None:
            base = SpecDecodingStats(self.num_spec_tokens)
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts - base.num_drafts,
            self.num_draft_tokens - base.num_draft_tokens,
            self.num_accepted_tokens - base.num_accepted_tokens,
            [
                n - b
                for n, b in zip(
                    self.num_accepted_tokens_per_pos, base.num_accepted_tokens_per_pos, strict=True
                )
            ],
        )
