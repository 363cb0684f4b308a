"""Tiny random base models saved by transformers and PEFT adapters made on them (random,
non-zero A and B: `init_lora_weights=False`), with their merged float32 references."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

VOCAB = 256

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=False,
    ),
    "gemma": dict(
        model_type="gemma",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        hidden_activation="gelu_pytorch_tanh",
    ),
}

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_base(folder: Path, family: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A random float32 model of `family` saved in `folder` (safetensors)."""
    torch.manual_seed(seed)
    spec = dict(FAMILIES[family])
    config = transformers.AutoConfig.for_model(
        spec.pop("model_type"),
        vocab_size=VOCAB,
        max_position_embeddings=256,
        initializer_range=0.05,
        **spec,
    )
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(folder, safe_serialization=True)
    return hf


@dataclass
class Adapter:
    path: Path
    merged: transformers.PreTrainedModel  # the base with the adapter merged (float32, eval)


def make_adapter(
    base_folder: Path,
    folder: Path,
    *,
    r: int,
    alpha: float,
    targets: list[str] | None = None,
    rslora: bool = False,
    seed: int = 1,
    **extra: Any,
) -> Adapter:
    """A PEFT LoRA adapter with random A and B on the model in `base_folder`, saved in
    `folder`; returns it with the merged model."""
    import peft

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets or ALL_TARGETS,
        use_rslora=rslora,
        init_lora_weights=False,
        lora_dropout=0.0,
        **extra,
    )
    model = peft.get_peft_model(base, config)
    model.save_pretrained(folder, safe_serialization=True)
    merged = model.merge_and_unload().eval()
    return Adapter(folder, merged)


def reference_logprobs(model: transformers.PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position of `tokens` [len, vocab]."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
