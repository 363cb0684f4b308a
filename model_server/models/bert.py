"""Bidirectional encoders for pooling: BERT and XLM-RoBERTa, as bare encoders (embeddings) and
with their sequence-classification heads (cross-encoders for scores).

They run on a packed batch (`PackedBatch`: the step's T tokens one sequence after another, no
padding), keep no KV cache (an encoder's attention is bidirectional, so every request is
computed whole in one step and nothing of it is needed afterwards) and return hidden states
[T, H]. Every linear layer multiplies the T real tokens; attention runs per sequence over its own
tokens (the kernel table's `varlen_attention`: native on the CPU, Triton on CUDA). The linear
layers are Wick's (`ReplicatedLinear`), so the platform plans their kernels as a decoder's
(`build_pooling_model`). Query, key and value are one fused [3H, H] projection. Module names
otherwise follow the HF checkpoints' (`embeddings.word_embeddings`, `encoder.layer.N.output.
dense`, ...), so the state dict loads as it is; `load_weights` strips the `bert.` / `roberta.`
prefix that the `*ForSequenceClassification` checkpoints carry and stacks query/key/value.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.linear import ReplicatedLinear
from model_server.models.pooling_batch import PackedBatch

_PREFIXES = ("bert.", "roberta.", "model.")
# The checkpoint's attention projections, in their order in the fused `qkv` weight.
_QKV = ("query", "key", "value")


class _Embeddings(nn.Module):
    def __init__(self, config, *, roberta: bool) -> None:
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(max(config.type_vocab_size, 1), h)
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        # RoBERTa numbers positions from padding_idx + 1 (padding itself sits at padding_idx).
        self.position_offset = (config.pad_token_id + 1) if roberta else 0

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        # A new [T, H] sum: the segment embedding is added in place (see _Intermediate).
        x = self.word_embeddings(batch.input_ids) + self.position_embeddings(
            batch.positions + self.position_offset
        )
        if self.token_type_embeddings.num_embeddings == 1:
            # XLM-RoBERTa has one segment: a pair's second text is not marked (its tokenizer
            # returns no token_type_ids; a BERT-style tokenizer's 1s must not index past it).
            x += self.token_type_embeddings.weight[0]
        else:
            x += self.token_type_embeddings(batch.token_type_ids)
        return self.LayerNorm(x)  # [T, H]


class _SelfAttention(nn.Module):
    def __init__(self, config, kernels: KernelTable) -> None:
        super().__init__()
        h = config.hidden_size
        self.hidden_size = h
        self.num_heads = config.num_attention_heads
        self.scale = (h // self.num_heads) ** -0.5
        self.kernels = kernels
        self.qkv = ReplicatedLinear(h, 3 * h, bias=True, kernels=kernels)

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        h = self.hidden_size
        qkv = self.qkv(x)  # [T, 3H]: q, k, v read in place (row stride 3H)
        q, k, v = qkv[:, :h], qkv[:, h : 2 * h], qkv[:, 2 * h :]
        heads = self.num_heads
        return self.kernels.varlen_attention(
            q, k, v, batch.cu_seqlens, heads, heads, self.scale, False
        )


class _DenseNorm(nn.Module):
    """`LayerNorm(dense(x) + residual)`: the attention output and the FFN output blocks (BERT's
    post-norm). The residual is added in place into the linear's new output (the same bf16
    rounding as `+`; see _Intermediate for why), never into `residual`, which the caller
    still holds."""

    def __init__(self, in_features: int, config, kernels: KernelTable) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(in_features, config.hidden_size, bias=True, kernels=kernels)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x).add_(residual))


class _Attention(nn.Module):
    def __init__(self, config, kernels: KernelTable) -> None:
        super().__init__()
        self.self = _SelfAttention(config, kernels)
        self.output = _DenseNorm(config.hidden_size, config, kernels)

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        return self.output(self.self(x, batch), x)


class _Intermediate(nn.Module):
    def __init__(self, config, kernels: KernelTable) -> None:
        super().__init__()
        if config.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"):
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for an encoder")
        self.dense = ReplicatedLinear(
            config.hidden_size, config.intermediate_size, bias=True, kernels=kernels
        )
        # GELU's form ("none": BERT's erf one); None: ReLU.
        self.approximate = {"relu": None, "gelu": "none"}.get(config.hidden_act, "tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The linear's output [T, I] (bias added) is a new tensor that nothing else holds, so
        # the activation overwrites it: PyTorch's bits, without a second [T, I] tensor. A new
        # multi-MB tensor per op is fresh pages (page faults) under glibc's default malloc: on
        # MiniLM bf16, batch 32, one thread (busy 2-core box), the in-place GELU and residual
        # adds made the step 7-13% faster in thread CPU time (same process, A/B alternated).
        # PyTorch's GELU, not the table's `gelu`: on a [2600, 1536] bf16 batch aten's vectorized
        # erf GELU took 0.8-0.9 ms, layer_ops.c's 3.4 ms.
        x = self.dense(x)
        if self.approximate is None:
            return F.relu(x, inplace=True)
        return torch.ops.aten.gelu_(x, approximate=self.approximate)


class _Layer(nn.Module):
    def __init__(self, config, kernels: KernelTable) -> None:
        super().__init__()
        self.attention = _Attention(config, kernels)
        self.intermediate = _Intermediate(config, kernels)
        self.output = _DenseNorm(config.intermediate_size, config, kernels)

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        x = self.attention(x, batch)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, config, kernels: KernelTable) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(config, kernels) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, batch)
        return x


class BertModel(nn.Module):
    """The encoder: `forward(batch) -> hidden [T, H]`, the packed tokens' last hidden states."""

    roberta = False

    def __init__(self, config, kernels: KernelTable = TORCH_KERNELS) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config, roberta=self.roberta)
        self.encoder = _Encoder(config, kernels)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        return self.encoder(self.embeddings(batch), batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            for prefix in _PREFIXES:
                if name.startswith(prefix):
                    name = name[len(prefix) :]
                    break
            name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
                "LayerNorm.beta", "LayerNorm.bias"
            )
            param, part = _fused_part(params, name)
            if param is None:
                continue  # the MLM / pooler heads and position_ids buffers are not used
            if part.shape != tensor.shape:
                raise ValueError(
                    f"weight {name}: checkpoint shape {tuple(tensor.shape)}, model "
                    f"{tuple(part.shape)}"
                )
            with torch.no_grad():
                part.copy_(tensor)
            loaded.add(name)
        expected = set()
        for pname in params:
            fused = pname.rsplit(".", 2)
            if len(fused) == 3 and fused[1] == "qkv":  # the checkpoint's three tensors
                expected.update(f"{fused[0]}.{proj}.{fused[2]}" for proj in _QKV)
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}")


