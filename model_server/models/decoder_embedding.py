"""Decoder embedding models (Qwen3-Embedding, gte-Qwen2, Llama-shaped ones): the causal decoder
without its LM head, for last-token pooling.

Runs on a right-padded batch, `input_ids [B, L]` with `attention_mask [B, L]`, and keeps no KV
cache: a pooling request is one prefill that is never continued. With right padding the causal
mask alone is exact for every real token (padding only ever comes after them), so attention
needs no padding mask; the padded rows' outputs are never pooled. Module names follow the HF
checkpoints' (`layers.N.self_attn.q_proj`, ...), with or without the `model.` prefix that
`*ForCausalLM` checkpoints carry; `lm_head` is not loaded.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class _Attention(nn.Module):
    def __init__(self, config, head_dim: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.q_proj = nn.Linear(h, self.num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, h, bias=False)
        self.qk_norm = config.model_type == "qwen3"  # Qwen3 normalizes each head's q and k
        if self.qk_norm:
            self.q_norm = _RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = _RMSNorm(head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, length, self.num_heads, d)
        k = self.k_proj(x).view(b, length, self.num_kv_heads, d)
        v = self.v_proj(x).view(b, length, self.num_kv_heads, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, L, D]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, length, self.num_heads * d))


class _MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (expected silu)")
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, config, head_dim: int) -> None:
        super().__init__()
        self.self_attn = _Attention(config, head_dim)
        self.mlp = _MLP(config)
        self.input_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderEmbeddingModel(nn.Module):
    """`forward(input_ids [B, L], attention_mask [B, L]) -> hidden [B, L, H]` (after the final
    norm), for Llama, Qwen2 and Qwen3 configs with plain rotary embeddings."""

    def __init__(self, config) -> None:
        super().__init__()
        if config.model_type not in ("llama", "qwen2", "qwen3"):
            raise ValueError(f"unsupported decoder embedding model type {config.model_type!r}")
        # transformers 5 writes the plain rotary as {"rope_type": "default", "rope_theta": ...}.
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        if rope and rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError("decoder embedding models with scaled rotary are not supported")
        self.config = config
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.head_dim = head_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            _Layer(config, head_dim) for _ in range(config.num_hidden_layers)
        )
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        params = getattr(config, "rope_parameters", None) or {}
        self.rope_theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))

    def _rotary(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[L, D]` for positions 0..L-1 (float32, cast by the caller)."""
        d = self.head_dim
        inv_freq = 1.0 / self.rope_theta ** (
            torch.arange(0, d, 2, dtype=torch.float32, device=device) / d
        )
        angles = torch.outer(torch.arange(length, dtype=torch.float32, device=device), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = (t.to(x.dtype) for t in self._rotary(input_ids.shape[1], x.device))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            param = params.get(name)
            if param is None:
                continue  # lm_head, rotary buffers
            if param.shape != tensor.shape:
                raise ValueError(
                    f"weight {name}: checkpoint shape {tuple(tensor.shape)}, model "
                    f"{tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}")
