"""Builders for paged-attention test batches (random block tables, caches and real metadata) and
tiny whole-model LLMs, with the kernels of the platform or of the test's choosing."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from model_server.engine.execution.input_batch import SeqChunk, build_model_inputs
from model_server.engine.llm import LLM
from model_server.kernels.cpu import linear_tuning
from model_server.kernels.table import KernelTable
from model_server.layers.attention.backend import AttentionMetadata
from model_server.platforms.cpu import CpuPlatform
from model_server.platforms.cuda import CudaPlatform


@dataclass
class PagedBatch:
    metadata: AttentionMetadata
    block_tables: list[list[int]]  # per request (batch order), host copy
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D] this step's new keys
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], cached prefixes filled in
    v_cache: torch.Tensor


def make_batch(
    requests: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    fill: float | None = None,
    seed: int = 0,
) -> PagedBatch:
    """`requests`: (num_cached, num_new) per request, in the caller's order.

    Blocks are drawn at random from a pool with spare blocks, so tables are non-contiguous.
    Cached positions get random K/V; every other cache entry is `fill` (NaN catches reads of
    masked slots) or random when `fill` is None. New tokens' K/V are NOT stored.
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + n) // block_size) for c, n in requests]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, tables = [], []
    for (cached, new), nb in zip(requests, needed, strict=True):
        table, perm = perm[:nb], perm[nb:]
        tables.append(table)
        chunks.append(SeqChunk(token_ids=[0] * new, num_computed_tokens=cached, block_ids=table))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if fill is None:
        k_cache = torch.randn(shape, generator=gen).to(dtype)
        v_cache = torch.randn(shape, generator=gen).to(dtype)
    else:
        k_cache = torch.full(shape, fill, dtype=dtype)
        v_cache = torch.full(shape, fill, dtype=dtype)
    cached_slots = [
        table[p // block_size] * block_size + p % block_size
        for (cached, _), table in zip(requests, tables, strict=True)
        for p in range(cached)
    ]
    if cached_slots:
        idx = torch.tensor(cached_slots)
        kv_shape = (len(cached_slots), num_kv_heads, head_dim)
        k_cache.view(-1, num_kv_heads, head_dim)[idx] = torch.randn(kv_shape, generator=gen).to(
            dtype
        )
        v_cache.view(-1, num_kv_heads, head_dim)[idx] = torch.randn(kv_shape, generator=gen).to(
            dtype
        )
    inputs = build_model_inputs(chunks, block_size, device)
    num_tokens = sum(n for _, n in requests)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        metadata=inputs.attn_metadata,
        block_tables=[tables[i] for i in inputs.order],
        q=q.to(device),
        k=k.to(device),
        v=v.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
    )


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32:
        return {"atol": 2e-5, "rtol": 2e-5}
    if dtype == torch.float16:
        return {"atol": 2e-3, "rtol": 2e-3}
    return {"atol": 2e-2, "rtol": 2e-2}


# Tiny random configs of real architectures for whole-model runs on the Triton backend.
TINY_CONFIGS = {
    "llama-gqa": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "vocab_size": 256,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
}

# Prompts of mixed lengths (5, 19 and 11 tokens) for TINY_CONFIGS' 256-token vocabulary.
MIXED_PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((5, 19, 11))]


def tiny_llm(folder: Path, name: str, **overrides) -> LLM:
    """An fp32 LLM with dummy weights for TINY_CONFIGS[name] (config written into `folder`):
    Triton attention, 8-token blocks and a 24-token step budget, so prompts prefill in chunks.
    On the GPU when there is one."""
    (folder / "config.json").write_text(json.dumps(TINY_CONFIGS[name]))
    options = dict(
        load_format="dummy",
        dtype="float32",
        device="cuda" if torch.cuda.is_available() else "cpu",
        attention_backend="triton",
        block_size=8,
        kv_cache_memory=2 * 1024**2,
        max_num_batched_tokens=24,
        seed=3,
    )
    options.update(overrides)
    return LLM(str(folder), **options)


# The platforms' own tables, whatever a test patched in since.
_PLATFORM_TABLES = {cls: cls.kernel_table for cls in (CpuPlatform, CudaPlatform)}


def use_kernels(
    monkeypatch: pytest.MonkeyPatch, edit: Callable[[KernelTable], KernelTable]
) -> None:
    """Engines started from now on (cpu or cuda, for this test) build their model with
    `edit(the platform's own table)`: how a test runs a whole LLM on other kernels. Models built
    before keep theirs."""
    for cls, own in _PLATFORM_TABLES.items():
        monkeypatch.setattr(
            cls, "kernel_table", lambda self, options=None, own=own: edit(own(self, options))
        )


def force(monkeypatch: pytest.MonkeyPatch, winner: str) -> list[int]:
    """Replace the timer: every candidate runs once (so a failing one is still dropped) and
    `winner` times fastest wherever it is offered. Returns a list counting the timed pairs."""
    counter: list[int] = []

    def fake(calls, pair_budget_s=0.0):
        counter.append(1)
        times = {}
        for name, call in calls.items():
            try:
                call()
            except Exception:
                continue
            times[name] = 1.0 if name == winner else 2.0
        return times

    monkeypatch.setattr(linear_tuning, "time_candidates", fake)
    return counter


def force_prefetch_split(monkeypatch: pytest.MonkeyPatch, hwpf_rows: int) -> list[int]:
    """Replace the timer: the panels win every float bucket (every candidate runs once, so a
    failing one is still dropped), without software prefetch (PANELS_HWPF) up to `hwpf_rows`
    rows, with it beyond. Returns the row count of every timed bucket."""
    rows_seen: list[int] = []

    def fake(calls, pair_budget_s=0.0):
        rows = next(iter(calls.values())).x.shape[0]  # float candidates: _Rotating calls
        rows_seen.append(rows)
        hwpf_first = rows <= hwpf_rows
        times = {}
        for name, call in calls.items():
            try:
                call()
            except Exception:
                continue
            if name == linear_tuning.PANELS_HWPF:
                times[name] = 1.0 if hwpf_first else 1.5
            elif name == linear_tuning.PANELS:
                times[name] = 1.5 if hwpf_first else 1.0
            else:
                times[name] = 3.0
        return times

    monkeypatch.setattr(linear_tuning, "time_candidates", fake)
    return rows_seen


class Planned:
    """The plans one `tune_cpu_linears` call makes, installed as planned weights and called as
    the old stateful tables were: `planned(x, weight, bias)` runs `weight`'s planned weight
    (found by the site's tensor), and a weight without a plan runs the fixed table's slot."""

    def __init__(self, sites, dtype: torch.dtype, cache, **options) -> None:
        import dataclasses

        from model_server.kernels.cpu.linear_plan import planned_weights
        from model_server.kernels.cpu.linear_tuning import tune_cpu_linears
        from model_server.platforms import get_platform

        named = [
            dataclasses.replace(s, module=s.module or f"site{i}", name=s.name or f"site{i}")
            for i, s in enumerate(sites)
        ]
        self.table = get_platform("cpu").kernel_table()
        self.report, self.plans = tune_cpu_linears(named, dtype, cache, **options)
        self.weights = planned_weights(self.plans, self.table, dtype)
        self._by_tensor = {id(s.weight): self.weights.get(s.module) for s in named}

    def weight_of(self, weight: torch.Tensor):
        return self._by_tensor.get(id(weight))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
        planned = self.weight_of(weight)
        if planned is None:
            return self.table.linear(x, weight, bias)
        return planned.apply(x, bias)
