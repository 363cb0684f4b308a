"""A `.gguf` file -> ModelSource: config and tokenizer from the metadata, tensors dequantized
(`weights`) or block-quantized matrices kept in their layout (`quantized_weights`), renamed to HF
names and, for llama, q/k rows un-permuted; DeepSeek's kv_b_proj, which llama.cpp's converter
splits into attn_k_b / attn_v_b, merged back."""

from __future__ import annotations

import math
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
_DEEPSEEK2_LAYER = {
    **_MOE_LAYER,
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_ARCH_PER_LAYER: dict[str, dict[str, str]] = {
    "phi2": {"attn_output": "self_attn.dense", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"},
    # Phi-3's fused projections keep their HF names; ffn_up holds gate and up stacked.
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": _GEMMA2_LAYER,
    "gemma3": _GEMMA2_LAYER,
    "qwen2moe": _MOE_LAYER,
    "qwen3moe": _MOE_LAYER,
    # GLM-4's sandwich norms; ffn_up holds gate and up stacked, as HF's gate_up_proj.
    "glm4": {
        "post_attention_norm": "post_self_attn_layernorm",
        "post_ffw_norm": "post_mlp_layernorm",
        "ffn_up": "mlp.gate_up_proj",
    },
    "deepseek2": _DEEPSEEK2_LAYER,
}
# Whole per-layer names (part.kind) whose HF name has no .weight/.bias suffix.
_ARCH_EXACT: dict[str, dict[str, str]] = {
    # HF's buffer; llama.cpp's converter renames it e_score_correction.bias -> exp_probs_b.bias
    "deepseek2": {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"},
}
# HF names read as float tensors even when matrices are kept quantized: the model reads them
# itself rather than through a linear layer (DeepSeek's kv_b_proj, absorbed into the queries,
# and its router's weight).
_FLOAT_ONLY: dict[str, tuple[str, ...]] = {
    "deepseek2": ("self_attn.kv_b_proj.weight", "mlp.gate.weight"),
}
# llama.cpp's MLA files split each layer's kv_b_proj [H * (nope + v), L] into attn_k_b
# [H, L, nope] (each head's k rows transposed) and attn_v_b [H, v, L]; merged back at load.
_KV_B_PARTS = ("attn_k_b", "attn_v_b")
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
    permuted_heads: int | None = None
    # produced as a float tensor under --gguf-weights quantized too
    float_only: bool = False
    # DeepSeek's split kv_b_proj: `info` is attn_k_b, this attn_v_b; `kv_b` the config's
    # (heads, qk_nope_head_dim, v_head_dim, kv_lora_rank)
    v_b: GGUFTensorInfo | None = None
    kv_b: tuple[int, int, int, int] | None = None

    @property
    def spec(self) -> TensorSpec:
        if self.kv_b is None:
            return TensorSpec(self.hf_name, stored_dtype(self.info.ggml_type), self.info.shape)
        assert self.v_b is not None
        dtype = torch.promote_types(
            stored_dtype(self.info.ggml_type), stored_dtype(self.v_b.ggml_type)
        )
        heads, nope, v, lora = self.kv_b
        return TensorSpec(self.hf_name, dtype, (heads * (nope + v), lora))


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None when unknown.
    `arch` (general.architecture) picks the family's names where they differ from Llama's."""
    if m := _LAYER_RE.match(gguf_name):
        layer, part, kind = m.groups()
        if exact := _ARCH_EXACT.get(arch, {}).get(f"{part}.{kind}"):
            return f"model.layers.{layer}.{exact}"
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
            if item.float_only or info.ggml_type not in KEPT_TYPES or len(info.shape) != 2:
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

    specs = [p.spec for p in plan]
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
    if item.v_b is not None:
        return _merged_kv_b(gf, item)
    tensor = _read(gf, item.info)
    if item.permuted_heads is not None:
        tensor = unpermute_rope(tensor, item.permuted_heads)
    return tensor


def _read(gf: GGUFFile, info: GGUFTensorInfo) -> torch.Tensor:
    try:
        return dequantize(gf.tensor_data(info), info.ggml_type, info.shape)
    except NotImplementedError as exc:  # a ggml type gguf-py cannot unpack
        raise ModelLoadError(
            f"{gf.path}: tensor {info.name} is {info.type_name}, which cannot be dequantized: {exc}"
        ) from exc


def _merged_kv_b(gf: GGUFFile, item: _Planned) -> torch.Tensor:
    """attn_k_b [H, L, nope] and attn_v_b [H, v, L] -> kv_b_proj [H * (nope + v), L], each
    head's nope rows then its v rows (HF's layout). Writers that flatten the heads into the
    first dim are read the same way (_plan checked the element counts)."""
    assert item.v_b is not None and item.kv_b is not None
    heads, nope, v, lora = item.kv_b
    k_b = _read(gf, item.info).reshape(heads, lora, nope).transpose(1, 2)
    v_b = _read(gf, item.v_b).reshape(heads, v, lora)
    merged = torch.cat((k_b, v_b), dim=1).reshape(heads * (nope + v), lora)
    return merged.to(item.spec.dtype).contiguous()


def _plan(gf: GGUFFile, config: transformers.PretrainedConfig) -> list[_Planned]:
    arch = gf.architecture
    # Only llama.cpp's llama converter permutes q/k; the others are stored in HF order.
    permuted = arch == "llama"
    names = {info.name for info in gf.tensors}
    _check_required(gf, config, names)
    float_only = _FLOAT_ONLY.get(arch, ())
    plan = []
    kv_b_parts: dict[str, dict[str, GGUFTensorInfo]] = {}  # layer -> part -> info
    for info in gf.tensors:
        if info.name in _NOT_WEIGHTS:
            continue
        m = _LAYER_RE.match(info.name)
        if m and int(m.group(1)) >= config.num_hidden_layers:
            continue  # multi-token-prediction layers (nextn_predict_layers): not run
        if m and arch == "deepseek2" and m.group(2) in _KV_B_PARTS:
            if f"blk.{m.group(1)}.attn_kv_b.weight" not in names:  # else that one is read
                kv_b_parts.setdefault(m.group(1), {})[m.group(2)] = info
            continue
        name = hf_name(info.name, arch)
        if name is None:
            raise ModelLoadError(
                f"{gf.path}: tensor {info.name} has no HF equivalent for architecture "
                f"{arch!r}; not supported"
            )
        heads = None
        if permuted and ".self_attn.q_proj." in name:
            heads = config.num_attention_heads
        elif permuted and ".self_attn.k_proj." in name:
            heads = config.num_key_value_heads
        plan.append(_Planned(name, info, heads, float_only=name.endswith(float_only)))
    for layer, parts in kv_b_parts.items():
        plan.append(_merged_kv_b_plan(gf, config, layer, parts))
    return plan


def _merged_kv_b_plan(
    gf: GGUFFile,
    config: transformers.PretrainedConfig,
    layer: str,
    parts: dict[str, GGUFTensorInfo],
) -> _Planned:
    dims = (
        config.num_attention_heads,
        config.qk_nope_head_dim,
        config.v_head_dim,
        config.kv_lora_rank,
    )
    heads, nope, v, lora = dims
    k_b, v_b = parts["attn_k_b"], parts["attn_v_b"]  # both present: _check_required
    for info, last, numel in ((k_b, nope, heads * lora * nope), (v_b, lora, heads * v * lora)):
        if info.shape[-1] != last or math.prod(info.shape) != numel:
            raise ModelLoadError(
                f"{gf.path}: tensor {info.name} has shape {list(info.shape)}, expected "
                f"{heads} heads of [{lora}, {nope}] (attn_k_b) or [{v}, {lora}] (attn_v_b) "
                f"from the metadata (kv_lora_rank {lora}, qk_nope {nope}, v_head_dim {v})"
            )
    name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
    return _Planned(name, k_b, float_only=True, v_b=v_b, kv_b=dims)


def _check_required(gf: GGUFFile, config: transformers.PretrainedConfig, names: set[str]) -> None:
    """deepseek2 / glm4: a ModelLoadError naming the first tensor the config needs that the
    file lacks, before any weight is read (the model's load_weights would name HF's)."""
    arch = gf.architecture
    if arch not in _REQUIRED_PARTS:
        return
    required = ["token_embd.weight", "output_norm.weight"]
    for i in range(config.num_hidden_layers):
        required += [f"blk.{i}.{part}" for part in _REQUIRED_PARTS[arch](config, i, names)]
    for name in required:
        if name not in names:
            raise ModelLoadError(
                f"{gf.path}: GGUF file has no tensor {name}, which this {arch} model needs"
            )


def _glm4_parts(config: transformers.PretrainedConfig, i: int, names: set[str]) -> list[str]:
    parts = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm"]
    parts += ["ffn_norm", "ffn_up", "ffn_down", "post_ffw_norm"]
    return [f"{part}.weight" for part in parts]


def _deepseek2_parts(config: transformers.PretrainedConfig, i: int, names: set[str]) -> list[str]:
    parts = ["attn_norm", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_output", "ffn_norm"]
    if config.q_lora_rank is None:
        parts.append("attn_q")
    else:
        parts += ["attn_q_a", "attn_q_a_norm", "attn_q_b"]
    # kv_b_proj whole (older files) or split (today's converter: some attn_k_b in the file)
    split = f"blk.{i}.attn_kv_b.weight" not in names and any(
        name.endswith((".attn_k_b.weight", ".attn_v_b.weight")) for name in names
    )
    parts += list(_KV_B_PARTS) if split else ["attn_kv_b"]
    if i < (config.first_k_dense_replace or 0):
        parts += ["ffn_gate", "ffn_up", "ffn_down"]
    else:
        parts += ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
        if config.n_shared_experts:
            parts += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
    required = [f"{part}.weight" for part in parts]
    if config.model_type == "deepseek_v3" and i >= (config.first_k_dense_replace or 0):
        required.append("exp_probs_b.bias")
    return required


_REQUIRED_PARTS = {"glm4": _glm4_parts, "deepseek2": _deepseek2_parts}
