"""Load a GGUF checkpoint into a built model with its matrices kept quantized (GGUFWeight).

The model's own `load_weights` still maps names (q/k/v -> qkv_proj, gate/up -> gate_up_proj,
tied heads) and checks that nothing is missing; only the matrices' destination changes. Before
it runs, `GGUFWeightCollector` swaps every linear layer's and embedding's float `weight` for a
placeholder on the meta device whose `weight_loader` records the parts it is handed (a
`GGUFTensor`, or a float tensor for matrices the file stores unquantized) with their shard id.
`finish()` then builds each layer's weight from its parts, this rank's share cut out with the
same arithmetic as the layer's float weight loader (layers/linear.py, layers/embedding.py):
  - all parts float: a float parameter in the model dtype, filled by the layer's own loader;
  - otherwise a GGUFWeight, its segments in the layer's output order (float parts become float
    segments).
The float parameters the model was built with were never written (torch.empty: untouched pages
cost no memory) and are dropped here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from model_server.layers.embedding import VocabParallelEmbedding
from model_server.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from model_server.layers.quantization.gguf import GGUFTensor, GGUFWeight

_Part = tuple[Any, "GGUFTensor | torch.Tensor"]  # (shard id or None, the checkpoint matrix)


@dataclass(slots=True)
class _Pending:
    modules: list[nn.Module]  # every module holding this weight (an embedding and a tied head)
    original: nn.Parameter  # the float parameter as built (shape, dtype, loader)
    parts: list[_Part] = field(default_factory=list)


class GGUFWeightCollector:
    """See the module docstring: `GGUFWeightCollector(model)`, then `model.load_weights(...)`
    with a stream holding GGUFTensors, then `finish()`."""

    def __init__(self, model: nn.Module) -> None:
        self._pending: dict[int, _Pending] = {}
        placeholders: dict[int, nn.Parameter] = {}
        for module in list(model.modules()):
            if not isinstance(module, LinearBase | VocabParallelEmbedding):
                continue
            weight = module.weight
            if not isinstance(weight, nn.Parameter):
                continue
            key = id(weight)
            if key not in self._pending:
                self._pending[key] = _Pending([], weight)
                placeholder = nn.Parameter(
                    torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                    requires_grad=False,
                )
                placeholder.weight_loader = self._collector(key)  # type: ignore[attr-defined]
                placeholders[key] = placeholder
            self._pending[key].modules.append(module)
            module.weight = placeholders[key]

    def _collector(self, key: int) -> Callable[..., None]:
        def collect(_param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
            self._pending[key].parts.append((shard_id, loaded))

        return collect

    def finish(self) -> dict[str, int]:
        """Install every layer's weight; returns how many matrices of each ggml type are kept
        quantized (for the startup log). Raises ValueError naming a tensor that cannot be
        placed (a shape mismatch, a split through blocks)."""
        counts: dict[str, int] = {}
        for pending in self._pending.values():
            if not pending.parts:
                continue  # load_weights reported it missing already (or will not run it)
            owner = pending.modules[0]
            if all(isinstance(t, torch.Tensor) for _, t in pending.parts):
                weight: nn.Parameter | GGUFWeight = _float_weight(pending)
            else:
                segments = _local_segments(owner, pending.parts)
                weight = GGUFWeight(segments, pending.original.dtype)
                for seg in segments:
                    counts[seg.type_name] = counts.get(seg.type_name, 0) + 1
            for module in pending.modules:
                del module.weight
                module.weight = weight
        self._pending.clear()
        return counts


def _float_weight(pending: _Pending) -> nn.Parameter:
    """The layer's float parameter, allocated and filled by its own weight loader."""
    original = pending.original
    param = nn.Parameter(torch.empty_like(original), requires_grad=False)
    loader = original.weight_loader  # type: ignore[attr-defined]
    param.weight_loader = loader  # type: ignore[attr-defined]
    for shard_id, tensor in pending.parts:
        if shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
    return param


def _as_gguf(tensor: GGUFTensor | torch.Tensor, name: str) -> GGUFTensor:
    if isinstance(tensor, GGUFTensor):
        return tensor
    if tensor.dim() != 2:
        raise ValueError(f"{name}: expected a matrix, got shape {tuple(tensor.shape)}")
    return GGUFTensor.from_float(name, tensor)


def _expect(part: GGUFTensor, shape: tuple[int, int]) -> None:
    if tuple(part.shape) != tuple(shape):
        raise ValueError(
            f"{part.name}: checkpoint tensor has shape {tuple(part.shape)}, expected {shape}"
        )


def _local_segments(module: nn.Module, parts: list[_Part]) -> list[GGUFTensor]:
    """This rank's rows (and columns) of each part, in the layer's output-row order."""
    placed: list[tuple[int, GGUFTensor]] = []  # (first output row here, segment)
    for shard_id, tensor in parts:
        part = _as_gguf(tensor, f"{type(module).__name__} weight")
        placed.append(_place(module, shard_id, part))
    placed.sort(key=lambda item: item[0])
    rows = 0
    for offset, seg in placed:
        if offset != rows:
            raise ValueError(f"{seg.name}: fused weight parts overlap or leave a gap")
        rows += seg.shape[0]
    return [seg for _, seg in placed]


def _place(module: nn.Module, shard_id: Any, part: GGUFTensor) -> tuple[int, GGUFTensor]:
    if isinstance(module, VocabParallelEmbedding):  # and ParallelLMHead
        _expect(part, (module.num_embeddings, module.embedding_dim))
        if module.tp_size == 1:
            return 0, part
        shard = module.shard
        return 0, part.rows(shard.start, shard.size).padded_rows(shard.padded_size)
    assert isinstance(module, LinearBase)
    k_local = module.input_size
    if isinstance(module, QKVParallelLinear):
        d = module.head_size
        q, kv = module.total_num_heads * d, module.total_num_kv_heads * d
        if shard_id is None:  # one fused matrix in the file: cut it like the layer's loader
            _expect(part, (q + 2 * kv, k_local))
            if module.tp_size == 1:
                return 0, part
            raise ValueError(f"{part.name}: a fused qkv matrix cannot be split across ranks")
        offset, size = module.shard_range(shard_id)
        total = q if shard_id == "q" else kv
        start = (module.shard.q_start if shard_id == "q" else module.shard.kv_start) * d
        _expect(part, (total, k_local))
        return offset, part.rows(start, size)
    if isinstance(module, MergedColumnParallelLinear):
        if shard_id is None:
            _expect(part, (sum(module.output_sizes), k_local))
            if module.tp_size == 1:
                return 0, part
            raise ValueError(f"{part.name}: a fused gate_up matrix cannot be split across ranks")
        size = module.local_sizes[shard_id]
        _expect(part, (module.output_sizes[shard_id], k_local))
        offset = sum(module.local_sizes[:shard_id])
        return offset, part.rows(module.tp_rank * size, size)
    if isinstance(module, RowParallelLinear):
        _expect(part, (module.output_size, module.total_input_size))
        if module.tp_size == 1:
            return 0, part
        return 0, part.columns(module.input_start, k_local)
    if isinstance(module, ColumnParallelLinear):
        local = module.output_size
        _expect(part, (local * module.tp_size, k_local))
        return 0, part.rows(module.tp_rank * local, local)
    _expect(part, (module.output_size, k_local))  # ReplicatedLinear and plain layers
    return 0, part
