"""`StackLayer`: one decoder layer as a platform's native decoder step reads it (the CPU's is
kernels/cpu/decoder_stack.py). Models describe their layers with it (models/decoder_parts.py,
`stack_layer`); the platform decides whether a step runs them natively
(`Platform.native_decoder_step`), and the model runner calls the step (its fast path)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from model_server.kernels.fused_moe_torch import GroupedTopk
from model_server.kernels.lora_weights import StackedLoRA


@dataclass(slots=True, frozen=True)
class StackMoE:
    """A layer's mixture-of-experts block in place of its MLP, as the block describes itself
    (models/mixtral.py's `SparseMoEBlock.stack_moe`): router logits `router`(y) -> softmax, its
    top `top_k` (renormalised when `renormalize`) -> the routed experts of y, the kernel table's
    `moe_softmax_topk` and `fused_experts`; or, with `grouped` (DeepSeek), the kernel table's
    `moe_grouped_topk` of y in its place (its own fp32 router weight; `router` and
    `renormalize` unused). With a shared expert its MLP (the layer's `gate_up`/`down`) added:
    `shared_add` "gated", scaled by sigmoid(`shared_gate`(y)) (Qwen2-MoE: `shared_expert_add`),
    or "plain", routed + shared (DeepSeek's shared experts; no `shared_gate`)."""

    router: nn.Module  # [E, hidden], no bias
    w13: Any  # [E, 2I, hidden]: gate rows then up rows of each expert (float, or quantized)
    w2: Any  # [E, hidden, I]
    top_k: int
    renormalize: bool
    shared_gate: nn.Module | None = None  # [1, hidden]; None: no gated shared expert
    tp_size: int = 1
    grouped: GroupedTopk | None = None  # DeepSeek's router, replicated on every rank
    shared_add: str = "gated"  # "gated" | "plain": how the shared expert's MLP is added


@dataclass(slots=True, frozen=True)
class StackMLA:
    """A layer's multi-head latent attention (DeepSeek-V2/V3; models/deepseek.py's
    `DeepseekAttention.stack_mla`) in place of the fused q/k/v attention: q = q_b(RMSNorm(q_a(x)))
    (or q_proj(x) without a q LoRA), [latent, k_pe] = kv_a(x) (the layer's `qkv`), latent
    RMSNorm'd, neox rotary on q's and k_pe's rope dims (the layer's cos_sin_cache; DeepSeek's
    interleaved rope rows are de-interleaved at load), [latent, k_pe] stored in the latent cache
    [blocks, block_size, L + R], absorbed attention through `w_kv_b` for every row
    (kernels/cpu/mla_attention.c), then the layer's `o`."""

    q_a: nn.Module | None  # q_a_proj [q_lora_rank, hidden]; None: `q_b` is q_proj
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q_a_eps: float
    q_b: nn.Module  # q_b_proj [H (Dn + R), q_lora_rank], or q_proj [H (Dn + R), hidden]
    kv_a_norm: torch.Tensor  # [L]
    kv_a_eps: float
    w_kv_b: torch.Tensor  # [H (Dn + Dv), L]: each head's W_uk rows, then its W_uv rows
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int


@dataclass(slots=True, frozen=True)
class StackLayer:
    """One pre-norm decoder layer as the model describes it (models/decoder_parts.py's
    `stack_layer`):
    x -> x + attn_out_norm?(o(attn(rotary(qk_norm?(qkv(norm(x))))))) ->
         x + mlp_out_norm?(mlp(norm(x))),
    mlp gated, down(act(gate(y)) * up(y)), or plain, down(act(fc1(y))) with biases, or an MoE
    block (`moe`: routed experts, optionally beside a shared expert, gated or not); or, with
    `parallel_residual`, x -> x + (attn(norm(x)) + mlp(norm(x))) from the one input norm.
    Norms RMSNorm (Gemma's hold 1 + w) or LayerNorm (`norm`, with biases or not); q/k norms
    RMSNorm. Rotary neox over each head's first `rotary_dim` dims (the others pass through;
    None: the whole head). What the layer cannot be described as, the model says in words
    instead. The platform decides which described layers its native step runs (the attention
    backend, the activation, the rank count, ...)."""

    input_norm: torch.Tensor  # [hidden]
    # [hidden]: the norm before the MLP (HF's name); None with `parallel_residual`
    post_attention_norm: torch.Tensor | None
    eps: float  # every norm's of the layer, the q/k norms' included
    qkv: nn.Module  # [(H + 2 Hkv) D, hidden], optional bias
    o: nn.Module  # [hidden, H D], optional bias
    # gated: [2 inter, hidden], gate rows then up rows, no bias; plain: fc1 [inter, hidden];
    # None in an MoE layer without a shared expert (gate_up/down: the shared expert's MLP)
    gate_up: nn.Module | None
    down: nn.Module | None  # [hidden, inter], optional bias
    num_heads: int  # this rank's
    num_kv_heads: int  # this rank's
    head_dim: int
    scale: float
    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim]: cos | sin (this layer's rope)
    activation: str  # the MLP's: "silu", "gelu_tanh", "gelu" (erf)
    attention_backend: str  # the backend the layer's attention runs ("cpu", "torch", ...)
    tp_size: int = 1
    # Sandwich norms (Gemma 2/3, GLM-4): on the attention output and on the MLP output.
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # per-head [D] (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    kv_group: int = 0  # 1: the sliding-window layers' own KV cache pool
    rotary_dim: int | None = None  # partial rotary (GLM-4): the leading dims that rotate
    # The LayerNorm families (Phi-2, StableLM, StarCoder2):
    norm: str = "rms"  # "rms" | "layer": input_norm's and post_attention_norm's kind
    input_norm_bias: torch.Tensor | None = None  # [hidden] (LayerNorm)
    post_attention_norm_bias: torch.Tensor | None = None  # [hidden] (LayerNorm)
    # Attention and MLP both from the input norm, summed with the input (Phi-2; StableLM's
    # use_parallel_residual): x + (attn + mlp), in that order of the adds.
    parallel_residual: bool = False
    mlp: str = "gated"  # "gated" (gate_up -> act-and-mul -> down) | "plain" (fc1 -> act -> fc2)
    # routed experts instead of the MLP (Mixtral, Qwen2/3-MoE, DeepSeek)
    moe: StackMoE | None = None
    # Latent attention instead of the q/k/v one (DeepSeek): `qkv` is then kv_a_proj_with_mqa
    # [L + R, hidden], num_kv_heads 1, head_dim the cache entry L + R, rotary_dim R.
    mla: StackMLA | None = None


class StepMetadata(Protocol):
    """What a native step reads of the attention metadata (layers/attention/backend.py)."""

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    # The sliding-window layers' KV cache group (its own slot_mapping and block_tables), or None.
    sliding: StepMetadata | None


class NativeDecoderStep(Protocol):
    """A platform's whole-stack fast path for one model (`Platform.native_decoder_step`): the
    decoder layers of a step in one native call, with the modules' results. The model runner
    asks `takes` before it runs anything of the step (the embedding included: under tensor
    parallelism that is a collective, which a rank must not issue twice), and runs the modules
    where it does not."""

    def takes(self, num_tokens: int, kv_caches: Sequence[Any]) -> bool:
        """Whether a step of `num_tokens` rows over `kv_caches` runs natively."""
        ...

    def row_coverage(self, max_rows: int) -> str:
        """For people (the plan): which step sizes up to `max_rows` run natively, as far as
        the matmuls decide ("one native call per step at 1-32 rows; module by module at
        33-512 rows")."""
        ...

    def attach_lora(self, stacks: Mapping[nn.Module, StackedLoRA]) -> str | None:
        """Run these LoRA slots (a described linear module -> its slots) in the step, the rows
        chosen per call by `lora_slots`; None, or why not (adapter steps then run the
        modules)."""
        ...

    def __call__(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_caches: Sequence[Any],
        attn_metadata: StepMetadata,
        lora_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
