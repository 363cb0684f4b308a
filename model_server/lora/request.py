"""Which adapter a request runs with (vLLM's `LoRARequest`). Plain values: the scheduler, the
KV cache manager and the HTTP layer all read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class LoRARequest:
    """An adapter by name, with the folder it is read from.

    `lora_int_id` is unique per adapter registered with the server (a name unloaded and loaded
    again gets a new id), so that state keyed by it (device slots, prefix-cache entries) never
    outlives the adapter it was made for. Ids start at 1; the base model has none."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be at least 1, got {self.lora_int_id}")

    @property
    def prefix_cache_key(self) -> tuple[str, int]:
        """What the prefix cache keys this adapter's blocks by (besides their tokens)."""
        return (self.lora_name, self.lora_int_id)
