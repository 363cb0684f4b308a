"""A `.gguf` file -> ModelSource: config and tokenizer from the metadata, tensors dequantized,
renamed to HF names and, for llama, un-permuted."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

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
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^(\w+)\.(weight|bias)$")
# Consumed by the config (llama3 rope scaling), not model weights.
_NOT_WEIGHTS = frozenset({"rope_freqs.weight"})


@dataclass(slots=True, frozen=True)
class _Planned:
    hf_name: str
    info: GGUFTensorInfo
    # llama.cpp's rope permutation was applied with this many heads (q: heads, k: kv heads)
    permuted_heads: int | None


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None when unknown."""
    if m := _LAYER_RE.match(gguf_name):
        layer, part, kind = m.groups()
        mapped = _PER_LAYER.get(part)
        return f"model.layers.{layer}.{mapped}.{kind}" if mapped else None
    if m := _TOP_RE.match(gguf_name):
        part, kind = m.groups()
        mapped = _TOP_LEVEL.get(part)
        return f"{mapped}.{kind}" if mapped else None
    return None


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
            try:
                tensor = dequantize(gf.tensor_data(item.info), item.info.ggml_type, item.info.shape)
            except NotImplementedError as exc:  # a ggml type gguf-py cannot unpack
                raise ModelLoadError(
                    f"{path}: tensor {item.info.name} is {item.info.type_name}, which cannot be "
                    f"dequantized: {exc}"
                ) from exc
            if item.permuted_heads is not None:
                tensor = unpermute_rope(tensor, item.permuted_heads)
            yield item.hf_name, tensor

    specs = [TensorSpec(p.hf_name, stored_dtype(p.info.ggml_type), p.info.shape) for p in plan]
    weights = cached_weights(path, specs, produce)
    return ModelSource(config, tokenizer, path, weights, len(plan), format="gguf")


def _plan(gf: GGUFFile, config: transformers.PretrainedConfig) -> list[_Planned]:
    # Only llama.cpp's llama converter permutes q/k; qwen2/qwen3 are stored in HF order.
    permuted = gf.architecture == "llama"
    plan = []
    for info in gf.tensors:
        if info.name in _NOT_WEIGHTS:
            continue
        name = hf_name(info.name)
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
