"""What is a pooling model, and how it pools, from its folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import BertConfig, LlamaConfig

from model_server.engine.pooling.config import PoolingTask, PoolingType, pooler_config
from tests.engine.pooling.conftest import minilm_path, write_sentence_transformers_files


def test_minilm_reads_mean_normalized_and_max_seq_length() -> None:
    from model_server.loader.hf_loader import read_hf_config

    config = pooler_config(minilm_path(), read_hf_config(minilm_path()))
    assert config is not None
    assert (config.task, config.pooling_type, config.normalize, config.max_length) == (
        PoolingTask.EMBED, PoolingType.MEAN, True, 256,
    )  # fmt: skip


def test_generative_models_are_not_pooling(tmp_path: Path) -> None:
    assert pooler_config(str(tmp_path), LlamaConfig(architectures=["LlamaForCausalLM"])) is None


def test_a_decoder_with_sentence_transformers_files_embeds(tmp_path: Path) -> None:
    write_sentence_transformers_files(tmp_path, "lasttoken", normalize=False)
    config = pooler_config(str(tmp_path), LlamaConfig(architectures=["LlamaForCausalLM"]))
    assert config is not None
    assert (config.pooling_type, config.normalize) == (PoolingType.LAST, False)


def test_cls_pooling_and_cross_encoders(tmp_path: Path) -> None:
    write_sentence_transformers_files(tmp_path, "cls_token")
    bert = pooler_config(str(tmp_path), BertConfig(architectures=["BertModel"]))
    assert bert is not None and bert.pooling_type is PoolingType.CLS
    cross = pooler_config(
        str(tmp_path), BertConfig(architectures=["BertForSequenceClassification"])
    )
    assert cross is not None and cross.task is PoolingTask.SCORE


def test_unsupported_pooling_modes_are_refused(tmp_path: Path) -> None:
    write_sentence_transformers_files(tmp_path, "max_tokens")
    with pytest.raises(ValueError, match="max_tokens"):
        pooler_config(str(tmp_path), BertConfig(architectures=["BertModel"]))
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True})
    )
    with pytest.raises(ValueError, match="not supported"):
        pooler_config(str(tmp_path), BertConfig(architectures=["BertModel"]))
