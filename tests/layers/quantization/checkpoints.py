"""Tiny random GPTQ / AWQ checkpoints for the tests, and a reference decoder of their tensors
written from the formats' descriptions (one code at a time, independent of the product's
unpacking in layers/quantization/wna16.py).

`save_pair` writes two HF folders from one random Llama: the quantized checkpoint (config.json
with quantization_config, safetensors with qweight/qzeros/scales[/g_idx]) and a float folder
holding the same model with each quantized matrix replaced by its reference dequantization, so
the two must compute the same function up to float rounding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from model_server.layers.quantization.wna16_pack import awq_tensors, gptq_tensors
from model_server.loader.write_quantized import quantization_config

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VOCAB = 160


@dataclass(frozen=True)
class Format:
    method: str  # gptq | awq
    bits: int = 4
    group_size: int = 32
    sym: bool = True
    desc_act: bool = False
    v2: bool = False  # gptq checkpoint_format gptq_v2 (zeros stored as they are)

    @property
    def name(self) -> str:
        parts = [self.method, f"w{self.bits}", f"g{self.group_size}"]
        parts += [] if self.sym else ["asym"]
        parts += ["actorder"] if self.desc_act else []
        parts += ["v2"] if self.v2 else []
        return "-".join(parts)

    def config(self) -> dict:
        qc = quantization_config(self.method, self.bits, self.group_size, self.sym)
        if self.method == "gptq":
            qc["desc_act"] = self.desc_act
            qc["checkpoint_format"] = "gptq_v2" if self.v2 else "gptq"
        return qc


def _u32(v: int) -> int:
    return v & 0xFFFFFFFF


def reference_dequantize(tensors: dict[str, torch.Tensor], fmt: Format, k: int) -> torch.Tensor:
    """A checkpoint layer's tensors -> W [N, K] float32, code by code from the format spec."""
    bits, mask = fmt.bits, (1 << fmt.bits) - 1
    pack = 32 // bits
    qweight = tensors["qweight"].tolist()
    qzeros = tensors["qzeros"].tolist()
    scales = tensors["scales"].float()
    n = scales.shape[1]
    gs = k if fmt.group_size == -1 else fmt.group_size
    q = torch.empty(k, n)
    z = torch.empty(scales.shape[0], n)
    if fmt.method == "gptq":
        for i in range(k):
            for c in range(n):
                q[i, c] = (_u32(qweight[i // pack][c]) >> (bits * (i % pack))) & mask
        for g in range(z.shape[0]):
            for c in range(n):
                stored = (_u32(qzeros[g][c // pack]) >> (bits * (c % pack))) & mask
                z[g, c] = stored if fmt.v2 else stored + 1
        groups = tensors["g_idx"].long()
    else:
        order = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble j holds column 8 i + order[j]
        for i in range(k):
            for word in range(n // 8):
                for j in range(8):
                    q[i, 8 * word + order[j]] = (_u32(qweight[i][word]) >> (4 * j)) & 15
        for g in range(z.shape[0]):
            for word in range(n // 8):
                for j in range(8):
                    z[g, 8 * word + order[j]] = (_u32(qzeros[g][word]) >> (4 * j)) & 15
        groups = torch.arange(k) // gs
    w_t = scales[groups] * (q - z[groups])  # [K, N]
    return w_t.t().contiguous()


def quantize_layer(w: torch.Tensor, fmt: Format, seed: int) -> dict[str, torch.Tensor]:
    k = w.shape[1]
    if fmt.method == "awq":
        return awq_tensors(w, fmt.group_size)
    g_idx = None
    if fmt.desc_act:
        gs = k if fmt.group_size == -1 else fmt.group_size
        order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[order] = torch.arange(k) // gs  # groups scattered over K, as act-order leaves them
    return gptq_tensors(w, fmt.bits, fmt.group_size, fmt.sym, g_idx, v2=fmt.v2)


def tiny_config(**overrides: object) -> transformers.LlamaConfig:
    values: dict[str, object] = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    values.update(overrides)
    return transformers.LlamaConfig(**values)


def save_pair(root: Path, fmt: Format, seed: int = 0, **config: object) -> tuple[Path, Path]:
    """(quantized folder, dequantized float folder) of one random tiny Llama."""
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(tiny_config(**config))
    state = {k: v.detach().float().contiguous() for k, v in hf.state_dict().items()}
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in sorted(state.items()):
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            prefix = name.removesuffix(".weight")
            # Act-order: projections of one input (q/k/v, gate/up) share an order, as GPTQ's
            # (sorted by that input's Hessian) does.
            layer, proj = int(name.split(".")[2]), name.split(".")[-2]
            part = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(proj, proj)
            tensors = quantize_layer(tensor, fmt, seed=10 * layer + PROJECTIONS.index(part))
            for suffix, value in tensors.items():
                quantized[f"{prefix}.{suffix}"] = value.contiguous()
            dequantized[name] = reference_dequantize(tensors, fmt, tensor.shape[1])
        else:
            quantized[name] = tensor
            dequantized[name] = tensor
    qfolder, ffolder = root / fmt.name, root / f"{fmt.name}-dequantized"
    for folder, tensors in ((qfolder, quantized), (ffolder, dequantized)):
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        cfg = hf.config.to_dict()
        cfg["torch_dtype"] = "float32"
        cfg["architectures"] = ["LlamaForCausalLM"]
        if folder == qfolder:
            cfg["quantization_config"] = fmt.config()
        (folder / "config.json").write_text(json.dumps(cfg, default=str))
    return qfolder, ffolder


def edit_checkpoint(folder: Path, edit) -> None:
    """Rewrite a folder's tensors (and keep its config): `edit(dict)` changes them in place."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def edit_config(folder: Path, **quant: object) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"].update(quant)
    (folder / "config.json").write_text(json.dumps(cfg))
