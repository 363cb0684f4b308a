"""Per-request pooling options (the engine-side counterpart of SamplingParams)."""

from __future__ import annotations

from dataclasses import dataclass

from model_server.engine.pooling.config import PoolingTask


@dataclass(slots=True, frozen=True)
class PoolingParams:
    """`task`: what the request wants (must be the model's). `normalize`: None takes the model's
    default. `dimensions`: keep the first N dims (Matryoshka), None keeps all."""

    task: PoolingTask = PoolingTask.EMBED
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")
