"""Reading a PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`) into the
slices of Wick's fused layers, with clear errors for what is not served.

Served: plain LoRA (`peft_type` LORA) on q/k/v/o and gate/up/down, any rank up to
--max-lora-rank, `lora_alpha / r` scaling or rsLoRA's `lora_alpha / sqrt(r)`. Refused with a
message: DoRA, LoRA biases, `modules_to_save`, embedding or LM-head targets, per-module rank or
alpha patterns, `fan_in_fan_out`, and target modules the model lacks.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model_server.lora.layers import SUPPORTED_TARGETS, LoRATarget
from model_server.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# `base_model.model.<module>.lora_A.weight` (an adapter name before `.weight` in some saves).
_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)


@dataclass(slots=True)
class LoRAAdapter:
    """An adapter in host memory, laid out for Wick's layers: `weights[module_name][i]` is slice
    i's (A [r, in], B [size, r] with the scale folded in), float32 on the CPU."""

    request: LoRARequest
    rank: int
    scaling: float
    weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def num_bytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for slices in self.weights.values()
            for a, b in slices.values()
        )


def _refuse(request: LoRARequest, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {what}")


def read_adapter_config(request: LoRARequest) -> dict[str, Any]:
    folder = Path(request.lora_path)
    if not folder.is_dir():
        raise _refuse(request, "no such folder")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise _refuse(request, f"no {CONFIG_FILE} in the folder (not a PEFT adapter)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise _refuse(request, f"{CONFIG_FILE} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise _refuse(request, f"{CONFIG_FILE} is not a JSON object")
    return config


def check_adapter_config(request: LoRARequest, config: dict[str, Any], max_rank: int) -> None:
    """ValueError for a config asking for anything not served (module docstring)."""
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(request, f"peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise _refuse(request, "DoRA (use_dora) is not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise _refuse(request, f"LoRA biases (bias {config.get('bias')!r}) are not supported")
    if config.get("modules_to_save"):
        raise _refuse(request, f"modules_to_save {config['modules_to_save']} is not supported")
    if config.get("fan_in_fan_out"):
        raise _refuse(request, "fan_in_fan_out (Conv1D layers) is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise _refuse(request, f"per-module {key} is not supported")
    for key in ("layers_to_transform", "layers_pattern"):
        if config.get(key):
            raise _refuse(request, f"{key} is not supported")
    if config.get("trainable_token_indices"):
        raise _refuse(request, "trainable_token_indices (embedding tokens) is not supported")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise _refuse(request, f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _refuse(
            request, f"rank {rank} is above --max-lora-rank {max_rank}; raise --max-lora-rank"
        )
    targets = config.get("target_modules")
    if isinstance(targets, list):
        for name in targets:
            leaf = str(name).rsplit(".", 1)[-1]
            if leaf not in SUPPORTED_TARGETS:
                raise _refuse(
                    request,
                    f"target module {name!r} is not one the model's LoRA layers have "
                    f"(supported: {', '.join(SUPPORTED_TARGETS)})",
                )


def scaling_of(config: dict[str, Any]) -> float:
    """`lora_alpha / r`, or rsLoRA's `lora_alpha / sqrt(r)`."""
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def load_peft_adapter(
    request: LoRARequest, targets: list[LoRATarget], max_rank: int
) -> LoRAAdapter:
    """Read and check `request`'s folder against the model's `targets`."""
    config = read_adapter_config(request)
    check_adapter_config(request, config, max_rank)
    path = Path(request.lora_path) / WEIGHTS_FILE
    if not path.is_file():
        bin_file = path.with_name("adapter_model.bin")
        hint = " (adapter_model.bin is not read: save it as safetensors)" * bin_file.exists()
        raise _refuse(request, f"no {WEIGHTS_FILE} in the folder{hint}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path), device="cpu")
    except (SafetensorError, OSError) as exc:
        raise _refuse(request, f"{WEIGHTS_FILE} is not readable: {exc}") from None
    rank = int(config["r"])
    scaling = scaling_of(config)
    where = {peft: (target, i) for target in targets for peft, i in target.peft_names().items()}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY_RE.match(key)
        if m is None:
            raise _refuse(request, f"tensor {key!r} is not a LoRA A/B matrix (not supported)")
        pairs.setdefault(m["module"], {})[m["ab"]] = tensor
    if not pairs:
        raise _refuse(request, f"{WEIGHTS_FILE} holds no LoRA weights")
    weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, ab in sorted(pairs.items()):
        leaf = module.rsplit(".", 1)[-1]
        if leaf in ("embed_tokens", "lm_head") or module not in where:
            raise _refuse(
                request,
                f"target module {module!r} is not a LoRA layer of this model (supported: "
                f"{', '.join(SUPPORTED_TARGETS)} of its decoder layers)",
            )
        if set(ab) != {"A", "B"}:
            raise _refuse(request, f"{module} has lora_{'A' if 'B' in ab else 'B'} only")
        target, i = where[module]
        _, _, size = target.slices[i]
        a, b = ab["A"].float(), ab["B"].float()
        if a.shape != (rank, target.in_features) or b.shape != (size, rank):
            raise _refuse(
                request,
                f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the "
                f"model's layer (expected ({rank}, {target.in_features}) and ({size}, {rank}))",
            )
        weights.setdefault(target.module_name, {})[i] = (a.contiguous(), (b * scaling).contiguous())
    return LoRAAdapter(request, rank, scaling, weights)
