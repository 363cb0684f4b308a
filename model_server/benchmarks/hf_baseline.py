"""The HF transformers baseline of `bench throughput` and `bench latency`.

The engine's model is rebuilt as a transformers model on the engine's device, in the engine's
dtype, with the source's weights when it has them (random weights for `--load-format dummy`: the
output lengths are forced with min_new_tokens, so the values do not matter), and driven through
`generate`. The engine is released first: its KV cache takes most of a GPU's free memory.
"""

from __future__ import annotations

import copy
import gc
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and transformers stay out of import time
    import torch

    from model_server.loader import ModelSource
    from model_server.platforms import Platform

# Left padding; masked out by the attention mask, so any id in the vocabulary does.
PAD_ID = 0


@dataclass(slots=True)
class BaselineTarget:
    """Where and how the engine ran, for a baseline on the same device in the same dtype."""

    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    platform: Platform


def baseline_target(llm: Any) -> BaselineTarget:
    core = llm.engine.core
    runner = core.model_runner
    return BaselineTarget(core.source, runner.device, runner.dtype, runner.platform)


def default_baseline_batch_size(platform: Platform) -> int:
    """16 on CPUs (past that, padded attention costs more than the batch saves); 64 on GPUs,
    which need wide batches to be busy and have the memory for them."""
    return 16 if platform.shares_host_memory else 64


def free_device_memory(platform: Platform) -> None:
    """Collect the released engine (its CUDA-graph runner holds a reference cycle) and hand the
    allocator's cached blocks back to the device, so the next consumer sees the memory as free."""
    gc.collect()
    platform.empty_cache()


def build_hf_model(target: BaselineTarget) -> torch.nn.Module:
    """The transformers model of `target.source`, on `target.device` in `target.dtype`."""
    import torch
    import transformers

    # A copy: from_config writes the dtype into the config, which the engine shares.
    config = copy.deepcopy(target.source.hf_config)
    # Built on the device (initializing 8B parameters there takes a second, not minutes on CPU).
    with torch.device(target.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    model.to(target.device)  # anything created outside the device context
    if target.source.weights is not None:
        _load_weights(model, target.source)
    return model.eval()


def _load_weights(model: torch.nn.Module, source: ModelSource) -> None:
    """Copy the source's HF-named tensors into `model`, one at a time (no whole-checkpoint copy
    in host memory); tensors the model has no place for (derived rotary buffers) are skipped."""
    import torch

    own = model.state_dict()
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in source.weights():
            param = own.get(name)
            if param is None:
                continue
            if tuple(param.shape) != tuple(tensor.shape):
                raise RuntimeError(
                    f"transformers baseline: {name} has shape {tuple(tensor.shape)} in the "
                    f"checkpoint, {tuple(param.shape)} in the model"
                )
            param.copy_(tensor)
            loaded.add(name)
    tied = bool(getattr(source.hf_config, "tie_word_embeddings", False))
    missing = [n for n in own if n not in loaded and not (tied and n == "lm_head.weight")]
    if missing:
        raise RuntimeError(f"transformers baseline is missing weights: {missing[:4]}")
    if tied:
        model.tie_weights()


class HFGenerator:
    """Runs padded batches of token-id prompts through `generate` for exactly `max_new` tokens
    each (greedy), timing them with the device synchronized."""

    def __init__(self, target: BaselineTarget) -> None:
        self.target = target
        self.model = build_hf_model(target)

    def inputs(self, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded input ids and attention mask [len(batch), longest], on the device."""
        import torch

        width = max(len(p) for p in batch)
        ids = [[PAD_ID] * (width - len(p)) + p for p in batch]
        mask = [[0] * (width - len(p)) + [1] * len(p) for p in batch]
        device = self.target.device
        return (
            torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(mask, dtype=torch.int64, device=device),
        )

    def generate(self, batch: list[list[int]], max_new: int) -> None:
        import torch

        ids, mask = self.inputs(batch)
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=PAD_ID,
            )

    def timed(self, batches: list[tuple[list[list[int]], int]]) -> float:
        """Seconds to generate every (batch, max_new) in turn, device work included."""
        sync = self.target.platform.synchronize
        sync()
        start = time.perf_counter()
        for batch, max_new in batches:
            self.generate(batch, max_new)
        sync()
        return time.perf_counter() - start
