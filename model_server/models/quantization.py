"""Quantize a loaded model in place (`--quantization int8`; the format is layers/quantization/),
and finish loading a checkpoint kept quantized (GPTQ, AWQ: `process_weights_after_loading`).

It lives above the layers because it walks a whole model for the layer classes that hold matrices.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from model_server.config import QUANTIZATION_METHODS
from model_server.layers.embedding import ParallelLMHead
from model_server.layers.fused_moe import FusedMoE
from model_server.layers.linear import LinearBase
from model_server.layers.quantization import QuantizedWeight, quantize_int8
from model_server.layers.quantization.int8 import quantize_int8_wna16


def quantize_model(model: nn.Module, method: str, layout: str = "int8") -> None:
    """Quantize every linear layer and the LM head of a loaded model in place, held in `layout`
    ("int8": `Int8Weight`; "wna16": the same weights as 8-bit wNa16 codes, see
    layers/quantization/int8.py). The float weights are released (a tied embedding keeps its
    own)."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization method {method!r}")
    if layout not in ("int8", "wna16"):
        raise ValueError(f"unknown int8 weight layout {layout!r}")
    quantize = quantize_int8 if layout == "int8" else quantize_int8_wna16
    for module in list(model.modules()):
        if isinstance(module, LinearBase | ParallelLMHead) and isinstance(
            module.weight, torch.Tensor
        ):
            quantized = quantize(module.weight)
            del module.weight  # this module's reference only: a tied embedding keeps the table
            module.weight = quantized


def process_weights_after_loading(model: nn.Module) -> None:
    """Turn the loaded checkpoint tensors of every quantized linear layer and MoE experts
    (GPTQ, AWQ) into their QuantizedWeights; nothing for a float model. Call once, after
    `model.load_weights`."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
    finish = getattr(model, "process_weights_after_loading", None)
    if finish is not None:  # a family's own step over the repacked weights (DeepSeek's rope)
        finish()


def matches_module_pattern(name: str, patterns: Sequence[str]) -> bool:
    """Whether module `name` is one a checkpoint's `modules_to_not_convert` lists: transformers'
    rule (a pattern matches from the start up to a module boundary, also as a regex such as
    "layers.*.gate", or as a suffix), and a run of whole dotted names anywhere ("shared_expert"
    in "model.layers.0.mlp.shared_expert.up_proj", as vLLM's substring test, on boundaries)."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    for key in patterns:
        if name.endswith(key) or re.search(rf"(?:^|\.){re.escape(key)}(?:\.|$)", name):
            return True
        try:
            if re.match(rf"(?:{key}){boundary}", name):
                return True
        except re.error:
            pass  # not a regex: the other rules alone
    return False


def _checkpoint_names(model: nn.Module, name: str) -> list[list[str]]:
    """The checkpoint names of module `name`'s parts (a fused qkv_proj: q_proj, k_proj,
    v_proj), each as we name it and as the model's renames undo it (Mixtral: mlp ->
    block_sparse_moe)."""
    stacked = getattr(model, "STACKED_PARAMS", ())
    parts = sorted({name[: -len(f)] + p for f, p, _ in stacked if name.endswith(f)}) or [name]
    names = []
    for part in parts:
        variants = [part]
        for old, new in getattr(model, "CHECKPOINT_RENAMES", ()):
            variants += [v.replace(new, old) for v in variants if new in v]
        names.append(variants)
    return names


def keep_float_modules(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Give float weights back to the quantized layers (linear layers, MoE experts) that a
    checkpoint left unquantized (`quantization_config.modules_to_not_convert`, transformers'
    matching rule). Call right after construction, in the model's dtype and device. Returns
    the modules changed; ValueError where a pattern covers only some parts of a fused layer."""
    changed = []
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase | FusedMoE) or module.quant_method is None:
            continue
        parts = _checkpoint_names(model, name)
        hit = [any(matches_module_pattern(v, patterns) for v in variants) for variants in parts]
        if not any(hit):
            continue
        if not all(hit):
            covered = [v[0] for v, h in zip(parts, hit, strict=True) if h]
            missed = [v[0] for v, h in zip(parts, hit, strict=True) if not h]
            raise ValueError(
                f"quantization_config.modules_to_not_convert covers {', '.join(covered)} but "
                f"not {', '.join(missed)}, fused with it into {name}"
            )
        module.make_float_weights()
        changed.append(name)
    return changed


def model_quantization(model: nn.Module) -> str | None:
    """The quantization a model's linear layers (or MoE experts) run (e.g. "gptq w4 g128",
    "int8"), None: float."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, LinearBase | FusedMoE) and method is not None:
            return str(getattr(method, "description", method.method))
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedWeight):
            return weight.method
    return None
