"""`StackLayer`: one decoder layer as a whole-stack kernel reads it (`KernelTable.decoder_stack`;
the CPU's is kernels/cpu/decoder_stack.py). Models describe their layers with it
(models/decoder_parts.py, `stack_layer`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(slots=True, frozen=True)
class StackLayer:
    """What the native stack reads of one pre-norm decoder layer; the model describes its layers
    (models/decoder_parts.py, `DecoderLayer.stack_layer`) when they have this exact shape:
    x -> x + o(attn(rotary(qkv(norm(x))))) -> x + down(silu(gate(norm(x))) * up(norm(x))), full
    causal attention on the native CPU backend, neox rotary over whole heads, one rank. The
    linear modules carry `weight` (a tensor or a GGUF weight) and `bias`."""

    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]
    eps: float
    qkv: nn.Module  # [(H + 2 Hkv) D, hidden]
    o: nn.Module  # [hidden, H D]
    gate_up: nn.Module  # [2 inter, hidden], gate rows then up rows, no bias
    down: nn.Module  # [hidden, inter]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    cos_sin_cache: torch.Tensor  # [max_position, D]: cos | sin