def _fused_part(
    params: dict[str, nn.Parameter], name: str
) -> tuple[nn.Parameter | None, torch.Tensor]:
    """The parameter a checkpoint tensor loads into and the part of it that it fills: the
    whole parameter, or for `...self.query/key/value.weight/bias` its rows of the fused `qkv`."""
    prefix, _, leaf = name.rpartition(".")
    owner, _, proj = prefix.rpartition(".")
    if proj in _QKV:
        fused = params.get(f"{owner}.qkv.{leaf}")
        if fused is not None:
            rows = fused.shape[0] // len(_QKV)
            i = _QKV.index(proj)
            return fused, fused.data[i * rows : (i + 1) * rows]
    param = params.get(name)
    return param, param.data if param is not None else torch.empty(0)


class XLMRobertaModel(BertModel):
    roberta = True


class BertForSequenceClassification(BertModel):
    """BERT cross-encoder: each sequence's `[CLS]` row through the pooler (dense + tanh), then
    the classifier. `forward` returns logits `[B, num_labels]`."""

    def __init__(self, config, kernels: KernelTable = TORCH_KERNELS) -> None:
        super().__init__(config, kernels)
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        hidden = super().forward(batch)[batch.first_rows()]  # [B, H]
        return self.classifier(torch.tanh(self.pooler.dense(hidden)))


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """XLM-RoBERTa cross-encoder (bge-reranker): the `<s>` row through `classifier.dense` + tanh
    and `classifier.out_proj`."""

    def __init__(self, config, kernels: KernelTable = TORCH_KERNELS) -> None:
        super().__init__(config, kernels)
        self.classifier = nn.Module()
        self.classifier.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        hidden = super().forward(batch)[batch.first_rows()]  # [B, H]
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(hidden)))
