"""A `.gguf` file -> ModelSource: config and tokenizer from the metadata, tensors dequantized
(`weights`) or block-quantized matrices kept in their layout (`quantized_weights`), renamed to HF
names and, for llama, q/k rows un-permuted."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from model_server.kernels.gguf_blocks import row_bytes
from model_server.layers.quantization.gguf import KEPT_TYPES, GGUFTensor
from model_server.loader.dequant import dequantize, stored_dtype
from model_server.loader.gguf_config import gguf_hf_config
from model_server.loader.gguf_file import GGUFFile, GGUFTensorInfo, read_gguf
from model_server.loader.gguf_tokenizer import gguf_tokenizer
from model_server.loader.source import ModelLoadError, ModelSource
from model_server.loader.weight_cache import TensorSpec, cached_weights

if TYPE_CHECKING:
    import transformers

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Per architecture: where its HF names differ from the Llama ones above (llama.cpp's converter
# maps several HF names onto one GGUF name: gguf-py's TensorNameMap).
_ARCH_TOP_LEVEL: dict[str, dict[str, str]] = {
    "phi2": {"output_norm": "model.final_layernorm"},
}
_MOE_LAYER = {
    "ffn_gate_inp": "mlp.gate",
    # Stacked [num_experts, ...] per projection: MoECausalLM.load_weights splits them.
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_GEMMA2_LAYER = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_PER_LAYER: dict[str, dict[str, str]] = {
    "phi2": {"attn_output": "self_attn.dense", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"},
    # Phi-3's fused projections keep their HF names; ffn_up holds gate and up stacked.
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": _GEMMA2_LAYER,
    "gemma3": _GEMMA2_LAYER,
    "qwen2moe": _MOE_LAYER,
    "qwen3moe": _MOE_LAYER,
}
# llama.cpp's Gemma converters store every RMSNorm weight w as 1 + w (the scale it multiplies
# by); HF's Gemma norms hold w: subtracted back at load.
_NORM_SHIFTED = frozenset({"gemma", "gemma2", "gemma3"})
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^(\w+)\.(weight|bias)$")
# Consumed by the config (llama3 rope scaling), not model weights.
_NOT_WEIGHTS = frozenset(
    {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
)


@dataclass(slots=True, frozen=True)
class _Planned:
    hf_name: str
    info: GGUFTensorInfo
    # llama.cpp's rope permutation was applied with this many heads (q: heads, k: kv heads)
    permuted_heads: int | None


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None when unknown.
    `arch` (general.architecture) picks the family's names where they differ from Llama's."""
    if m := _LAYER_RE.match(gguf_name):
        layer, part, kind = m.groups()
        mapped = _ARCH_PER_LAYER.get(arch, {}).get(part) or _PER_LAYER.get(part)
        return f"model.layers.{layer}.{mapped}.{kind}" if mapped else None
    if m := _TOP_RE.match(gguf_name):
        part, kind = m.groups()
        mapped = _ARCH_TOP_LEVEL.get(arch, {}).get(part) or _TOP_LEVEL.get(part)
        return f"{mapped}.{kind}" if mapped else None
    return None


def _unshift_norms(
    weights: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Gemma files: every `...norm.weight` back from llama.cpp's 1 + w to HF's w."""
    for name, tensor in weights:
        yield name, (tensor - 1 if name.endswith("norm.weight") else tensor)


def unpermute_rope(tensor: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute()` of a q/k projection (weight [n_heads*head_dim, in] or bias).

    llama.cpp reorders each head's output rows from HF's "rotate half" layout (first half, second
    half) to interleaved pairs: rows viewed as [n_heads, 2, head_dim/2] are swapped to
    [n_heads, head_dim/2, 2]. Reversing it views the rows as [n_heads, head_dim/2, 2] and swaps
    back.
    """
    rows = tensor.shape[0]
    half = rows // n_heads // 2
    return (
        tensor.reshape(n_heads, half, 2, *tensor.shape[1:])
        .transpose(1, 2)
        .reshape(tensor.shape)
        .contiguous()
    )


def load_gguf(path: str, *, dummy: bool = False) -> ModelSource:
    gf = read_gguf(path)
    config = gguf_hf_config(gf)
    tokenizer = gguf_tokenizer(gf)
    plan = _plan(gf, config)
    if dummy:
        return ModelSource(config, tokenizer, path, None, 0, format="dummy")

    def produce() -> Iterator[tuple[str, torch.Tensor]]:
        for item in plan:
            yield item.hf_name, _dequantized(gf, item)

    def produce_quantized() -> Iterator[tuple[str, torch.Tensor]]:
        for item in plan:
            info = item.info
            if info.ggml_type not in KEPT_TYPES or len(info.shape) != 2:
                yield item.hf_name, _dequantized(gf, item)  # floats, norms, other ggml types
                continue
            rows, cols = info.shape
            raw = torch.from_numpy(gf.tensor_data(info))
            data = raw.reshape(rows, row_bytes(info.ggml_type, cols))
            tensor = GGUFTensor(info.name, info.ggml_type, (rows, cols), data)
            if item.permuted_heads is not None:  # whole rows move: the blocks stay intact
                order = unpermute_rope(torch.arange(rows), item.permuted_heads)
                tensor = tensor.permute_rows(order)
            yield item.hf_name, tensor  # type: ignore[misc]

    specs = [TensorSpec(p.hf_name, stored_dtype(p.info.ggml_type), p.info.shape) for p in plan]
    weights = cached_weights(path, specs, produce)
    quantized = produce_quantized
    if gf.architecture in _NORM_SHIFTED:
        stored = weights
        weights = lambda: _unshift_norms(stored())  # noqa: E731
        quantized = lambda: _unshift_norms(produce_quantized())  # noqa: E731
    return ModelSource(
        config, tokenizer, path, weights, len(plan), format="gguf", quantized_weights=quantized
    )


def _dequantized(gf: GGUFFile, item: _Planned) -> torch.Tensor:
    info = item.info
    try:
        tensor = dequantize(gf.tensor_data(info), info.ggml_type, info.shape)
    except NotImplementedError as exc:  # a ggml type gguf-py cannot unpack
        raise ModelLoadError(
            f"{gf.path}: tensor {info.name} is {info.type_name}, which cannot be dequantized: {exc}"
        ) from exc
    if item.permuted_heads is not None:
        tensor = unpermute_rope(tensor, item.permuted_heads)
    return tensor


def _plan(gf: GGUFFile, config: transformers.PretrainedConfig) -> list[_Planned]:
    # Only llama.cpp's llama converter permutes q/k; qwen2/qwen3 are stored in HF order.
    permuted = gf.architecture == "llama"
    plan = []
    for info in gf.tensors:
        if info.name in _NOT_WEIGHTS:
            continue
        name = hf_name(info.name, gf.architecture)
        if name is None:
            raise ModelLoadError(
                f"{gf.path}: tensor {info.name} has no HF equivalent for architecture "
                f"{gf.architecture!r}; not supported"
            )
        heads = None
        if permuted and ".self_attn.q_proj." in name:
            heads = config.num_attention_heads
        elif permuted and ".self_attn.k_proj." in name:
            heads = config.num_key_value_heads
        plan.append(_Planned(name, info, heads))
    return plan
