"""Engine-side state of one pooling request. Pure Python."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from model_server.engine.pooling.params import PoolingParams


@dataclass(slots=True)
class PoolingRequest:
    """One input to pool: a text's token ids, or a (query, document) pair's for a cross-encoder
    (`token_type_ids` then mark the document's tokens with 1). Computed whole in one step, since
    an encoder attends both ways; nothing of it is kept afterwards."""

    request_id: str
    prompt_token_ids: list[int]
    params: PoolingParams
    token_type_ids: list[int] | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class PoolingOutput:
    """`embedding`: the pooled vector (float32, normalized and truncated as asked) for an
    embedding request; `score`: the cross-encoder's raw logit for a score request."""

    request_id: str
    num_prompt_tokens: int
    embedding: list[float] | None = None
    score: float | None = None
