"""Runs one pooling step: pads the batch, runs the encoder, pools (or scores)."""

from __future__ import annotations

import importlib
import logging
import time

import torch
from torch import nn

from model_server.engine.pooling.config import PoolerConfig, PoolingTask
from model_server.engine.pooling.pooler import finish_embedding, pool
from model_server.engine.pooling.request import PoolingOutput, PoolingRequest
from model_server.loader.source import ModelSource

logger = logging.getLogger(__name__)

# HF architecture -> (module under model_server.models, class); imported on first use.
_POOLING_MODELS: dict[str, tuple[str, str]] = {
    "BertModel": ("bert", "BertModel"),
    "XLMRobertaModel": ("bert", "XLMRobertaModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "XLMRobertaForSequenceClassification": ("bert", "XLMRobertaForSequenceClassification"),
    "Qwen3ForCausalLM": ("decoder_embedding", "DecoderEmbeddingModel"),
    "Qwen3Model": ("decoder_embedding", "DecoderEmbeddingModel"),
    "Qwen2ForCausalLM": ("decoder_embedding", "DecoderEmbeddingModel"),
    "Qwen2Model": ("decoder_embedding", "DecoderEmbeddingModel"),
    "LlamaForCausalLM": ("decoder_embedding", "DecoderEmbeddingModel"),
    "LlamaModel": ("decoder_embedding", "DecoderEmbeddingModel"),
}


def build_pooling_model(
    source: ModelSource, pooler: PoolerConfig, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """The model for `pooler.architecture` with the source's weights, in eval mode."""
    module_name, class_name = _POOLING_MODELS[pooler.architecture]
    cls = getattr(importlib.import_module(f"model_server.models.{module_name}"), class_name)
    model = cls(source.hf_config)
    if pooler.task is PoolingTask.SCORE and source.hf_config.num_labels != 1:
        raise ValueError(
            f"cross-encoder with {source.hf_config.num_labels} labels: Wick scores with "
            "single-logit rerankers only"
        )
    if source.weights is None:
        raise ValueError("pooling models need real weights (--load-format dummy is generative)")
    start = time.perf_counter()
    model.load_weights(source.weights())
    model.to(device=device, dtype=dtype).eval()
    logger.info(
        "%s (%s, %s pooling%s) loaded in %.2fs",
        pooler.architecture,
        pooler.task.value,
        pooler.pooling_type.value,
        ", normalized" if pooler.normalize else "",
        time.perf_counter() - start,
    )
    return model


class PoolingRunner:
    def __init__(self, model: nn.Module, pooler: PoolerConfig, device: torch.device) -> None:
        self.model = model
        self.pooler = pooler
        self.device = device

    def _inputs(
        self, batch: list[PoolingRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded `input_ids`, `attention_mask`, `token_type_ids`, each `[B, longest]`."""
        longest = max(r.num_tokens for r in batch)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        types = torch.zeros_like(ids)
        for i, r in enumerate(batch):
            n = r.num_tokens
            ids[i, :n] = torch.tensor(r.prompt_token_ids)
            mask[i, :n] = 1
            if r.token_type_ids is not None:
                types[i, :n] = torch.tensor(r.token_type_ids)
        return ids.to(self.device), mask.to(self.device), types.to(self.device)

    @torch.inference_mode()
    def execute(self, batch: list[PoolingRequest]) -> list[PoolingOutput]:
        ids, mask, types = self._inputs(batch)
        if self.pooler.task is PoolingTask.SCORE:
            logits = self.model(ids, mask, types)[:, 0].float().cpu().tolist()  # [B]
            return [
                PoolingOutput(r.request_id, r.num_tokens, score=s)
                for r, s in zip(batch, logits, strict=True)
            ]
        hidden = self.model(ids, mask, types)  # [B, L, H]
        pooled = pool(hidden, mask, self.pooler.pooling_type)  # [B, H] float32
        outputs = []
        for r, vector in zip(batch, pooled, strict=True):
            normalize = self.pooler.normalize if r.params.normalize is None else r.params.normalize
            vector = finish_embedding(vector, normalize, r.params.dimensions)
            outputs.append(PoolingOutput(r.request_id, r.num_tokens, embedding=vector.tolist()))
        return outputs
