"""The attention backend interface: what every backend (torch, triton, ...) implements.

Batch layout (built by the model runner, read by backends):
  - The step's tokens are flattened into one sequence of T tokens: request i owns the query
    tokens `[query_start_loc[i], query_start_loc[i+1])`.
  - Requests are ordered decodes first: requests `[0, num_decodes)` have exactly one query token,
    requests `[num_decodes, B)` are prefills (a whole prompt, a chunk of one, or the tail after a
    prefix-cache hit); a prefill's earlier tokens are already in the paged cache.
  - `seq_lens[i]` counts request i's context after this step (cached + new tokens), so its query
    tokens sit at positions `[seq_lens[i] - query_len_i, seq_lens[i])` and attend causally to
    every earlier position.

KV cache layout: per layer one key and one value tensor, each
`[num_blocks, block_size, num_kv_heads, head_dim]`. Token at position p of request i lives in
slot `block_tables[i, p // block_size] * block_size + p % block_size`; `slot_mapping[t]` is that
slot for flat token t. Quantized caches (`--kv-cache-dtype int8|fp8_*`, kv_cache_dtype.py) hold
codes in that layout plus one float32 scale per slot and KV head, `k_scales` / `v_scales`
`[num_blocks, block_size, num_kv_heads]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    # [T] int64: the cache slot each new token's K/V is written to.
    slot_mapping: torch.Tensor
    # [B + 1] int32: cumulative query lengths (cu_seqlens_q), on the device.
    query_start_loc: torch.Tensor
    # [B] int32: context length of each request after this step, on the device.
    seq_lens: torch.Tensor
    # [B, max_num_blocks] int32: block ids per request, padded with 0, on the device.
    block_tables: torch.Tensor
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    # The same numbers as host lists, for backends that loop in Python (never synced from device).
    # In a captured decode graph (engine/execution/cuda_graph.py) seq_lens_cpu and max_seq_len
    # hold the bound max_model_len instead, since the real lengths change with every replay.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Models with sliding-window layers whose KV lives in its own block pool (a second KV cache
    # group, see engine/core/kv_cache_manager.py): that group's slot_mapping and block_tables,
    # the rest shared. None when every layer uses the fields above.
    sliding: AttentionMetadata | None = None

    def for_group(self, kv_group: int) -> AttentionMetadata:
        """The metadata of KV cache group `kv_group` (0: full attention, 1: sliding window)."""
        if kv_group == 0 or self.sliding is None:
            return self
        return self.sliding

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes


class AttentionBackend(ABC):
    """Computes paged attention for one layer.

    Contract of `forward`:
      - q: [T, num_heads, head_dim], k and v: [T, num_kv_heads, head_dim] for the step's tokens.
      - First writes k, v into `k_cache`, `v_cache` at `metadata.slot_mapping` (in place).
      - Returns [T, num_heads, head_dim]: softmax(q k^T * scale) v over each request's whole
        context (cached tokens + this step's, causal), with grouped-query heads (query head h uses
        KV head h // (num_heads // num_kv_heads)).
      - Must not synchronize the device or allocate per-request host memory on GPU backends.
      - With `sliding_window` W, query position p attends to key positions (p - W, p] only (HF's
        convention); block-table entries wholly before that window may be the KV manager's null
        block and must not influence the result. With `logits_soft_cap` c, scores (after
        scaling) become c * tanh(score / c) before the mask and softmax (Gemma 2).
      A backend that does not implement one of them says so through the class flags below and
      refuses such a layer at construction with one clear line.
      - With `k_scales` and `v_scales` ([num_blocks, block_size, num_kv_heads] float32) the
        caches are quantized (int8, float8_e4m3fn or float8_e5m2 codes, told by the caches'
        dtype): the store quantizes each token's head row with its own scale (or with
        `kv_fixed_scale`, the layer's static one, where given) and every read dequantizes,
        exactly as `kv_cache_dtype.quantize_kv` / `dequantize_kv`. Float caches
        may have a dtype other than q's: K/V are cast on store and read in q's dtype.
    """

    name: str = "abstract"
    # Whether a forward can be captured in a device graph and replayed for other inputs: it
    # reads only the metadata's device tensors, using its host values (`seq_lens_cpu`,
    # `max_seq_len`) as upper bounds at most, and skips slots < 0 (padding rows) when storing.
    supports_graphs: bool = False
    supports_sliding_window: bool = False
    supports_logits_soft_cap: bool = False

    def graph_context_bounds(
        self, num_seqs: int, max_model_len: int, device: torch.device
    ) -> list[int]:
        """Context-length bounds at which to capture decode graphs of `num_seqs` requests
        (engine/execution/cuda_graph.py): one per distinct choice the backend makes from the
        metadata's host bounds. Default: max_model_len alone."""
        return [max_model_len]

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        if sliding_window is not None and not self.supports_sliding_window:
            raise ValueError(
                f"the {self.name} attention backend does not implement sliding-window attention "
                "(this model needs it): choose --attention-backend torch or cpu"
            )
        if logits_soft_cap is not None and not self.supports_logits_soft_cap:
            raise ValueError(
                f"the {self.name} attention backend does not implement attention logit "
                "soft-capping (this model needs it): choose --attention-backend torch or cpu"
            )
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
        kv_fixed_scale: float | None = None,
    ) -> torch.Tensor: ...
