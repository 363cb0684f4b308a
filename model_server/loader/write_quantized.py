"""Write a GPTQ- or AWQ-format HF folder from any model the loader reads (`wick quantize`):
round-to-nearest, no calibration (layers/quantization/wna16_pack.py), so it is a way to get a
kept-quantized checkpoint without a model hub (benchmarks, tests), not a replacement for the
GPTQ/AWQ tools' accuracy."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from model_server.layers.quantization.wna16_pack import awq_tensors, gptq_tensors
from model_server.loader.source import ModelSource

# The decoder layers' projections: what GPTQ and AWQ quantize (never embeddings, norms, head).
_QUANTIZED = re.compile(
    r"\.layers\.\d+\.(self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    r"\.weight$"
)


def quantization_config(method: str, bits: int, group_size: int, sym: bool) -> dict[str, Any]:
    """config.json's `quantization_config` as the tools write it."""
    if method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "desc_act": False,
            "sym": sym,
            "checkpoint_format": "gptq",
        }
    if method == "awq":
        return {
            "quant_method": "awq",
            "bits": bits,
            "group_size": group_size,
            "version": "gemm",
            "zero_point": True,
        }
    raise ValueError(f"unknown method {method!r} (gptq, awq)")


def write_quantized_folder(
    source: ModelSource,
    out: str | Path,
    method: str = "gptq",
    bits: int = 4,
    group_size: int = 128,
    sym: bool = True,
    dtype: torch.dtype = torch.float16,
) -> Path:
    """Quantize `source`'s decoder projections into `out` (config.json, model.safetensors,
    tokenizer); the other tensors are stored in `dtype`. Returns the folder."""
    from safetensors.torch import save_file

    qc = quantization_config(method, bits, group_size, sym)
    if method == "awq" and bits != 4:
        raise ValueError("awq checkpoints are 4-bit")
    if source.weights is None:
        raise ValueError("a dummy model has no weights to quantize")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in source.weights():
        if _QUANTIZED.search(name):
            prefix = name.removesuffix(".weight")
            if method == "gptq":
                packed = gptq_tensors(tensor, bits, group_size, sym)
            else:
                packed = awq_tensors(tensor, group_size)
            for suffix, value in packed.items():
                tensors[f"{prefix}.{suffix}"] = value.contiguous()
        else:
            tensors[name] = tensor.to(dtype).contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = source.hf_config.to_dict()
    config["quantization_config"] = qc
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config.pop("dtype", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    if source.tokenizer is not None:
        source.tokenizer.save_pretrained(str(folder))
    return folder
