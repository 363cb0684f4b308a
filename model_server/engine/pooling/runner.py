"""Runs one pooling step: packs the batch's tokens, runs the model, pools (or scores)."""

from __future__ import annotations

import importlib
import logging
import time

import torch
from torch import nn

from model_server.config import KernelOptions
from model_server.engine.execution.kernel_tuning import linear_sites
from model_server.engine.execution.model_preparation import install_planned_weights
from model_server.engine.pooling.config import PoolerConfig, PoolingTask
from model_server.engine.pooling.pooler import finish_embedding, pool
from model_server.engine.pooling.request import PoolingOutput, PoolingRequest
from model_server.loader.source import ModelSource
from model_server.models.pooling_batch import PackedBatch
from model_server.platforms import Platform

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
    source: ModelSource,
    pooler: PoolerConfig,
    dtype: torch.dtype,
    platform: Platform,
    options: KernelOptions,
    max_num_batched_tokens: int,
) -> nn.Module:
    """The model for `pooler.architecture` with the source's weights, in eval mode, its linear
    layers planned by the platform as a decoder's are (CPU: a kernel per row bucket, timed or
    cached, packed weights; `max_num_batched_tokens`: the most rows a step multiplies)."""
    module_name, class_name = _POOLING_MODELS[pooler.architecture]
    cls = getattr(importlib.import_module(f"model_server.models.{module_name}"), class_name)
    kernels = platform.kernel_table(options)
    model = cls(source.hf_config, kernels=kernels)
    if pooler.task is PoolingTask.SCORE and source.hf_config.num_labels != 1:
        raise ValueError(
            f"cross-encoder with {source.hf_config.num_labels} labels: Wick scores with "
            "single-logit rerankers only"
        )
    if source.weights is None:
        raise ValueError("pooling models need real weights (--load-format dummy is generative)")
    start = time.perf_counter()
    model.load_weights(source.weights())
    model.to(device=platform.device, dtype=dtype).eval()
    sites = linear_sites(model, max_num_batched_tokens, max_num_batched_tokens)
    install_planned_weights(model, platform.plan_linears(kernels, sites, dtype, options))
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

    @torch.inference_mode()
    def execute(self, batch: list[PoolingRequest]) -> list[PoolingOutput]:
        packed = PackedBatch.build(
            [r.prompt_token_ids for r in batch], [r.token_type_ids for r in batch], self.device
        )
        if self.pooler.task is PoolingTask.SCORE:
            logits = self.model(packed)[:, 0].float().cpu().tolist()  # [B]
            return [
                PoolingOutput(r.request_id, r.num_tokens, score=s)
                for r, s in zip(batch, logits, strict=True)
            ]
        hidden = self.model(packed)  # [T, H]
        pooled = pool(hidden, packed, self.pooler.pooling_type)  # [B, H] float32
        finishes = [
            (self.pooler.normalize if r.params.normalize is None else r.params.normalize,
             r.params.dimensions)
            for r in batch
        ]  # fmt: skip
        if len(set(finishes)) == 1:  # the usual step: one call for all rows
            vectors = finish_embedding(pooled, *finishes[0]).tolist()
        else:
            vectors = [
                finish_embedding(vector, *finish).tolist()
                for vector, finish in zip(pooled, finishes, strict=True)
            ]
        return [
            PoolingOutput(r.request_id, r.num_tokens, embedding=vector)
            for r, vector in zip(batch, vectors, strict=True)
        ]
