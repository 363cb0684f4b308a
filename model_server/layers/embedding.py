"""Token embedding and LM head, vocabulary-parallel under tensor parallelism (vLLM names).

Rank r holds vocabulary rows [start, start + size) (see `partition.shard_vocab`), padded to the
same row count on every rank. The embedding looks up the ids it owns, zeroes the others and
all-reduces; the head computes its slice of the logits and gathers them on rank 0. With one rank
the whole vocabulary is local and no collective runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_server.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
)
from model_server.distributed.partition import shard_vocab
from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.linear import default_weight_loader, dense
from model_server.layers.quantization import QuantizedWeight


class VocabParallelEmbedding(nn.Module):
    """input_ids [T] -> [T, embedding_dim]; weight [padded rows of this rank, embedding_dim]."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, kernels: KernelTable = TORCH_KERNELS
    ) -> None:
        super().__init__()
        # the LM head's matmul (float lookups need none; a quantized table decodes its rows)
        self.kernels = kernels
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_size = get_tensor_model_parallel_world_size()
        self.shard = shard_vocab(num_embeddings, self.tp_size, get_tensor_model_parallel_rank())
        self.weight = nn.Parameter(
            torch.empty(self.shard.padded_size, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if self.tp_size == 1:
            default_weight_loader(param, loaded_weight)
            return
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(
                f"embedding: checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                f"expected {expected}"
            )
        start, size = self.shard.start, self.shard.size
        param.data[:size].copy_(loaded_weight.narrow(0, start, size))
        param.data[size:].zero_()

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantizedWeight):  # a GGUF table kept quantized
            return self.weight.lookup(ids, self.kernels)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        start, size = self.shard.start, self.shard.size
        local = input_ids - start
        owned = (local >= 0) & (local < size)  # [T]
        out = self._lookup(local.masked_fill(~owned, 0))  # [T, d]
        out.masked_fill_(~owned.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        tp = f", rows {self.shard.start}+{self.shard.size}" if self.tp_size > 1 else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{tp}"


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection: hidden [N, d] -> logits [N, vocab], weight [vocab, d].

    `tie_weights(embedding)` shares the embedding's parameter (tie_word_embeddings): the head then
    owns no parameter of its own, so `named_parameters()` lists the matrix once. Both split the
    vocabulary the same way, so a tied shard serves both.
    """

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        """Logits [N, vocab] on rank 0; None on the other ranks."""
        logits = dense(
            hidden_states, self.weight, kernels=self.kernels
        )  # [N, padded rows of this rank]
        if self.tp_size == 1:
            return logits
        gathered = tensor_model_parallel_gather(logits)  # [N, tp * padded] on rank 0
        return None if gathered is None else gathered[:, : self.num_embeddings]
