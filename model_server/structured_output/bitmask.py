"""The step's token bitmask: one row per sampling request that has a grammar."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from model_server.structured_output.manager import RequestGrammar


class ConstrainedRequest(Protocol):
    @property
    def grammar(self) -> RequestGrammar | None: ...
    @property
    def output_token_ids(self) -> list[int]: ...


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def fill_grammar_bitmask(
    requests: Sequence[ConstrainedRequest], vocab_size: int
) -> tuple[list[int], torch.Tensor] | None:
    """(rows, [len(requests), ceil(V / 32)] int32 bitmask on the host) for the rows of
    `requests` (the sampler's rows, in order) that have a grammar; only those rows of the bitmask
    are filled (the others are never read). None when no row has a grammar, so a free batch
    pays one pass over the list and nothing else."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return None
    bitmask = torch.empty((len(requests), bitmask_words(vocab_size)), dtype=torch.int32)
    for i in rows:
        grammar = requests[i].grammar
        assert grammar is not None
        grammar.sync(requests[i].output_token_ids)
        grammar.fill_bitmask(bitmask, i)
    return rows, bitmask
