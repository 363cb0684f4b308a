"""DeepSeek-V2 / V2-Lite and DeepSeek-V3 / R1 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`).

Attention is multi-head latent attention (layers/attention/mla.py): q through a LoRA
(`q_a_proj`, RMSNorm, `q_b_proj`; V2-Lite: a plain `q_proj`), K/V compressed into a latent of
`kv_lora_rank` by `kv_a_proj_with_mqa` (which also yields one shared rope key of
`qk_rope_head_dim`), and the paged KV cache holds only that latent and rope key per token.
Rope: yarn (the released configs) or plain, on the rope dims only; DeepSeek interleaves the
rope pairs (x0, x1), (x2, x3)...: we permute those rows of q_b_proj / q_proj and
kv_a_proj_with_mqa at load time so the neox rotary kernel applies (q.k is unchanged by the same
permutation of both). Softmax scale: (qk_nope + qk_rope)^-0.5 times yarn's mscale^2.

MLP: dense in the first `first_k_dense_replace` layers, then MoE: `n_routed_experts` experts with
DeepSeek's routers (layers/fused_moe/router.py; V2 softmax greedy / group-limited, V3 sigmoid with
`e_score_correction_bias` and grouped top-k), weights scaled by `routed_scaling_factor`, plus
`n_shared_experts` always-on experts as one dense MLP. Multi-token-prediction layers of V3
checkpoints (past `num_hidden_layers`) are skipped.

Tensor parallelism: attention heads split evenly (q_b_proj / kv_b_proj rows, o_proj columns;
the latent projections and the latent cache are replicated on every rank), experts by their
intermediate dim, shared experts and dense MLPs evenly. Attention backends: `torch` runs the
PyTorch MLA, `cpu` the native kernel (kernels/cpu/mla_attention.c, which the native decoder
step runs too: `DeepseekAttention.stack_mla`); `triton` stores latents and decodes with Triton
kernels (prefills on the PyTorch path), see layers/attention/mla.py.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from model_server.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from model_server.distributed.partition import divide
from model_server.kernels.fused_moe_torch import GroupedTopk
from model_server.kernels.stack_layer import StackMLA, StackMoE
from model_server.kernels.table import KernelTable
from model_server.layers.attention.backend import AttentionBackend, AttentionMetadata
from model_server.layers.attention.mla import MLAAttention
from model_server.layers.fused_moe import FusedMoE
from model_server.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from model_server.layers.norm import RMSNorm
from model_server.layers.quantization.base import linear_quant_method
from model_server.layers.quantization.gguf import GGUFTensor
from model_server.layers.quantization.wna16 import WNA16Config, WNA16Weight
from model_server.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from model_server.layers.rotary_yarn import (
    ScaledRotaryEmbedding,
    yarn_parameters,
    yarn_softmax_scale,
)
from model_server.models.llama import LlamaMLP
from model_server.models.moe_decoder import MoECausalLM

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def _is_v3(config: Any) -> bool:
    return config.model_type != "deepseek_v2"


def _rope_interleaved(config: Any) -> bool:
    return not _is_v3(config) or bool(getattr(config, "rope_interleave", True))


class KVBProj(nn.Module):
    """kv_b_proj's weight, this rank's heads: [H_local * (Dn + Dv), L]. Not a linear layer: MLA
    reads the matrix itself (absorbed into the query for decodes), so it is neither tuned nor
    kept quantized: a GPTQ / AWQ checkpoint's kv_b_proj is loaded as such (the loaders of
    layers/quantization/wna16.py, this object answering where its rows lie as a column-parallel
    layer does) and dequantized into the float weight after loading (`quant_method`)."""

    def __init__(self, kv_lora_rank: int, num_heads: int, per_head: int) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.local_heads = divide(num_heads, tp_size, "num_attention_heads")
        self.rows_total = num_heads * per_head
        self.row_start = get_tensor_model_parallel_rank() * self.local_heads * per_head
        self.output_size = self.local_heads * per_head
        self.input_size = kv_lora_rank
        self.dtype = torch.get_default_dtype()
        quant = linear_quant_method()
        self.quant_method: _DequantizedAfterLoading | None = None
        if isinstance(quant, WNA16Config):
            self.quant_method = _DequantizedAfterLoading(quant)
            quant.create_weights(self)
            return
        self.weight = nn.Parameter(
            torch.empty(self.local_heads * per_head, kv_lora_rank), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def input_shard(self) -> tuple[int, int, int]:
        return 0, self.input_size, self.input_size

    def output_shard(self, shard_id: int | str | None = None) -> tuple[int, int, int, int]:
        return 0, self.output_size, self.row_start, self.rows_total

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        expected = (self.rows_total, param.shape[1])
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"kv_b_proj: checkpoint tensor has shape {tuple(loaded.shape)}, expected {expected}"
            )
        param.data.copy_(loaded[self.row_start : self.row_start + param.shape[0]])


class _DequantizedAfterLoading:
    """kv_b_proj of a GPTQ / AWQ checkpoint: repacked as a linear layer's, then dequantized
    into the float `weight` MLA reads."""

    def __init__(self, config: WNA16Config) -> None:
        self.config = config

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.config.process_weights_after_loading(layer)
        weight = layer.weight.dequantize(layer.dtype)
        del layer.weight
        layer.weight = nn.Parameter(weight, requires_grad=False)


def _deinterleave_rows(weight: WNA16Weight, per_head: int, rope: int) -> None:
    """Apply the rope de-interleave (module doc) to the output rows of a quantized q / q_b /
    kv_a projection: the last `rope` rows of each `per_head` block (the wNa16 layout is one row
    of codes, scales and offsets per output feature)."""
    perm = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
    rows = torch.arange(weight.shape[0]).view(-1, per_head)
    rows[:, per_head - rope :] = rows[:, per_head - rope :][:, perm]
    order = rows.flatten().to(weight.codes.device)
    for tensor in (weight.codes, weight.scales, weight.offsets):
        tensor.data = tensor.data.index_select(0, order)


class DeepseekAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        rotary_emb: nn.Module,
        kernels: KernelTable,
        decode_kernel: str = "torch",
    ) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_head_dim, kernels=kernels)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias, kernels=kernels)
            # HF builds both latent norms with the default eps, not rms_norm_eps.
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=1e-6, kernels=kernels)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, heads * qk_head_dim, kernels=kernels
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias, kernels=kernels
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=1e-6, kernels=kernels)
        self.kv_b_proj = KVBProj(self.kv_lora_rank, heads, self.qk_nope_head_dim + self.v_head_dim)
        self.num_heads = self.kv_b_proj.local_heads
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, hidden, bias=bias, kernels=kernels)
        self.rotary_emb = rotary_emb
        params = rope_parameters_from_config(config)
        self.mla = MLAAttention(
            self.num_heads,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.kv_lora_rank,
            yarn_softmax_scale(params, qk_head_dim**-0.5),
            decode_kernel=decode_kernel,
        )
        # What the runner's generic KV accounting reads: one "head" holding the latent entry.
        self.num_kv_heads = 1
        self.head_dim = self.mla.cache_entry_size

    def stack_mla(self) -> dict[str, Any] | str:
        """This attention's StackLayer fields for a native decoder step (models/decoder_parts.py's
        `describe_layer`; `mla` a StackMLA, `tp_size` the ranks'), or in words why not: RMSNorm
        latent norms and a neox rotary over the rope dims (a yarn-scaled cache is read as it
        is), as `forward` runs them."""
        norms = (self.kv_a_layernorm,) + (() if self.q_lora_rank is None else (self.q_a_layernorm,))
        if any(type(n).forward is not RMSNorm.forward for n in norms):
            return "latent attention with a norm other than RMSNorm"
        rotary = self.rotary_emb
        if type(rotary).forward not in (RotaryEmbedding.forward, ScaledRotaryEmbedding.forward):
            return f"latent attention with {type(rotary).__name__} (a rotary scaled at runtime)"
        if rotary.head_dim != self.qk_rope_head_dim:
            return f"latent attention with a rotary over {rotary.head_dim} dims"
        weight = self.kv_b_proj.weight
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            return "latent attention with a kv_b_proj weight that is not a float tensor"
        lora = self.q_lora_rank is not None
        q = self.q_b_proj if lora else self.q_proj
        kernel = self.mla.decode_kernel
        native = kernel == "cpu" and self.mla.kernels is not None
        mla = StackMLA(
            q_a=self.q_a_proj if lora else None,
            q_a_norm=self.q_a_layernorm.weight if lora else None,
            q_a_eps=self.q_a_layernorm.variance_epsilon if lora else 0.0,
            q_b=q,
            kv_a_norm=self.kv_a_layernorm.weight,
            kv_a_eps=self.kv_a_layernorm.variance_epsilon,
            w_kv_b=weight.data,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            kv_lora_rank=self.kv_lora_rank,
        )
        return {
            "qkv": self.kv_a_proj_with_mqa,
            "o": self.o_proj,
            "num_heads": self.num_heads,
            "num_kv_heads": 1,
            "head_dim": self.mla.cache_entry_size,
            "scale": self.mla.scale,
            "cos_sin_cache": rotary.cos_sin_cache,
            # the MLA the modules run: the native kernel's, or PyTorch's ("torch (MLA)", ...)
            "attention_backend": "cpu" if native else f"{kernel} (MLA)",
            "tp_size": max(q.tp_size, self.o_proj.tp_size),
            "rotary_dim": self.qk_rope_head_dim,
            "mla": mla,
        }

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(-1, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        out = self.mla(
            q_nope, q_pe, latent, k_pe[:, 0], self.kv_b_proj.weight, kv_cache, attn_metadata
        )
        return self.o_proj(out)


class DeepseekRouter(nn.Module):
    """The router's weight [E, hidden] (and V3's `e_score_correction_bias` [E]), held and scored
    in float32 as HF does (its `_keep_in_fp32_modules_strict`), through the kernel table's
    `moe_grouped_topk` (natively on the CPU: kernels/cpu/moe_routing.c)."""

    def __init__(self, config: Any, kernels: KernelTable) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(
            torch.empty(config.n_routed_experts, config.hidden_size, dtype=torch.float32),
            requires_grad=False,
        )
        self.v3 = _is_v3(config)
        if self.v3:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(config.n_routed_experts, dtype=torch.float32), requires_grad=False
            )
        self._routing: GroupedTopk | None = None

    def routing(self) -> GroupedTopk:
        """The router as the kernel table's `moe_grouped_topk` (and a native step) reads it:
        built on first use, once the weights are loaded (they are filled in place), and kept:
        every forward routes through it."""
        if self._routing is None:
            self._routing = self._describe()
        return self._routing

    def _describe(self) -> GroupedTopk:
        c = self.config
        return GroupedTopk(
            weight=self.weight,
            correction_bias=self.e_score_correction_bias if self.v3 else None,
            top_k=self.top_k,
            scoring="sigmoid" if self.v3 else "softmax",
            topk_method="noaux_tc" if self.v3 else (c.topk_method or "greedy"),
            n_group=c.n_group,
            topk_group=c.topk_group,
            routed_scaling_factor=float(c.routed_scaling_factor),
            norm_topk_prob=bool(c.norm_topk_prob),
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.moe_grouped_topk(x, self.routing())


class DeepseekMoE(nn.Module):
    def __init__(self, config: Any, kernels: KernelTable) -> None:
        super().__init__()
        self.gate = DeepseekRouter(config, kernels)
        self.experts = FusedMoE(
            config.n_routed_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            kernels=kernels,
        )
        self.shared_experts = None
        if config.n_shared_experts:
            self.shared_experts = LlamaMLP(
                config.hidden_size,
                config.moe_intermediate_size * config.n_shared_experts,
                config.hidden_act,
                bias=bool(getattr(config, "mlp_bias", False)),
                kernels=kernels,
            )

    def stack_moe(self) -> tuple[StackMoE, nn.Module | None]:
        """This block for a native decoder step (models/decoder_parts.py's `describe_layer`):
        the grouped top-k router, the routed experts, and the shared experts' MLP (or None),
        added without a gate."""
        moe = StackMoE(
            router=self.gate,
            w13=self.experts.w13_weight,
            w2=self.experts.w2_weight,
            top_k=self.gate.top_k,
            renormalize=False,
            tp_size=self.experts.tp_size,
            grouped=self.gate.routing(),
            shared_add="plain",
        )
        return moe, self.shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekForCausalLM(MoECausalLM):
    # Only gate/up are fused: q_proj (V2-Lite) is not part of a qkv_proj here.
    STACKED_PARAMS = tuple(m for m in MoECausalLM.STACKED_PARAMS if m[0] == ".gate_up_proj")

    def __init__(
        self,
        config: Any,
        attn_backend: type[AttentionBackend],
        max_model_len: int | None = None,
        kernels: KernelTable | None = None,
    ) -> None:
        extra = {} if kernels is None else {"kernels": kernels}
        super().__init__(config, attn_backend, max_model_len, **extra)

    def make_rotary(self, config: Any, max_position: int, kernels: KernelTable) -> nn.Module:
        params = rope_parameters_from_config(config)
        dim = config.qk_rope_head_dim
        if params["rope_type"] == "yarn":
            inv_freq, factor = yarn_parameters(dim, params, config.max_position_embeddings)
            return ScaledRotaryEmbedding(inv_freq, factor, max_position, kernels=kernels)
        return get_rope(dim, max_position, config, kernels)

    def make_layer_parts(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: nn.Module,
        attn_backend: type[AttentionBackend],
        kernels: KernelTable,
    ) -> tuple[nn.Module, nn.Module]:
        # the backend's own MLA: Triton's decode kernel, the native CPU kernel, or PyTorch's
        decode_kernel = attn_backend.name if attn_backend.name in ("triton", "cpu") else "torch"
        attn = DeepseekAttention(config, rotary_emb, kernels, decode_kernel)
        if layer_idx >= (config.first_k_dense_replace or 0):
            return attn, DeepseekMoE(config, kernels)
        dense = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=bool(getattr(config, "mlp_bias", False)),
            kernels=kernels,
        )
        return attn, dense

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int]:
        """One layer's latent cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]."""
        return (num_blocks, block_size, self.config.kv_lora_rank + self.config.qk_rope_head_dim)

    @classmethod
    def check_tensor_parallel(cls, config: Any, world_size: int) -> None:
        divide(config.num_attention_heads, world_size, "num_attention_heads")
        divide(config.moe_intermediate_size, world_size, "moe_intermediate_size")
        if config.n_shared_experts:
            divide(
                config.moe_intermediate_size * config.n_shared_experts,
                world_size,
                "the shared experts' intermediate size",
            )
        if config.first_k_dense_replace:
            divide(config.intermediate_size, world_size, "intermediate_size")

    # ---- checkpoint names -----------------------------------------------------------------

    def skip_weight(self, name: str) -> bool:
        match = _LAYER_RE.match(name)
        return match is not None and int(match.group(1)) >= self.config.num_hidden_layers

    def process_weights_after_loading(self) -> None:
        """The rope de-interleave of `transform_weight`, for the q and kv_a projections a GPTQ /
        AWQ checkpoint keeps quantized (once repacked)."""
        if not _rope_interleaved(self.config):
            return
        c = self.config
        rope = c.qk_rope_head_dim
        for layer in self.model.layers:
            attn = layer.self_attn
            q = attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj
            if isinstance(q.weight, WNA16Weight):
                _deinterleave_rows(q.weight, c.qk_nope_head_dim + rope, rope)
            kv_a = attn.kv_a_proj_with_mqa
            if isinstance(kv_a.weight, WNA16Weight):
                _deinterleave_rows(kv_a.weight, c.kv_lora_rank + rope, rope)

    def transform_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """De-interleave the rope rows (see the module doc) of q and of kv_a_proj_with_mqa: a
        row gather, so a GGUF matrix kept quantized (whole rows of blocks) takes it too."""
        if not _rope_interleaved(self.config):
            return tensor
        rope = self.config.qk_rope_head_dim
        perm = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            nope = self.config.qk_nope_head_dim
            index = torch.arange(tensor.shape[0]).view(-1, nope + rope)
            index[:, nope:] = index[:, nope:][:, perm]
            return _gather_rows(tensor, index.reshape(-1))
        if name.endswith(("self_attn.kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias")):
            lora = self.config.kv_lora_rank
            return _gather_rows(tensor, torch.cat((torch.arange(lora), lora + perm)))
        return tensor


def _gather_rows(tensor: torch.Tensor | GGUFTensor, index: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, GGUFTensor):  # --gguf-weights quantized
        return tensor.permute_rows(index)  # type: ignore[return-value]
    return tensor[index]
