"""Which kernel computes each of the model's hot ops: one immutable `KernelTable` per model.

The platform chooses (`Platform.kernel_table()`), the model builder hands the table to every layer
at construction (`models.build_model(..., kernels=...)`), and each layer keeps its reference. No
process-wide switch exists: two models in one process (a test and an engine, or two engines) each
run the kernels they were built with.

Every implementation of a slot follows the portable one's numerics and contract (kernels/
portable.py): it returns new tensors and never writes its inputs (but `lora_add`, which adds to
its `out`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from model_server.kernels.batched_lora_torch import LoRARows, lora_add_torch
from model_server.kernels.fused_moe_torch import (
    GroupedTopk,
    fused_experts_grouped,
    grouped_topk_of,
    shared_expert_add,
    softmax_topk,
)
from model_server.kernels.gguf_blocks import dequantize_rows, gguf_linear_dequant
from model_server.kernels.lora_weights import StackedLoRA
from model_server.kernels.portable import (
    argmax_torch,
    fused_add_layer_norm_torch,
    fused_add_rms_norm_torch,
    gelu_tanh_and_mul_torch,
    gelu_torch,
    int8_linear_dequant,
    layer_norm_torch,
    rms_norm_torch,
    rotary_embedding_torch,
    silu_and_mul_torch,
    wna16_linear_dequant,
)
from model_server.kernels.varlen_attention import varlen_attention_torch

# (x [M, K], weight [N, K], bias [N] | None) -> [M, N]
LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# (x [M, K], qweight [N, K] int8, scale [N] bf16, bias [N] | None) -> [M, N] in x's dtype
Int8LinearFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor
]
# (x [M, K], codes uint8, scales [N, G] f32, offsets [N, G] f32, bits, group_size, bias [N] | None)
# -> [M, N] in x's dtype: a GPTQ/AWQ weight in the wNa16 layout (kernels/portable.py)
WNA16LinearFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, torch.Tensor | None],
    torch.Tensor,
]
# (x [M, K], blocks [N, row_bytes] uint8 of one ggml type, ggml type id, bias [N] | None)
# -> [M, N] in x's dtype: a GGUF matrix kept in its block layout (kernels/gguf_blocks.py)
GGUFLinearFn = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None], torch.Tensor]
# (blocks [R, row_bytes] uint8, ggml type id, K, dtype) -> [R, K]: rows of a GGUF matrix
GGUFDequantizeFn = Callable[[torch.Tensor, int, int, torch.dtype], torch.Tensor]
# (x [..., N], weight [N], eps) -> weight * normalised x
RMSNormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
# (x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)
FusedAddRMSNormFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]
# (x [..., N], weight [N], bias [N] | None, eps) -> layer_norm(x) * weight + bias
LayerNormFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor]
# (x, residual, weight, bias, eps) -> (layer_norm(x + residual), x + residual)
FusedAddLayerNormFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float],
    tuple[torch.Tensor, torch.Tensor],
]
# (x, approximate "none" | "tanh") -> gelu(x)
GeluFn = Callable[[torch.Tensor, str], torch.Tensor]
# x [..., 2d] -> silu(x[..., :d]) * x[..., d:] [..., d]
SiluAndMulFn = Callable[[torch.Tensor], torch.Tensor]
# (positions [T], query [T, H, D], key [T, Hkv, D], cos_sin_cache [max_position, D])
# -> rotated (query, key), neox layout
RotaryFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]
# (q [T, Hq * D], k [T, Hkv * D], v [T, Hkv * D], cu_seqlens [B + 1] int32 CPU, Hq, Hkv, scale,
# causal) -> [T, Hq * D]: a pooling step's attention, each packed sequence over its own tokens
# (kernels/varlen_attention.py)
VarlenAttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, float, bool], torch.Tensor
]

# logits [B, V] -> [B] int64: greedy sampling (layers/sampler.py), ties to the lowest id
ArgmaxFn = Callable[[torch.Tensor], torch.Tensor]

# (x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] float32, topk_ids [T, k] int64,
# the table) -> [T, H]: the mixture-of-experts experts (kernels/fused_moe_torch.py)
FusedExpertsFn = Callable[..., torch.Tensor]
# (router_logits [T, E], top_k, renormalize) -> (weights [T, k] float32, ids [T, k] int64): the
# softmax top-k router of Mixtral and Qwen2/3-MoE (kernels/fused_moe_torch.py)
SoftmaxTopkFn = Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]]
# (x [T, H], the router) -> (weights [T, k] float32, ids [T, k] int64): DeepSeek's grouped
# top-k router on its fp32 logits (kernels/fused_moe_torch.py's `grouped_topk_of`)
GroupedTopkFn = Callable[[torch.Tensor, GroupedTopk], tuple[torch.Tensor, torch.Tensor]]
# (routed [T, H], gate [T, 1], shared [T, H]) -> routed + sigmoid(gate) * shared (Qwen2-MoE)
SharedExpertAddFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# (x [T, in], out [T, out], the step's rows, the layer's adapter slots) -> None: adds each row's
# adapter's product to `out` in place, the one slot that writes an input (out is the LoRA layer's
# fresh output; kernels/batched_lora_torch.py)
LoRAAddFn = Callable[[torch.Tensor, torch.Tensor, LoRARows, StackedLoRA], None]


@dataclass(slots=True, frozen=True)
class KernelTable:
    """The functions a model's layers call (see layers/linear.py, norm.py, activation.py,
    rotary.py).

    Derive a variant with `dataclasses.replace(TORCH_KERNELS, rms_norm=...)`.
    """

    # Each slot serves every weight the platform did not plan; a planned weight
    # (kernels/planned_weight.py) carries its own kernels per row count.
    linear: LinearFn = F.linear  # every float linear layer and the LM head
    int8_linear: Int8LinearFn = int8_linear_dequant  # the same once `--quantization int8` ran
    # 4/8-bit group-quantized checkpoints (GPTQ, AWQ) kept quantized (layers/quantization/wna16.py)
    wna16_linear: WNA16LinearFn = wna16_linear_dequant
    gguf_linear: GGUFLinearFn = gguf_linear_dequant  # GGUF weights kept quantized
    gguf_dequantize: GGUFDequantizeFn = dequantize_rows  # their embedding lookups
    rms_norm: RMSNormFn = rms_norm_torch
    fused_add_rms_norm: FusedAddRMSNormFn = fused_add_rms_norm_torch
    silu_and_mul: SiluAndMulFn = silu_and_mul_torch
    gelu_tanh_and_mul: SiluAndMulFn = gelu_tanh_and_mul_torch  # GeGLU (Gemma)
    # LayerNorm families (Phi-2, StableLM, StarCoder2: layers/norm.py's LayerNorm)
    layer_norm: LayerNormFn = layer_norm_torch
    fused_add_layer_norm: FusedAddLayerNormFn = fused_add_layer_norm_torch
    gelu: GeluFn = gelu_torch  # the plain (not gated) MLPs' activation
    rotary_embedding: RotaryFn = rotary_embedding_torch
    fused_experts: FusedExpertsFn = fused_experts_grouped  # MoE layers (layers/fused_moe/)
    moe_softmax_topk: SoftmaxTopkFn = softmax_topk  # their router (models/mixtral.py)
    moe_grouped_topk: GroupedTopkFn = grouped_topk_of  # DeepSeek's router (models/deepseek.py)
    shared_expert_add: SharedExpertAddFn = shared_expert_add  # models/qwen_moe.py
    argmax: ArgmaxFn = argmax_torch  # the sampler's greedy rows
    # pooling models' attention over packed sequences (models/bert.py, decoder_embedding.py)
    varlen_attention: VarlenAttentionFn = varlen_attention_torch
    # multi-LoRA layers off the native CPU kernel (lora/layers.py's LoRALinear), mixed batches
    lora_add: LoRAAddFn = lora_add_torch


# The portable table: the default of every layer and of platforms without kernels of their own.
TORCH_KERNELS = KernelTable()


def triton_kernels(base: KernelTable = TORCH_KERNELS) -> KernelTable:
    """`base` with the one-pass Triton RMSNorm (+ residual add), SiluAndMul and neox rotary
    (kernels/rms_norm.py, activation.py, rotary.py), the w8a16 int8 matmul (kernels/
    int8_linear.py), the GPTQ/AWQ w4a16/w8a16 matmul (kernels/wna16_linear.py), the
    grouped-GEMM fused MoE (kernels/fused_moe.py) and the pooling models' packed varlen
    attention (kernels/varlen_attention_triton.py).

    Multi-LoRA layers' mixed batches run one shrink and one expand launch per layer (kernels/
    batched_lora.py).

    Imports triton: call it where compiled Triton supports the model's device (CUDA) or under
    TRITON_INTERPRET=1 (tests); the kernels compile on first launch, so build the model (and
    warm it up) before capturing device graphs.
    """
    from model_server.kernels.activation import silu_and_mul
    from model_server.kernels.batched_lora import lora_add_triton
    from model_server.kernels.fused_moe import fused_experts_triton
    from model_server.kernels.int8_linear import int8_linear
    from model_server.kernels.rms_norm import fused_add_rms_norm, rms_norm
    from model_server.kernels.rotary import rotary_embedding
    from model_server.kernels.varlen_attention_triton import varlen_attention_triton
    from model_server.kernels.wna16_linear import wna16_linear

    return replace(
        base,
        int8_linear=int8_linear,
        wna16_linear=wna16_linear,
        rms_norm=rms_norm,
        fused_add_rms_norm=fused_add_rms_norm,
        silu_and_mul=silu_and_mul,
        rotary_embedding=rotary_embedding,
        fused_experts=fused_experts_triton,
        lora_add=lora_add_triton,
        varlen_attention=varlen_attention_triton,
    )
