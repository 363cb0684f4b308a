"""What the loader hands the engine: a config, a tokenizer and a lazy stream of HF-named weights."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay out of import time
    import torch
    import transformers

WeightIterator = Iterator[tuple[str, "torch.Tensor"]]
# For a config that names no context length.
_FALLBACK_CONTEXT = 2048


class ModelLoadError(ValueError):
    """A model reference that cannot be loaded; the message names the file and the problem."""


@dataclass(slots=True)
class ModelSource:
    """A resolved model, ready for the engine.

    `weights()` starts a fresh pass over the checkpoint each call and yields `(hf_name, tensor)`
    pairs with standard HF names (`model.layers.0.self_attn.q_proj.weight`, ...), one tensor at a
    time, in the dtype the checkpoint stores (GGUF quantized tensors are dequantized to float32).
    `num_weights` is how many pairs one pass yields, for the caller's progress bar: the loader
    draws none itself. For a tied-embedding checkpoint no `lm_head.weight` is yielded.
    """

    hf_config: transformers.PretrainedConfig
    tokenizer: transformers.PreTrainedTokenizerBase | None
    path: str  # resolved local .gguf file, HF folder, or (dummy) config JSON
    weights: Callable[[], WeightIterator] | None  # None for load_format="dummy"
    num_weights: int
    format: str = "hf"  # "hf" (safetensors folder) | "gguf" | "dummy"
    # GGUF only: the same stream with block-quantized matrices yielded as
    # `layers.quantization.gguf.GGUFTensor` (their blocks, nothing dequantized), for
    # `models.gguf_weights.GGUFWeightCollector`; None for other formats.
    quantized_weights: Callable[[], WeightIterator] | None = None

    @property
    def context_length(self) -> int:
        """The model's own context length (what `max_model_len` defaults to)."""
        return int(getattr(self.hf_config, "max_position_embeddings", 0) or _FALLBACK_CONTEXT)
