"""The pieces every decoder family builds on, written once: the attention block (fused q/k/v,
optional per-head q/k norm, rotary, paged attention, output projection), the gated MLP
(gate_up -> act-and-mul -> down) and the plain GELU one (fc1 -> gelu -> fc2), the pre-norm
decoder layer with the residual add fused into the norms (optionally with Gemma 2's / GLM-4's
norms after attention and MLP), the model body that runs them, their description for a native
decoder step (`stack_layer`, `describe_layer`), and the LM head tied or not. models/llama.py,
gemma.py, glm4.py, phi.py, stablelm.py, starcoder2.py and moe_decoder.py configure these;
module names follow HF's checkpoint names (`self_attn.qkv_proj`, `mlp.gate_up_proj`, ...) so
`load_weights` maps them with one table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from model_server.kernels.stack_layer import StackLayer
from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.activation import GeluAndMul, SiluAndMul, get_act_and_mul_fn
from model_server.layers.attention.backend import AttentionBackend, AttentionMetadata
from model_server.layers.attention.layer import Attention
from model_server.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from model_server.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from model_server.layers.norm import LayerNorm, RMSNorm
from model_server.layers.rotary import PartialRotaryEmbedding, RotaryEmbedding

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
        # SwiGLU without bias: a planned gate/up weight may fuse the SiLU into its matmul.
        self.fuse_silu = isinstance(self.act_fn, SiluAndMul) and not bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fuse_silu:
            # A planned gate/up weight may fuse the SiLU into its matmul (CPU panels).
            fused_fn = getattr(self.gate_up_proj.weight, "silu_and_mul", None)
            fused = None if fused_fn is None else fused_fn(x)
            if fused is not None:
                return self.down_proj(fused)
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


# HF `hidden_act` names of the plain MLPs' GELU -> its approximation.
PLAIN_GELU = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh"}


class PlainMLP(nn.Module):
    """[T, hidden] -> `in_name` [T, inter] (bias) -> GELU -> `out_name` [T, hidden] (bias): the
    non-gated MLP (Phi-2's fc1/fc2, StarCoder2's c_fc/c_proj), the GELU on the table's `gelu`.
    Under tensor parallelism the input projection splits by columns, the output one by rows."""

    def __init__(
        self,
        config: Any,
        kernels: KernelTable,
        *,
        bias: bool,
        names: tuple[str, str] = ("fc1", "fc2"),
        family: str = "",
    ) -> None:
        super().__init__()
        act = config.hidden_act
        if act not in PLAIN_GELU:
            raise ValueError(
                f"unsupported hidden_act {act!r} for {family or type(self).__name__}; "
                f"supported: {', '.join(PLAIN_GELU)}"
            )
        self.approximate = PLAIN_GELU[act]
        self.kernels = kernels
        self.in_name, self.out_name = names
        fc_in = ColumnParallelLinear(
            config.hidden_size, config.intermediate_size, bias=bias, kernels=kernels
        )
        fc_out = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=bias, kernels=kernels
        )
        setattr(self, self.in_name, fc_in)
        setattr(self, self.out_name, fc_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc_in, fc_out = getattr(self, self.in_name), getattr(self, self.out_name)
        return fc_out(self.kernels.gelu(fc_in(x), self.approximate))


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


def _norm_kind(norm: nn.Module | None) -> str | None:
    """ "rms" or "layer" for the norms a native step runs as they are, else None."""
    if norm is None or type(norm).forward is RMSNorm.forward:
        return "rms"
    if type(norm).forward is LayerNorm.forward:
        return "layer"
    return None


def _eps(norm: nn.Module) -> float:
    return norm.eps if isinstance(norm, LayerNorm) else norm.variance_epsilon


def _activation(mlp: nn.Module) -> str | None:
    if isinstance(mlp, PlainMLP):
        return "gelu_tanh" if mlp.approximate == "tanh" else "gelu"
    if isinstance(mlp.act_fn, SiluAndMul):
        return "silu"
    if isinstance(mlp.act_fn, GeluAndMul):
        return "gelu_tanh" if mlp.act_fn.approximate == "tanh" else "gelu"
    return None


def stack_layer(layer: nn.Module) -> StackLayer | str:
    """`layer` described for a platform's native decoder step (`Platform.native_decoder_step`;
    the CPU's: kernels/cpu/decoder_stack.py), or in words what it is instead: a DecoderLayer
    (sandwich norms allowed) of RMSNorms, or a layer that describes itself (`stack_layer()`:
    models/phi.py's LayerNorm layers, through `describe_layer`)."""
    if type(layer).forward is not DecoderLayer.forward:
        own = getattr(layer, "stack_layer", None)
        if own is not None:
            return own()
        return f"{type(layer).__name__} (not the pre-norm decoder layer)"
    input_name, attn_out_name, pre_mlp_name, mlp_out_name = layer._norm_names
    norms = {name: getattr(layer, name) if name else None for name in layer._norm_names}
    if not all(type(n).forward is RMSNorm.forward for n in norms.values() if n is not None):
        return "a LayerNorm or another norm between RMSNorms"
    return describe_layer(
        layer.self_attn,
        layer.mlp,
        input_norm=norms[input_name],
        pre_mlp_norm=norms[pre_mlp_name],
        attn_out_norm=None if not attn_out_name else norms[attn_out_name],
        mlp_out_norm=None if not mlp_out_name else norms[mlp_out_name],
    )


def describe_layer(
    attn: nn.Module,
    mlp: nn.Module,
    *,
    input_norm: nn.Module,
    pre_mlp_norm: nn.Module | None,
    attn_out_norm: nn.Module | None = None,
    mlp_out_norm: nn.Module | None = None,
) -> StackLayer | str:
    """A pre-norm layer of these parts as a `StackLayer`, or in words what it has instead:
    RMSNorms or LayerNorms (`pre_mlp_norm` None: attention and MLP in parallel from the input
    norm, x + (attn + mlp)), QKVAttention (q/k RMSNorm, biases, window, soft cap allowed) with
    neox rotary over whole heads or their leading dims, or an attention that describes itself
    (`stack_mla()`: models/deepseek.py's latent attention), a gated MLP without gate/up bias or
    a plain GELU one, or an MoE block that describes itself (`stack_moe()`: models/mixtral.py)."""
    kind = _norm_kind(input_norm)
    if kind is None or _norm_kind(pre_mlp_norm) is None:
        return f"the {type(input_norm).__name__} norm (native: RMSNorm, LayerNorm)"
    sandwich = [n for n in (attn_out_norm, mlp_out_norm) if n is not None]
    if pre_mlp_norm is not None and _norm_kind(pre_mlp_norm) != kind:
        return "an RMSNorm and a LayerNorm in one layer"
    if any(_norm_kind(n) != "rms" for n in sandwich) or (kind == "layer" and sandwich):
        return "sandwich norms other than RMSNorms after RMSNorms"
    # The attention's StackLayer fields: latent attention describes itself (`stack_mla()`:
    # models/deepseek.py), the fused q/k/v attention is read here.
    own_attention = getattr(attn, "stack_mla", None)
    attention = own_attention() if own_attention is not None else _qkv_attention(attn)
    if isinstance(attention, str):
        return attention
    # An MoE block describes itself: its routed experts, and its shared expert's MLP (or None).
    moe, own_moe = None, getattr(mlp, "stack_moe", None)
    if own_moe is not None:
        described = own_moe()
        if isinstance(described, str):
            return described
        moe, mlp = described
    if mlp is None:  # routed experts alone: their SiLU is the fused_experts kernel's
        mlp_kind, gate_up, down, activation = "gated", None, None, "silu"
    elif type(mlp).forward is PlainMLP.forward:
        mlp_kind = "plain"
        gate_up, down = getattr(mlp, mlp.in_name), getattr(mlp, mlp.out_name)
    elif type(mlp).forward is GatedMLP.forward:
        mlp_kind = "gated"
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        if gate_up.bias is not None:
            return "a gate/up bias"
    else:
        return f"{type(mlp).__name__} (not the gated or plain GELU MLP, nor an MoE block)"
    if mlp is not None:
        activation = _activation(mlp)
        if activation is None:
            return f"the {type(mlp.act_fn).__name__} activation"
    eps = _eps(input_norm)
    every = [n for n in (pre_mlp_norm, *sandwich) if n is not None]
    if getattr(attn, "qk_norm", False):
        every += [attn.q_norm, attn.k_norm]
    if any(_eps(n) != eps for n in every):
        return "norms with different eps"
    layer_norm = kind == "layer"
    attention_tp = attention.pop("tp_size")  # the rest are StackLayer's fields
    return StackLayer(
        input_norm=input_norm.weight,
        post_attention_norm=None if pre_mlp_norm is None else pre_mlp_norm.weight,
        eps=eps,
        gate_up=gate_up,
        down=down,
        activation=activation,
        tp_size=max(
            attention_tp,
            1 if down is None else down.tp_size,
            1 if moe is None else moe.tp_size,
        ),
        attn_out_norm=None if attn_out_norm is None else attn_out_norm.weight,
        mlp_out_norm=None if mlp_out_norm is None else mlp_out_norm.weight,
        norm=kind,
        input_norm_bias=input_norm.bias if layer_norm else None,
        post_attention_norm_bias=(
            pre_mlp_norm.bias if layer_norm and pre_mlp_norm is not None else None
        ),
        parallel_residual=pre_mlp_norm is None,
        mlp=mlp_kind,
        moe=moe,
        **attention,
    )


def _qkv_attention(attn: nn.Module) -> dict[str, Any] | str:
    """A QKVAttention's StackLayer fields (and its `tp_size`), or in words what it is instead:
    q/k RMSNorms, neox rotary over whole heads or their leading dims."""
    if type(attn).forward is not QKVAttention.forward:
        return f"{type(attn).__name__} (not the fused q/k/v attention)"
    if attn.qk_norm and not (_norm_kind(attn.q_norm) == _norm_kind(attn.k_norm) == "rms"):
        return "a q/k norm other than RMSNorm"
    rotary, rotary_dim = attn.rotary_emb, None
    if type(rotary) is PartialRotaryEmbedding:  # the leading dims rotate, the rest pass
        rotary, rotary_dim = rotary.rotary, rotary.rotary_dim
    elif rotary.head_dim != attn.head_dim:
        return f"{type(rotary).__name__} (a rotary over {rotary.head_dim} of {attn.head_dim} dims)"
    if type(rotary).forward is not RotaryEmbedding.forward:
        return f"{type(rotary).__name__} (a rotary scaled at runtime)"
    impl = attn.attn.impl
    backend = impl.name if getattr(impl, "kernels", True) is not None else f"{impl.name} (torch)"
    return {
        "qkv": attn.qkv_proj,
        "o": getattr(attn, attn.out_name),
        "num_heads": attn.num_heads,
        "num_kv_heads": attn.num_kv_heads,
        "head_dim": attn.head_dim,
        "scale": attn.attn.scale,
        "cos_sin_cache": rotary.cos_sin_cache,
        "attention_backend": backend,
        "tp_size": attn.qkv_proj.tp_size,
        "q_norm": attn.q_norm.weight if attn.qk_norm else None,
        "k_norm": attn.k_norm.weight if attn.qk_norm else None,
        "sliding_window": attn.attn.sliding_window,
        "logits_soft_cap": getattr(impl, "logits_soft_cap", None),
        "kv_group": attn.attn.kv_group,
        "rotary_dim": rotary_dim,
    }


def describe_layers(layers: Iterable[nn.Module]) -> tuple[StackLayer, ...] | str:
    """Every layer described (`stack_layer`), or why the first that cannot be is not."""
    described = [stack_layer(layer) for layer in layers]
    reasons = [(i, d) for i, d in enumerate(described) if isinstance(d, str)]
    if reasons:
        return f"layer {reasons[0][0]}: {reasons[0][1]}"
    return tuple(d for d in described if not isinstance(d, str))


class DecoderModel(nn.Module):
    """embed_tokens -> `layers` (DecoderLayer's residual convention) -> the final `norm`, which
    adds the last residual. Subclasses set `layers` and `norm`, and may scale the embedding
    (`embed`). The model runner may run the layers in one native call instead (its fast
    path, from `stack_layers()`: engine/execution/model_runner.py), with the modules' results."""

    def __init__(self, config: Any, kernels: KernelTable = TORCH_KERNELS) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.kernels = kernels
        # `stack_layers()`'s answer, built on the first forward (the layers are final by then).
        self._stack: tuple[StackLayer, ...] | str | None = None

    def stack_layers(self) -> tuple[StackLayer, ...] | str:
        """The layers described for a native decoder step, or why one of them cannot be."""
        if self._stack is None:
            self._stack = describe_layers(self.layers)
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
