"""The pieces every decoder family builds on, written once: the attention block (fused q/k/v,
optional per-head q/k norm, rotary, paged attention, output projection), the gated MLP
(gate_up -> act-and-mul -> down), the pre-norm decoder layer with the residual add fused into
the norms (optionally with Gemma 2's / GLM-4's norms after attention and MLP), the model body
that runs them, and the LM head tied or not. models/llama.py, gemma.py, glm4.py, phi.py,
stablelm.py and moe_decoder.py configure these; module names follow HF's checkpoint names
(`self_attn.qkv_proj`, `mlp.gate_up_proj`, ...) so `load_weights` maps them with one table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from model_server.kernels.stack_layer import StackLayer
from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.activation import SiluAndMul, get_act_and_mul_fn
from model_server.layers.attention.backend import AttentionBackend, AttentionMetadata
from model_server.layers.attention.layer import Attention
from model_server.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from model_server.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from model_server.layers.norm import RMSNorm
from model_server.layers.rotary import RotaryEmbedding

# (our fused param name part, checkpoint name part, shard id)
STACKED_PARAMS_MAPPING: tuple[tuple[str, str, str | int], ...] = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)
# Checkpoint tensors that are derived state, not weights.
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def get_head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def get_num_kv_heads(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


class GatedMLP(nn.Module):
    """[T, hidden] -> gate_up_proj [T, 2 * inter] -> act(gate) * up [T, inter] -> down_proj
    [T, hidden] (SwiGLU, GeGLU: `hidden_act`). Under tensor parallelism the intermediate dim is
    split evenly and down_proj's all-reduce sums it."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool,
        kernels: KernelTable,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, kernels=kernels
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, kernels=kernels
        )
        self.act_fn = get_act_and_mul_fn(hidden_act, kernels)
        self.kernels = kernels
        # SwiGLU without bias: the table may fuse the SiLU into the gate/up matmul.
        self.fuse_silu = isinstance(self.act_fn, SiluAndMul) and not bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fuse_silu:
            fused = self.kernels.linear_silu_and_mul(x, self.gate_up_proj.weight, None)
            if fused is not None:
                return self.down_proj(fused)
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class QKVAttention(nn.Module):
    """Fused q/k/v projection, optional per-head q/k norm (`norm_cls` over head_dim, before
    rotary), rotary, paged attention (optional window and soft cap), output projection named
    `out_name` (o_proj; Phi's `dense`).

    Under tensor parallelism this rank's heads only (`qkv_proj.shard`): whole KV-head groups,
    so attention is local and the output projection's all-reduce sums the heads."""

    def __init__(
        self,
        config: Any,
        rotary_emb: nn.Module,
        attn_backend: type[AttentionBackend],
        kernels: KernelTable,
        *,
        qkv_bias: bool,
        o_bias: bool,
        scale: float | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        qk_norm: bool = False,
        norm_cls: type[RMSNorm] = RMSNorm,
        out_name: str = "o_proj",
    ) -> None:
        super().__init__()
        self.head_dim = get_head_dim(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            get_num_kv_heads(config),
            bias=qkv_bias,
            kernels=kernels,
        )
        shard = self.qkv_proj.shard
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.out_name = out_name
        out_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=o_bias,
            input_partition=(shard.q_start * self.head_dim, self.q_size),
            kernels=kernels,
        )
        setattr(self, out_name, out_proj)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = norm_cls(self.head_dim, eps=config.rms_norm_eps, kernels=kernels)
            self.k_norm = norm_cls(self.head_dim, eps=config.rms_norm_eps, kernels=kernels)
        # The same instance in every layer (of a kind): one cos/sin cache for the model.
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5 if scale is None else scale,
            self.num_kv_heads,
            attn_backend,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [T, (H + 2 Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, kv_cache, attn_metadata)  # [T, H * D]
        return getattr(self, self.out_name)(out)


# Checkpoint names of a decoder layer's norms: before attention, on the attention output, before
# the MLP, on the MLP output (Gemma 2/3's; GLM-4 names them its own way).
SANDWICH_NORM_NAMES = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer, x -> x + attn(norm(x)) -> x + mlp(norm(x)), with optional norms
    on the attention and MLP outputs (`post_norms`: Gemma 2/3, GLM-4). Without them the norm
    before the MLP is HF's `post_attention_layernorm` (Llama, Gemma 1, the MoE families).

    forward returns (this layer's MLP output, the residual stream before it): the next layer's
    input norm (or the model's final norm) adds the two (fused add + norm)."""

    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        make_norm: Callable[[], nn.Module],
        post_norms: bool = False,
        names: tuple[str, str, str, str] = SANDWICH_NORM_NAMES,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.post_norms = post_norms
        self._norm_names = names if post_norms else (names[0], "", "post_attention_layernorm", "")
        for name in self._norm_names:
            if name:
                setattr(self, name, make_norm())

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        input_norm, post_attn, pre_mlp, post_mlp = (
            getattr(self, n) if n else None for n in self._norm_names
        )
        if residual is None:
            residual = hidden_states
            hidden_states = input_norm(hidden_states)
        else:
            hidden_states, residual = input_norm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        if post_attn is not None:
            hidden_states = post_attn(hidden_states)
        hidden_states, residual = pre_mlp(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        if post_mlp is not None:
            hidden_states = post_mlp(hidden_states)
        return hidden_states, residual


def stack_layer(layer: nn.Module) -> StackLayer | str:
    """`layer` described for `KernelTable.decoder_stack` (kernels/cpu/decoder_stack.py), or why
    it has not that exact shape: a plain pre-norm DecoderLayer, RMSNorms, QKVAttention without
    q/k norm, neox rotary over whole heads, full attention on the native CPU backend, a SwiGLU
    GatedMLP without gate/up bias, one rank."""
    if type(layer).forward is not DecoderLayer.forward or layer.post_norms:
        return "not a plain pre-norm decoder layer"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(norm) is not RMSNorm for norm in norms):
        return "norms other than plain RMSNorm"
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn).forward is not QKVAttention.forward or attn.qk_norm:
        return "attention with a q/k norm or of another kind"
    if type(attn.rotary_emb) is not RotaryEmbedding:
        return "a partial or other rotary embedding"
    impl = attn.attn.impl
    if impl.name != "cpu" or getattr(impl, "kernels", None) is None:
        return f"the {impl.name} attention backend (not the native CPU one)"
    if attn.attn.sliding_window is not None or impl.logits_soft_cap is not None:
        return "a sliding window or a logit soft cap"
    if attn.attn.kv_group != 0:
        return "a second KV cache group"
    if type(mlp) is not GatedMLP or not isinstance(mlp.act_fn, SiluAndMul):
        return "an MLP other than SwiGLU"
    if mlp.gate_up_proj.bias is not None:
        return "a gate/up bias"
    if mlp.down_proj.tp_size != 1 or attn.qkv_proj.tp_size != 1:
        return "tensor parallelism (all-reduces run between the modules)"
    return StackLayer(
        input_norm=layer.input_layernorm.weight,
        post_attention_norm=layer.post_attention_layernorm.weight,
        eps=layer.input_layernorm.variance_epsilon,
        qkv=attn.qkv_proj,
        o=getattr(attn, attn.out_name),
        gate_up=mlp.gate_up_proj,
        down=mlp.down_proj,
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        scale=attn.attn.scale,
        cos_sin_cache=attn.rotary_emb.cos_sin_cache,
    )


class DecoderModel(nn.Module):
    """embed_tokens -> `layers` (DecoderLayer's residual convention) -> the final `norm`, which
    adds the last residual. Subclasses set `layers` and `norm`, and may scale the embedding
    (`embed`). `kernels.decoder_stack` may run all the layers in one call (CPUs: kernels/cpu/
    decoder_stack.py), with the modules' results."""

    def __init__(self, config: Any, kernels: KernelTable = TORCH_KERNELS) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.kernels = kernels
        # `stack_layers()`'s answer, built on the first forward (the layers are final by then).
        self._stack: tuple[StackLayer, ...] | str | None = None

    def stack_layers(self) -> tuple[StackLayer, ...] | str:
        """The layers described for `kernels.decoder_stack`, or why one of them cannot be."""
        if self._stack is None:
            described = [stack_layer(layer) for layer in self.layers]
            reasons = [(i, d) for i, d in enumerate(described) if isinstance(d, str)]
            if reasons:
                self._stack = f"layer {reasons[0][0]}: {reasons[0][1]}"
            else:
                self._stack = tuple(d for d in described if not isinstance(d, str))
        return self._stack

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # [T, hidden]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden_states = self.embed(input_ids)
        stacked = self.kernels.decoder_stack(
            self.stack_layers(), positions, hidden_states, kv_caches, attn_metadata
        )
        if stacked is not None:
            hidden_states, residual = stacked
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                hidden_states, residual = layer(
                    positions, hidden_states, residual, kv_cache, attn_metadata
                )
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


def make_lm_head(
    config: Any, embed_tokens: VocabParallelEmbedding, kernels: KernelTable, tie_default: bool
) -> tuple[bool, ParallelLMHead]:
    """(tie_word_embeddings, the LM head): tied to `embed_tokens` when the config says so
    (`tie_default` when it does not say)."""
    tie = bool(getattr(config, "tie_word_embeddings", tie_default))
    lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, kernels=kernels)
    if tie:
        lm_head.tie_weights(embed_tokens)
    return tie, lm_head


class CheckpointLoading:
    """`load_weights` for a model (an nn.Module) whose parameter names are HF's checkpoint names
    except the fused ones in `STACKED_PARAMS` (checkpoint q/k/v and gate/up land in qkv_proj /
    gate_up_proj shards). Families adjust it through the class attributes and hooks below."""

    STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = STACKED_PARAMS_MAPPING
    # Substring renames applied to checkpoint names first.
    CHECKPOINT_RENAMES: tuple[tuple[str, str], ...] = ()
    tie_word_embeddings: bool

    def skip_weight(self, name: str) -> bool:
        return False

    def transform_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def load_special_weight(
        self,
        params: dict[str, nn.Parameter],
        name: str,
        tensor: torch.Tensor,
        loaded: set[str],
        loaded_shards: dict[str, set[Any]],
        checkpoint_name: str | None = None,
    ) -> bool:
        """Load a tensor the stacking table does not describe (the MoE experts); True when it
        was one. Whole params go into `loaded`, shards of one into `loaded_shards[target]`.
        `name` is after `CHECKPOINT_RENAMES`; `checkpoint_name` as the checkpoint has it."""
        return False

    def expected_shards(self, target: str, modules: dict[str, nn.Module]) -> set[Any]:
        """The shards that make fused param `target` complete."""
        return {s for fused, _, s in self.STACKED_PARAMS if f"{fused}." in target}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors, fusing q/k/v and gate/up, casting to each param's dtype.

        Returns the names of our parameters that were loaded. Raises ValueError for a tensor
        that matches no parameter, a shape mismatch, or parameters left unloaded.
        """
        assert isinstance(self, nn.Module)
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        loaded_shards: dict[str, set[Any]] = {}
        for name, tensor in weights:
            if name.endswith(SKIPPED_SUFFIXES) or self.skip_weight(name):
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # tied to model.embed_tokens.weight
            original = name
            for old, new in self.CHECKPOINT_RENAMES:
                name = name.replace(old, new)
            tensor = self.transform_weight(name, tensor)
            if self.load_special_weight(params, name, tensor, loaded, loaded_shards, original):
                continue
            for fused, part, shard_id in self.STACKED_PARAMS:
                if part not in name:
                    continue
                target = name.replace(part, fused)
                param = param_for(params, target, name)
                param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
                loaded_shards.setdefault(target, set()).add(shard_id)
                break
            else:
                param = param_for(params, name, name)
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
        modules = dict(self.named_modules())
        for target, shards in loaded_shards.items():
            if shards == self.expected_shards(target, modules):
                loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            partial = {t: sorted(map(str, s)) for t, s in loaded_shards.items() if t in missing}
            absent = {
                t: sorted(map(str, self.expected_shards(t, modules) - s))
                for t, s in loaded_shards.items()
                if t in missing
            }
            detail = (
                f" (fused params with only shards {partial}; missing {absent})" if partial else ""
            )
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing)}{detail}")
        return loaded


def param_for(params: dict[str, nn.Parameter], target: str, name: str) -> nn.Parameter:
    """params[target], or the error naming checkpoint tensor `name`."""
    param = params.get(target)
    if param is None:
        raise ValueError(f"checkpoint tensor {name} matches no parameter")
    return param
