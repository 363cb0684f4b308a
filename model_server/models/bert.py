"""Bidirectional encoders for pooling: BERT and XLM-RoBERTa, as bare encoders (embeddings) and
with their sequence-classification heads (cross-encoders for scores).

They run on a padded batch, `input_ids [B, L]` with `attention_mask [B, L]` (1 = token, 0 =
padding), and keep no KV cache: an encoder's attention is bidirectional, so every request is
computed whole in one step and nothing of it is needed afterwards. Module names follow the HF
checkpoints' (`embeddings.word_embeddings`, `encoder.layer.N.attention.self.query`, ...), so the
state dict loads as it is; `load_weights` strips the `bert.` / `roberta.` prefix that the
`*ForSequenceClassification` checkpoints carry.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_PREFIXES = ("bert.", "roberta.", "model.")


class _Embeddings(nn.Module):
    def __init__(self, config, *, roberta: bool) -> None:
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(max(config.type_vocab_size, 1), h)
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        # RoBERTa numbers positions from padding_idx + 1, padding itself sits at padding_idx.
        self.position_offset = (config.pad_token_id + 1) if roberta else 0

    def forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        # Right padding: a row's tokens are 0..len-1; padded rows take the offset's row, unused.
        positions = (torch.cumsum(mask, dim=1) - 1).clamp(min=0) * mask + self.position_offset
        if self.token_type_embeddings.num_embeddings == 1:
            # XLM-RoBERTa has one segment: a pair's second text is not marked (its tokenizer
            # returns no token_type_ids; a BERT-style tokenizer's 1s must not index past it).
            token_type_ids = torch.zeros_like(token_type_ids)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(token_type_ids)
        )
        return self.LayerNorm(x)


@dataclass(slots=True)
class _Packing:
    """Where a step's real tokens sit in its padded `[B, L]` grid. The layers run on the packed
    `[T, H]` rows (T real tokens: the padding costs no matmul); attention alone scatters q, k, v
    back into `[B, heads, L, D]` for SDPA. `rows`: the real tokens' flat indices into `B * L`,
    None when nothing is padded (T = B * L). `bias`: SDPA's additive key-padding mask
    `[B, 1, 1, L]`, None without padding."""

    batch: int
    length: int
    rows: torch.Tensor | None
    bias: torch.Tensor | None

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, N]` -> `[B, L, N]`, zeros at the padding."""
        if self.rows is None:
            return x.view(self.batch, self.length, -1)
        out = x.new_zeros(self.batch * self.length, x.shape[-1])
        out[self.rows] = x
        return out.view(self.batch, self.length, -1)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, L, N]` -> `[T, N]`."""
        flat = x.reshape(self.batch * self.length, -1)
        return flat if self.rows is None else flat[self.rows]


class _SelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, packing: _Packing) -> torch.Tensor:
        h = x.shape[-1]
        heads = self.num_heads

        def split(t: torch.Tensor) -> torch.Tensor:  # [T, H] -> [B, heads, L, H / heads]
            return packing.pad(t).view(packing.batch, packing.length, heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            split(self.query(x)), split(self.key(x)), split(self.value(x)), attn_mask=packing.bias
        )
        return packing.pack(out.transpose(1, 2).reshape(packing.batch, packing.length, h))


class _DenseNorm(nn.Module):
    """`LayerNorm(dense(x) + residual)`: the attention output and the FFN output blocks."""

    def __init__(self, in_features: int, config) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self = _SelfAttention(config)
        self.output = _DenseNorm(config.hidden_size, config)

    def forward(self, x: torch.Tensor, packing: _Packing) -> torch.Tensor:
        return self.output(self.self(x, packing), x)


class _Intermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        if config.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"):
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for an encoder")
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = config.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dense(x)
        if self.act == "relu":
            return F.relu(x)
        return F.gelu(x, approximate="none" if self.act == "gelu" else "tanh")


class _Layer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.attention = _Attention(config)
        self.intermediate = _Intermediate(config)
        self.output = _DenseNorm(config.intermediate_size, config)

    def forward(self, x: torch.Tensor, packing: _Packing) -> torch.Tensor:
        x = self.attention(x, packing)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, packing: _Packing) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, packing)
        return x


class BertModel(nn.Module):
    """The encoder: `forward(input_ids [B, L], attention_mask [B, L]) -> hidden [B, L, H]`."""

    roberta = False

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config, roberta=self.roberta)
        self.encoder = _Encoder(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, attention_mask, token_type_ids)  # [B, L, H]
        b, length = input_ids.shape
        if bool(attention_mask.all()):
            packing = _Packing(b, length, None, None)  # SDPA's unmasked (fastest) path
        else:
            # Padded keys get a -inf-like bias; padded query rows (zeros) still see the real
            # keys, so no row is all masked (no NaN), and nobody reads them.
            bias = torch.zeros(attention_mask.shape, dtype=x.dtype, device=x.device)
            bias.masked_fill_(attention_mask == 0, torch.finfo(x.dtype).min)
            rows = attention_mask.reshape(-1).nonzero().squeeze(1)
            packing = _Packing(b, length, rows, bias[:, None, None, :])
        return packing.pad(self.encoder(packing.pack(x), packing))

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
            param = params.get(name)
            if param is None:
                continue  # the MLM / pooler heads and position_ids buffers are not used
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


class XLMRobertaModel(BertModel):
    roberta = True


class BertForSequenceClassification(BertModel):
    """BERT cross-encoder: the `[CLS]` row through the pooler (dense + tanh), then the
    classifier. `forward` returns logits `[B, num_labels]`."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        hidden = super().forward(input_ids, attention_mask, token_type_ids)
        return self.classifier(torch.tanh(self.pooler.dense(hidden[:, 0])))


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """XLM-RoBERTa cross-encoder (bge-reranker): the `<s>` row through `classifier.dense` + tanh
    and `classifier.out_proj`."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.classifier = nn.Module()
        self.classifier.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        hidden = super().forward(input_ids, attention_mask, token_type_ids)
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(hidden[:, 0])))
