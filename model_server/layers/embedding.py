"""Token embedding and LM head (vLLM names; whole vocabulary on one rank)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_server.layers.linear import default_weight_loader, dense


class VocabParallelEmbedding(nn.Module):
    """input_ids [T] -> [T, embedding_dim]."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection: hidden [N, d] -> logits [N, vocab], weight [vocab, d].

    `tie_weights(embedding)` shares the embedding's parameter (tie_word_embeddings): the head then
    owns no parameter of its own, so `named_parameters()` lists the matrix once.
    """

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return dense(hidden_states, self.weight)
