"""DBRX (`DbrxForCausalLM`): LayerNorm without bias, a fused `Wqkv` projection clamped to
[-clip_qkv, clip_qkv] (`attn_config.clip_qkv`), GQA (`attn_config.kv_n_heads`), neox rotary, and
every MLP a sparse MoE block: a softmax router (`ffn.router.layer`), top `moe_top_k` experts whose
weights are divided by their `moe_normalize_expert_weights`-norm (1: renormalised to sum 1), and
SwiGLU experts.

The checkpoint keeps each layer's experts in three fused matrices of [E * ffn, hidden]:
`ffn.experts.mlp.w1` (gate), `v1` (up) and `w2` (down, transposed: expert e computes
h @ w2[e]), loaded expert by expert into the stacked w13 / w2 of layers/fused_moe.

The rope base is `attn_config.rope_theta` where the config has it (DBRX's config.json: 500000;
transformers 5 drops it from `rope_parameters`, keeping 10000), else the rope parameters'.

Tensor parallelism: attention by KV-head group, every expert's intermediate dim split evenly,
the router replicated, the vocabulary split.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_server.distributed.partition import divide
from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.attention.backend import AttentionBackend, AttentionMetadata
from model_server.layers.fused_moe import DOWN, GATE, UP, FusedMoE
from model_server.layers.linear import ReplicatedLinear
from model_server.layers.quantization.base import building_quantized_linears
from model_server.layers.rotary import get_rope, rope_parameters_from_config
from model_server.models.decoder_parts import QKVAttention, get_head_dim, make_lm_head, param_for
from model_server.models.llama import LlamaForCausalLM
from model_server.models.mixtral import check_attention_split
from model_server.models.phi import LayerNormModel
from model_server.models.starcoder2 import SequentialLayerNormLayer

_EXPERT_PARTS = {"w1": GATE, "v1": UP, "w2": DOWN}


def _sub(config: Any, name: str) -> Any:
    """`config.attn_config` / `ffn_config` as attributes (a dict in a plain config)."""
    sub = getattr(config, name)
    if isinstance(sub, dict):
        from types import SimpleNamespace

        return SimpleNamespace(**sub)
    return sub


class DbrxAttention(QKVAttention):
    """QKVAttention named as DBRX's (`Wqkv` -> qkv_proj, `out_proj` -> o_proj by the loader's
    renames) with the q/k/v clamp."""

    def __init__(self, *args: Any, clip_qkv: float | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clip_qkv = clip_qkv

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class DbrxMoE(nn.Module):
    """Router `gate` [E, hidden] + the experts: [T, hidden] -> [T, hidden]."""

    def __init__(self, config: Any, kernels: KernelTable) -> None:
        super().__init__()
        ffn = _sub(config, "ffn_config")
        act = (getattr(ffn, "ffn_act_fn", None) or {}).get("name", "silu")
        if act != "silu":
            raise ValueError(f"dbrx with ffn_act_fn {act!r} is not supported (silu only)")
        self.top_k = ffn.moe_top_k
        self.norm_p = getattr(ffn, "moe_normalize_expert_weights", 1.0)
        num_experts = ffn.moe_num_experts
        with building_quantized_linears(None):  # the router stays float
            self.gate = ReplicatedLinear(
                config.hidden_size, num_experts, bias=False, kernels=kernels
            )
        self.experts = FusedMoE(
            num_experts, config.hidden_size, ffn.ffn_hidden_size, kernels=kernels
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_p is not None:
            weights = weights / torch.norm(weights, p=self.norm_p, dim=-1, keepdim=True)
        return self.experts(x, weights, ids)


def dbrx_rope_parameters(config: Any) -> dict[str, Any]:
    params = rope_parameters_from_config(config)
    theta = getattr(_sub(config, "attn_config"), "rope_theta", None)
    if theta is not None:
        params["rope_theta"] = float(theta)
    return params


class DbrxForCausalLM(LlamaForCausalLM):
    """DBRX (see the module docstring): Llama's runner interface, HF checkpoint names mapped onto
    ours (`transformer.blocks.N.norm_attn_norm.attn.Wqkv` -> `model.layers.N.self_attn.
    qkv_proj`, ...), the fused experts split at load."""

    CHECKPOINT_RENAMES = (
        ("transformer.wte.", "model.embed_tokens."),
        ("transformer.norm_f.", "model.norm."),
        ("transformer.blocks.", "model.layers."),
        (".norm_attn_norm.norm_1.", ".input_layernorm."),
        (".norm_attn_norm.norm_2.", ".post_attention_layernorm."),
        (".norm_attn_norm.attn.Wqkv.", ".self_attn.qkv_proj."),
        (".norm_attn_norm.attn.out_proj.", ".self_attn.o_proj."),
        (".ffn.router.layer.", ".mlp.gate."),
        (".ffn.experts.mlp.", ".mlp.experts."),
    )

    def __init__(
        self,
        config: Any,
        attn_backend: type[AttentionBackend],
        max_model_len: int | None = None,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        nn.Module.__init__(self)
        if getattr(config, "quantization_config", None):
            raise ValueError("dbrx: quantized (GPTQ / AWQ) checkpoints are not supported")
        self.config = config
        self.max_position = max_model_len or config.max_position_embeddings
        self.sliding_window = None
        attn_config = _sub(config, "attn_config")
        clip = getattr(attn_config, "clip_qkv", None)
        rotary = get_rope(
            get_head_dim(config),
            self.max_position,
            config,
            kernels,
            params=dbrx_rope_parameters(config),
        )
        eps = 1e-5  # DBRX's nn.LayerNorm default
        layers = [
            SequentialLayerNormLayer(
                config.hidden_size,
                eps,
                False,
                DbrxAttention(
                    config,
                    rotary,
                    attn_backend,
                    kernels,
                    qkv_bias=False,
                    o_bias=False,
                    clip_qkv=None if clip is None else float(clip),
                ),
                DbrxMoE(config, kernels),
                kernels,
            )
            for _ in range(config.num_hidden_layers)
        ]
        self.model = LayerNormModel(config, layers, rotary, kernels, eps=eps, norm_bias=False)
        self.tie_word_embeddings, self.lm_head = make_lm_head(
            config, self.model.embed_tokens, kernels, tie_default=False
        )

    @classmethod
    def check_tensor_parallel(cls, config: Any, world_size: int) -> None:
        check_attention_split(config, world_size)
        ffn = _sub(config, "ffn_config")
        divide(ffn.ffn_hidden_size, world_size, "ffn_config.ffn_hidden_size (each expert's)")

    def load_special_weight(
        self,
        params: dict[str, nn.Parameter],
        name: str,
        tensor: torch.Tensor,
        loaded: set[str],
        loaded_shards: dict[str, set[Any]],
        checkpoint_name: str | None = None,
    ) -> bool:
        """`mlp.experts.w1` / `v1` / `w2` ([E * ffn, hidden] each), one expert at a time."""
        prefix, _, part = name.rpartition(".")
        if not prefix.endswith(".mlp.experts") or part not in _EXPERT_PARTS:
            return False
        shard_id = _EXPERT_PARTS[part]
        target = f"{prefix}.{'w2' if shard_id == DOWN else 'w13'}_weight"
        param = param_for(params, target, checkpoint_name or name)
        moe: FusedMoE = self.get_submodule(prefix)
        experts = tensor.reshape(moe.num_experts, moe.intermediate_size, moe.hidden_size)
        for e in range(moe.num_experts):
            matrix = experts[e].t() if shard_id == DOWN else experts[e]
            param.weight_loader(  # type: ignore[attr-defined]
                param, matrix, shard_id, e, checkpoint_name=checkpoint_name or name
            )
            loaded_shards.setdefault(target, set()).add((e, shard_id))
        return True

    def expected_shards(self, target: str, modules: dict[str, nn.Module]) -> set[Any]:
        owner = modules.get(target.rsplit(".", 1)[0])
        if isinstance(owner, FusedMoE):
            parts = (DOWN,) if target.rsplit(".", 1)[1].startswith("w2_") else (GATE, UP)
            return {(e, p) for e in range(owner.num_experts) for p in parts}
        return super().expected_shards(target, modules)
