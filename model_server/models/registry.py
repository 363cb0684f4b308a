"""Model classes keyed by HF `architectures`, and helpers to build and randomly init a model.

Typical use (the model runner):

    cls = get_model_class(hf_config.architectures)
    model = build_model(hf_config, attn_backend, dtype=torch.float32, device="cpu",
                        max_model_len=4096, kernels=platform.kernel_table())
    model.load_weights(weights)          # or init_dummy_weights(model, seed)
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.attention.backend import AttentionBackend
from model_server.layers.quantization.base import building_quantized_linears
from model_server.layers.quantization.wna16 import checkpoint_quantization
from model_server.models.quantization import keep_float_modules

# architecture -> (module under model_server.models, class name); imported on first use.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),  # Llama 2/3/3.1, Yi, SmolLM2
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Phi3ForCausalLM": ("llama", "LlamaForCausalLM"),  # Phi-3/3.5: fused qkv/gate_up, LongRoPE
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "PhiForCausalLM": ("phi", "PhiForCausalLM"),  # Phi-1/1.5/2
    "StableLmForCausalLM": ("stablelm", "StableLmForCausalLM"),
    "Glm4ForCausalLM": ("glm4", "Glm4ForCausalLM"),
    "GlmForCausalLM": ("glm4", "GlmForCausalLM"),  # GLM-4 -hf layout: no sandwich norms
    "Starcoder2ForCausalLM": ("starcoder2", "Starcoder2ForCausalLM"),
    # Remote-code checkpoints mapped onto Llama / GLM (models/remote_code.py).
    "InternLM2ForCausalLM": ("remote_code", "InternLM2ForCausalLM"),
    "BaichuanForCausalLM": ("remote_code", "BaichuanForCausalLM"),  # 7B (rotary) only
    "BaiChuanForCausalLM": ("remote_code", "BaichuanForCausalLM"),
    "ChatGLMModel": ("remote_code", "ChatGLMForCausalLM"),
    "ChatGLMForConditionalGeneration": ("remote_code", "ChatGLMForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "DbrxForCausalLM": ("dbrx", "DbrxForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen_moe", "QwenMoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen_moe", "QwenMoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekForCausalLM"),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The class for the first supported name in `architectures` (HF config field)."""
    for arch in architectures or []:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            module = importlib.import_module(f"model_server.models.{module_name}")
            return getattr(module, class_name)
    names = ", ".join(architectures or []) or "(none given)"
    raise ValueError(
        f"unsupported architecture {names}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def check_tensor_parallel(config: Any, world_size: int) -> None:
    """Raise TensorParallelSplitError (a ValueError) unless the model for `config` splits over
    `world_size` tensor-parallel ranks. Cheap: reads the config only."""
    if world_size > 1:
        get_model_class(getattr(config, "architectures", None)).check_tensor_parallel(
            config, world_size
        )


def build_model(
    config: Any,
    attn_backend: type[AttentionBackend],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_model_len: int | None = None,
    kernels: KernelTable = TORCH_KERNELS,
) -> nn.Module:
    """Construct the model for `config.architectures` directly on `device` in `dtype`.

    Parameters are allocated uninitialized (no init pass, so building a large model costs only
    the allocation): fill them with `model.load_weights(...)` or `init_dummy_weights`. Buffers
    that checkpoints do not carry (the rotary cos/sin cache, sized by `max_model_len` or else
    `config.max_position_embeddings`) are computed here, which is why the meta device is not used.
    The model is returned in eval mode; no parameter requires grad.

    `kernels` is what every layer computes with, kept by reference (the platform's
    `kernel_table()`; the portable PyTorch table by default): nothing process-wide is switched, so
    models built with different tables coexist.

    A checkpoint kept quantized (`config.quantization_config`: GPTQ, AWQ) gets its linear
    layers built with the checkpoint's tensors instead of float weights (layers/quantization/
    wna16.py): after `load_weights`, call `models.quantization.process_weights_after_loading`.
    """
    cls = get_model_class(getattr(config, "architectures", None))
    quant = checkpoint_quantization(config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), building_quantized_linears(quant):
            model = cls(config, attn_backend, max_model_len=max_model_len, kernels=kernels)
            if quant is not None and quant.modules_to_not_convert:
                keep_float_modules(model, quant.modules_to_not_convert)
    finally:
        torch.set_default_dtype(previous)
    if quant is not None:
        for name, param in model.named_parameters():
            param.checkpoint_name = name  # type: ignore[attr-defined]  # for load errors
    return model.eval().requires_grad_(False)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks and tests: normal(0, 0.02) matrices, zero biases, norm
    weights 1. Deterministic for a given seed and device type."""
    norm_params = {
        id(p)
        for module in model.modules()
        if type(module).__name__.endswith("RMSNorm") or isinstance(module, nn.LayerNorm)
        for p in module.parameters(recurse=False)
    }
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if id(param) in norm_params:
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            gen = generators.get(param.device)
            if gen is None:
                gen = torch.Generator(device=param.device).manual_seed(seed)
                generators[param.device] = gen
            param.normal_(0.0, 0.02, generator=gen)
