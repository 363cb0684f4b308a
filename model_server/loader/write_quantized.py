"""Write a GPTQ- or AWQ-format HF folder from any model the loader reads (`wick quantize`):
round-to-nearest, no calibration (layers/quantization/wna16_pack.py), so it is a way to get a
kept-quantized checkpoint without a model hub (benchmarks, tests), not a replacement for the
GPTQ/AWQ tools' accuracy.

What is quantized is what the tools quantize: the decoder layers' attention and MLP
projections, and in mixture-of-experts models every routed expert's gate / up / down (one
matrix per expert, `mlp.experts.N.gate_proj`, Mixtral's `block_sparse_moe.experts.N.w1` /
`w3` / `w2`; stacked expert tensors are written per expert) and the shared experts. Never the
embeddings, norms, LM head, the routers (`mlp.gate`) or Qwen's `shared_expert_gate`, nor the
modules named in `modules_to_not_convert` (written into the config; matched as the loader
matches them, models/quantization.py).

Act-order (`desc_act`, GPTQ): without calibration there is no Hessian to order the input
features by, so each input gets a fixed pseudo-random order, shared by the projections that
read it (q/k/v; an expert's gate and up) as GPTQ's is. It exercises the permuted layout, it
brings no accuracy.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from model_server.layers.quantization.wna16_pack import awq_tensors, gptq_tensors
from model_server.loader.source import ModelSource
from model_server.models.quantization import matches_module_pattern

# The projections GPTQ and AWQ quantize: attention (DeepSeek's MLA ones too), MLP, shared
# experts and routed experts.
_QUANTIZED = re.compile(
    r"\.layers\.\d+\.(self_attn|mlp|block_sparse_moe)\."
    r"((experts\.\d+|shared_experts?)\.)?"
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3"
    r"|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)\.weight$"
)
# Every expert in one tensor: transformers 5's gate_up_proj [E, 2I, H] / down_proj [E, H, I],
# GGUF's gate_proj / up_proj [E, I, H] and down_proj [E, H, I].
_STACKED_EXPERTS = re.compile(
    r"^(.*\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?$"
)
# Projections that read the same input share an act-order: q/k/v, and gate/up (w1/w3).
_SAME_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj", "w3": "w1"}


def _per_expert(
    name: str, tensor: torch.Tensor, model_type: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked expert tensor -> one tensor per expert and projection, named as per-expert
    checkpoints name them (Mixtral's block_sparse_moe w1 / w3 / w2); anything else as it is."""
    match = _STACKED_EXPERTS.match(name)
    if match is None or tensor.dim() != 3:
        yield name, tensor
        return
    prefix, proj = match.group(1), match.group(2)
    mixtral = model_type == "mixtral"
    if mixtral:
        prefix = prefix.replace(".mlp.experts", ".block_sparse_moe.experts")
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if mixtral else {}
    if proj == "gate_up_proj":
        half = tensor.shape[1] // 2
        parts = [("gate_proj", tensor[:, :half]), ("up_proj", tensor[:, half:])]
    else:
        parts = [(proj, tensor)]
    for part, stacked in parts:
        for expert in range(stacked.shape[0]):
            yield f"{prefix}.{expert}.{names.get(part, part)}.weight", stacked[expert]


def _act_order(prefix: str, k: int, group_size: int) -> torch.Tensor:
    """g_idx [K] of a pseudo-random act-order, the same for the projections of one input."""
    module, proj = prefix.rsplit(".", 1)
    key = f"{module}.{_SAME_INPUT.get(proj, proj)}"
    gs = k if group_size == -1 else group_size
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    order = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // gs).to(torch.int32)
    return g_idx


def quantization_config(
    method: str,
    bits: int,
    group_size: int,
    sym: bool,
    desc_act: bool = False,
    modules_to_not_convert: Sequence[str] = (),
) -> dict[str, Any]:
    """config.json's `quantization_config` as the tools write it."""
    if method == "gptq":
        qc: dict[str, Any] = {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "desc_act": desc_act,
            "sym": sym,
            "checkpoint_format": "gptq",
        }
    elif method == "awq":
        if desc_act:
            raise ValueError("act-order (desc_act) is a gptq option")
        qc = {
            "quant_method": "awq",
            "bits": bits,
            "group_size": group_size,
            "version": "gemm",
            "zero_point": True,
        }
    else:
        raise ValueError(f"unknown method {method!r} (gptq, awq)")
    if modules_to_not_convert:
        qc["modules_to_not_convert"] = list(modules_to_not_convert)
    return qc


def write_quantized_folder(
    source: ModelSource,
    out: str | Path,
    method: str = "gptq",
    bits: int = 4,
    group_size: int = 128,
    sym: bool = True,
    dtype: torch.dtype = torch.float16,
    desc_act: bool = False,
    modules_to_not_convert: Sequence[str] = (),
) -> Path:
    """Quantize `source`'s decoder projections and experts (see the module doc) into `out`
    (config.json, model.safetensors, tokenizer); the other tensors are stored in `dtype`.
    Returns the folder."""
    from safetensors.torch import save_file

    qc = quantization_config(method, bits, group_size, sym, desc_act, modules_to_not_convert)
    if method == "awq" and bits != 4:
        raise ValueError("awq checkpoints are 4-bit")
    if source.weights is None:
        raise ValueError("a dummy model has no weights to quantize")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    model_type = str(getattr(source.hf_config, "model_type", ""))
    tensors: dict[str, torch.Tensor] = {}
    for stored_name, stored in source.weights():
        for name, tensor in _per_expert(stored_name, stored, model_type):
            prefix = name.removesuffix(".weight")
            if not _QUANTIZED.search(name) or matches_module_pattern(
                prefix, modules_to_not_convert
            ):
                tensors[name] = tensor.to(dtype).contiguous()
                continue
            if method == "gptq":
                g_idx = _act_order(prefix, tensor.shape[1], group_size) if desc_act else None
                packed = gptq_tensors(tensor, bits, group_size, sym, g_idx)
            else:
                packed = awq_tensors(tensor, group_size)
            for suffix, value in packed.items():
                tensors[f"{prefix}.{suffix}"] = value.contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = source.hf_config.to_dict()
    config["quantization_config"] = qc
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config.pop("dtype", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    if source.tokenizer is not None:
        source.tokenizer.save_pretrained(str(folder))
    return folder
