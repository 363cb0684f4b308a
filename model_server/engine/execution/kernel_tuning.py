"""What the model runner tells the platform about the model's matmuls: the linear shapes of a
config (for `--dtype auto`, before the model exists) and the linear weights of a built model
(for `Platform.plan_linears`, once its weights are loaded)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_server.kernels.linear_sites import LinearSite
from model_server.layers.embedding import ParallelLMHead
from model_server.layers.linear import LinearBase
from model_server.layers.quantization import Int8Weight
from model_server.layers.quantization.gguf import GGUFWeight
from model_server.layers.quantization.wna16 import WNA16Weight
from model_server.models.llama import get_head_dim, get_num_kv_heads


def config_linear_shapes(config: Any, tp_size: int = 1) -> list[tuple[int, int, int]]:
    """(N, K, count) of a Llama-family model's linear weights on one of `tp_size` ranks: the
    fused qkv, o, gate_up and down projections of every layer, and the LM head. Approximate
    where a split is uneven; empty when the config lacks the sizes."""
    try:
        hidden, inter = int(config.hidden_size), int(config.intermediate_size)
        heads, layers = int(config.num_attention_heads), int(config.num_hidden_layers)
        head_dim, kv_heads = get_head_dim(config), get_num_kv_heads(config)
        vocab = int(config.vocab_size)
    except (AttributeError, TypeError, ValueError):
        return []
    q, kv = heads * head_dim // tp_size, max(1, kv_heads // tp_size) * head_dim
    return [
        (q + 2 * kv, hidden, layers),
        (hidden, q, layers),
        (2 * inter // tp_size, hidden, layers),
        (hidden, inter // tp_size, layers),
        (-(-vocab // tp_size), hidden, 1),
    ]


def linear_sites(model: nn.Module, max_rows: int, max_head_rows: int) -> list[LinearSite]:
    """Every linear layer's weight and the LM head's, with the most rows each multiplies: the
    step's token budget, or the rows a step samples for the head. A weight also registered
    in another module (a tied embedding) is not exclusive. A GGUF weight kept quantized gives
    a site per row segment (its blocks are never re-laid out, so sharing does not matter)."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    sites: list[LinearSite] = []
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase | ParallelLMHead):
            continue
        rows = max_head_rows if isinstance(module, ParallelLMHead) else max_rows
        weight = module.weight
        if isinstance(weight, Int8Weight):
            sites.append(
                LinearSite(
                    weight.qweight, rows, True, weight.scale, name, module=name, holder=weight
                )
            )
        elif isinstance(weight, WNA16Weight):
            sites.append(
                LinearSite(
                    weight.codes,
                    rows,
                    True,
                    weight.scales,
                    name,
                    offsets=weight.offsets,
                    bits=weight.bits,
                    group_size=weight.group_size,
                    module=name,
                    holder=weight,
                )
            )
        elif isinstance(weight, GGUFWeight):
            for i, (ggml_type, blocks) in enumerate(weight.segments()):
                part = f"{name}.blocks{i}"
                site = LinearSite(
                    blocks,
                    rows,
                    True,
                    None,
                    part,
                    ggml_type=ggml_type,
                    k=weight.k,
                    module=name,
                    holder=weight,
                )
                sites.append(site)
        elif isinstance(weight, torch.Tensor):
            exclusive = uses.get(id(weight), 0) == 1
            lm_head = isinstance(module, ParallelLMHead)
            sites.append(
                LinearSite(
                    weight, rows, exclusive, None, name, module=name, holder=weight, lm_head=lm_head
                )
            )
    return sites
