"""Batches pooling requests under the token budget, first come first served.

Pure policy, like `engine/core/scheduler.py`, whose budget it shares
(`--max-num-batched-tokens`, `--max-num-seqs`), but without a KV cache: a pooling request is a
prefill that is never continued, so it is scheduled whole (an encoder's attention is
bidirectional: a chunk would not see the tokens after it) and forgets everything once pooled.
The runner packs a step's inputs (no padding), so the budget counts their tokens:
`sum(num_tokens) <= max_num_batched_tokens`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from model_server.engine.pooling.request import PoolingRequest


class PoolingScheduler:
    """Invariant: every waiting request fits a step alone (`num_tokens <= max_num_batched_tokens`,
    checked on arrival), so the queue always moves."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        self.max_num_seqs = max_num_seqs
        # As the generative scheduler without chunked prefill: the budget holds the longest input.
        self.max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        self.max_model_len = max_model_len
        self.waiting: deque[PoolingRequest] = deque()

    def add_request(self, request: PoolingRequest) -> None:
        if request.num_tokens == 0:
            raise ValueError("The input is empty: at least one token is required.")
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum input length is {self.max_model_len} tokens, but the input "
                f"has {request.num_tokens} tokens. Shorten it or ask for truncation."
            )
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def schedule(self) -> list[PoolingRequest]:
        """This step's requests, in arrival order; the first that does not fit ends the batch, so
        later requests never overtake it."""
        batch: list[PoolingRequest] = []
        tokens = 0
        while self.waiting and len(batch) < self.max_num_seqs:
            request = self.waiting[0]
            if tokens + request.num_tokens > self.max_num_batched_tokens:
                break
            batch.append(self.waiting.popleft())
            tokens += request.num_tokens
        return batch

    def finish_requests(self, request_ids: Iterable[str]) -> None:
        """Drop waiting requests (aborted); running ones finish within their step anyway."""
        ids = set(request_ids)
        if ids:
            self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
