"""N-gram prompt lookup (vLLM's `ngram` speculative method): drafts copied from the context.

A request's tokens so far (prompt + output) end with some n-gram; if that n-gram occurred
earlier, the tokens that followed it there are a good guess for what comes next (answers that
quote or edit their prompt copy long spans). Pure host work on token lists: no model runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True, frozen=True)
class NgramProposer:
    """Proposes up to `num_speculative_tokens` drafts per request.

    The suffix n-gram is the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs
    earlier in the tokens; of its earlier occurrences the latest wins (the nearest context is
    the likeliest to be copied on). No match: no drafts.
    """

    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}"
            )

    def propose(self, token_ids: Sequence[int], max_drafts: int | None = None) -> list[int]:
        """The drafts that would follow `token_ids`: at most min(num_speculative_tokens,
        max_drafts) tokens, [] when the suffix matches nowhere earlier."""
        k = (
            self.num_speculative_tokens
            if max_drafts is None
            else min(max_drafts, self.num_speculative_tokens)
        )
        n_tokens = len(token_ids)
        if k <= 0 or n_tokens < self.prompt_lookup_min + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        last = n_tokens - 1
        # `ends`: indices j < last where an earlier occurrence of the suffix's last m + 1
        # tokens ends (tokens[j - i] == tokens[last - i] for i in 0..m). Grown one token at a
        # time; the survivors at the longest length >= min are the match.
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        best: np.ndarray | None = ends if self.prompt_lookup_min <= 1 and ends.size else None
        max_len = min(self.prompt_lookup_max, last)  # a suffix of `last` tokens at most
        for m in range(1, max_len):
            ends = ends[ends >= m]
            ends = ends[tokens[ends - m] == tokens[last - m]]
            if ends.size == 0:
                break
            if m + 1 >= self.prompt_lookup_min:
                best = ends
        if best is None:
            return []
        start = int(best[-1]) + 1  # the latest occurrence; start <= last, so >= 1 draft
        return tokens[start : start + k].tolist()
