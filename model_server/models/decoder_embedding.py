"""Decoder embedding models (Qwen3-Embedding, gte-Qwen2, Llama-shaped ones): the causal decoder
without its LM head, for last-token pooling.

Runs on a packed batch (`PackedBatch`: the step's T tokens one sequence after another, no
padding) and keeps no KV cache: a pooling request is one prefill that is never continued. Each
sequence attends causally over its own tokens (the kernel table's `varlen_attention`), rotary
angles come from each token's position in its sequence. The linear layers are Wick's
(`ReplicatedLinear`), planned by the platform as a decoder's. Module names follow the HF
checkpoints' (`layers.N.self_attn.q_proj`, ...), with or without the `model.` prefix that
`*ForCausalLM` checkpoints carry; `lm_head` is not loaded.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.linear import ReplicatedLinear
from model_server.models.pooling_batch import PackedBatch


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
    def __init__(self, config, head_dim: int, kernels: KernelTable) -> None:
        super().__init__()
        h = config.hidden_size
        self.kernels = kernels
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.q_proj = ReplicatedLinear(h, q, bias=bias, kernels=kernels)
        self.k_proj = ReplicatedLinear(h, kv, bias=bias, kernels=kernels)
        self.v_proj = ReplicatedLinear(h, kv, bias=bias, kernels=kernels)
        self.o_proj = ReplicatedLinear(q, h, bias=False, kernels=kernels)
        self.qk_norm = config.model_type == "qwen3"  # Qwen3 normalizes each head's q and k
        if self.qk_norm:
            self.q_norm = _RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = _RMSNorm(head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: PackedBatch
    ) -> torch.Tensor:
        """x [T, H]; cos, sin [T, 1, D] at each token's position."""
        t, d = x.shape[0], self.head_dim
        q = self.q_proj(x).view(t, self.num_heads, d)
        k = self.k_proj(x).view(t, self.num_kv_heads, d)
        v = self.v_proj(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = self.kernels.varlen_attention(
            q.reshape(t, -1), k.reshape(t, -1), v, batch.cu_seqlens, self.num_heads,
            self.num_kv_heads, d**-0.5, True,
        )  # fmt: skip
        return self.o_proj(out)


class _MLP(nn.Module):
    def __init__(self, config, kernels: KernelTable) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (expected silu)")
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = ReplicatedLinear(h, i, bias=False, kernels=kernels)
        self.up_proj = ReplicatedLinear(h, i, bias=False, kernels=kernels)
        self.down_proj = ReplicatedLinear(i, h, bias=False, kernels=kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, config, head_dim: int, kernels: KernelTable) -> None:
        super().__init__()
        self.self_attn = _Attention(config, head_dim, kernels)
        self.mlp = _MLP(config, kernels)
        self.input_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: PackedBatch
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderEmbeddingModel(nn.Module):
    """`forward(batch) -> hidden [T, H]` (after the final norm), for Llama, Qwen2 and Qwen3
    configs with plain rotary embeddings."""

    def __init__(self, config, kernels: KernelTable = TORCH_KERNELS) -> None:
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
            _Layer(config, head_dim, kernels) for _ in range(config.num_hidden_layers)
        )
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        params = getattr(config, "rope_parameters", None) or {}
        self.rope_theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[T, 1, D]` at `positions [T]` (float32, cast by the caller)."""
        d = self.head_dim
        inv_freq = 1.0 / self.rope_theta ** (
            torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) / d
        )
        angles = torch.outer(positions.to(torch.float32), inv_freq)[:, None]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)  # [T, H]
        cos, sin = (t.to(x.dtype) for t in self._rotary(batch.positions))
        for layer in self.layers:
            x = layer(x, cos, sin, batch)
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
