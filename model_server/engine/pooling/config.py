"""What a pooling model is and how it pools, read from its folder.

A folder is a pooling model when its `architectures` name an encoder (`BertModel`,
`XLMRobertaModel`), a cross-encoder (`*ForSequenceClassification`), or when it carries
sentence-transformers' `modules.json` with a Pooling module (decoder embedding models such as
Qwen3-Embedding, whose config names the causal LM). The pooling mode and normalization come from
sentence-transformers' files (`modules.json`, `1_Pooling/config.json`,
`sentence_bert_config.json`); without them encoders pool the `[CLS]` row and decoders the last
token, both normalized, as vLLM and TEI do.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass
from typing import Any


class PoolingTask(str, enum.Enum):
    EMBED = "embed"  # one vector per input
    SCORE = "score"  # one relevance score per (query, document) pair: a cross-encoder


class PoolingType(str, enum.Enum):
    MEAN = "mean"
    CLS = "cls"
    LAST = "last"


ENCODER_ARCHITECTURES = {"BertModel": "bert", "XLMRobertaModel": "xlm-roberta"}
CROSS_ENCODER_ARCHITECTURES = {
    "BertForSequenceClassification": "bert",
    "XLMRobertaForSequenceClassification": "xlm-roberta",
}
DECODER_ARCHITECTURES = {
    "Qwen3ForCausalLM": "decoder",
    "Qwen3Model": "decoder",
    "Qwen2ForCausalLM": "decoder",
    "Qwen2Model": "decoder",
    "LlamaForCausalLM": "decoder",
    "LlamaModel": "decoder",
}


@dataclass(slots=True, frozen=True)
class PoolerConfig:
    task: PoolingTask
    architecture: str  # the HF name the model class is chosen by
    pooling_type: PoolingType
    normalize: bool  # the model's default; a request may ask otherwise (PoolingParams)
    max_length: int  # tokens per input, [CLS]/[SEP] included


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _st_modules(folder: str) -> list[dict[str, Any]] | None:
    path = os.path.join(folder, "modules.json")
    if not os.path.isfile(path):
        return None
    modules = _read_json(path)
    if not isinstance(modules, list):
        raise ValueError(f"{path}: expected a list of modules")
    return modules


def _pooling_from_st(folder: str, modules: list[dict[str, Any]]) -> tuple[PoolingType, bool]:
    pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        raise ValueError(f"{folder}/modules.json has no Pooling module")
    config = _read_json(os.path.join(folder, pooling.get("path", "1_Pooling"), "config.json"))
    modes = [
        (PoolingType.MEAN, config.get("pooling_mode_mean_tokens")),
        (PoolingType.CLS, config.get("pooling_mode_cls_token")),
        (PoolingType.LAST, config.get("pooling_mode_lasttoken")),
    ]
    chosen = [mode for mode, on in modes if on]
    refused = [
        k
        for k in ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                  "pooling_mode_weightedmean_tokens")
        if config.get(k)
    ]  # fmt: skip
    if refused or len(chosen) != 1:
        raise ValueError(
            f"{folder}: pooling modes {refused or [m.value for m in chosen]} are not supported "
            "(Wick pools one of: mean, cls, lasttoken)"
        )
    normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
    return chosen[0], normalize


def pooler_config(folder: str, hf_config: Any) -> PoolerConfig | None:
    """The folder's pooling setup, or None when it is a generative model."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    modules = _st_modules(folder)
    arch = next((a for a in architectures if a in CROSS_ENCODER_ARCHITECTURES), None)
    task = PoolingTask.SCORE
    if arch is None:
        task = PoolingTask.EMBED
        arch = next((a for a in architectures if a in ENCODER_ARCHITECTURES), None)
        if arch is None and modules is not None:
            arch = next((a for a in architectures if a in DECODER_ARCHITECTURES), None)
            if arch is None:
                raise ValueError(
                    f"{folder}: a sentence-transformers model of architecture "
                    f"{architectures} is not supported for embeddings (supported: "
                    f"{', '.join([*ENCODER_ARCHITECTURES, *DECODER_ARCHITECTURES])})"
                )
    if arch is None:
        return None
    is_decoder = arch in DECODER_ARCHITECTURES
    if task is PoolingTask.SCORE:
        pooling_type, normalize = PoolingType.CLS, False
    elif modules is not None:
        pooling_type, normalize = _pooling_from_st(folder, modules)
    else:
        pooling_type, normalize = (PoolingType.LAST if is_decoder else PoolingType.CLS), True
    max_length = int(hf_config.max_position_embeddings)
    if arch in ("XLMRobertaModel", "XLMRobertaForSequenceClassification"):
        max_length -= int(hf_config.pad_token_id) + 1  # positions start after padding_idx
    st_path = os.path.join(folder, "sentence_bert_config.json")
    if os.path.isfile(st_path):
        st_max = _read_json(st_path).get("max_seq_length")
        if st_max:
            max_length = min(max_length, int(st_max))
    return PoolerConfig(task, arch, pooling_type, normalize, max_length)
