"""Tiny random encoders and cross-encoders against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_server.config import EngineConfig
from model_server.engine.pooling.config import PoolingTask
from model_server.engine.pooling.engine import PoolingEngine
from model_server.engine.pooling.params import PoolingParams
from model_server.engine.pooling.request import PoolingRequest
from tests.engine.pooling.conftest import mixed_sentences

SENTENCES = mixed_sentences(12, seed=3)


def _engine(folder: Path, **kw) -> PoolingEngine:
    return PoolingEngine(EngineConfig(model=str(folder), dtype="float32", **kw))


def test_tiny_bert_cls_pooling_matches_transformers(tiny_bert: Path) -> None:
    from transformers import AutoModel

    engine = _engine(tiny_bert)
    # No sentence-transformers files: the encoder default, [CLS] normalized.
    assert engine.pooler.pooling_type.value == "cls" and engine.pooler.normalize
    tok = engine.tokenizer
    batch = tok(SENTENCES, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        hidden = AutoModel.from_pretrained(tiny_bert).eval()(**batch).last_hidden_state
    expected = torch.nn.functional.normalize(hidden[:, 0], dim=-1)
    requests = [
        PoolingRequest(f"r{i}", [t for t, m in zip(ids, mask, strict=True) if m], PoolingParams())
        for i, (ids, mask) in enumerate(
            zip(batch.input_ids.tolist(), batch.attention_mask.tolist(), strict=True)
        )
    ]
    got = torch.tensor([o.embedding for o in engine.encode(requests)])
    assert torch.allclose(got, expected, atol=1e-5)
    # Matryoshka: the first 16 dims, normalized again; and normalize=False gives the raw row.
    short = engine.encode([PoolingRequest("d", requests[0].prompt_token_ids,
                                          PoolingParams(dimensions=16))])[0].embedding  # fmt: skip
    raw = engine.encode([PoolingRequest("n", requests[0].prompt_token_ids,
                                        PoolingParams(normalize=False))])[0].embedding  # fmt: skip
    assert torch.allclose(
        torch.tensor(short), torch.nn.functional.normalize(hidden[0, 0, :16], dim=-1), atol=1e-5
    )
    assert torch.allclose(torch.tensor(raw), hidden[0, 0], atol=1e-4)
    # The same three in one step: each request keeps its own options.
    ids = requests[0].prompt_token_ids
    mixed = engine.encode([
        PoolingRequest("m1", ids, PoolingParams(dimensions=16)),
        PoolingRequest("m2", ids, PoolingParams(normalize=False)),
        PoolingRequest("m3", ids, PoolingParams()),
    ])  # fmt: skip
    assert [len(o.embedding) for o in mixed] == [16, 64, 64]
    assert torch.allclose(torch.tensor(mixed[0].embedding), torch.tensor(short), atol=1e-6)
    assert torch.allclose(torch.tensor(mixed[1].embedding), torch.tensor(raw), atol=1e-6)
    assert torch.allclose(torch.tensor(mixed[2].embedding), expected[0], atol=1e-5)


def _pair_requests(engine: PoolingEngine, query: str, docs: list[str]):
    batch = engine.tokenizer(
        [query] * len(docs), docs, padding=True, truncation=True, max_length=96, return_tensors="pt"
    )
    requests = []
    for i in range(len(docs)):
        n = int(batch.attention_mask[i].sum())
        types = batch.get("token_type_ids")
        requests.append(
            PoolingRequest(
                f"p{i}",
                batch.input_ids[i, :n].tolist(),
                PoolingParams(task=PoolingTask.SCORE),
                types[i, :n].tolist() if types is not None else None,
            )
        )
    return batch, requests


def test_cross_encoders_match_transformers(tiny_cross_encoder: Path, tiny_xlmr_cross_encoder):
    from transformers import AutoModelForSequenceClassification

    for folder in (tiny_cross_encoder, tiny_xlmr_cross_encoder):
        engine = _engine(folder)
        assert engine.pooler.task is PoolingTask.SCORE
        batch, requests = _pair_requests(engine, SENTENCES[0], SENTENCES[1:])
        if folder == tiny_xlmr_cross_encoder:
            del batch["token_type_ids"]  # one segment (XLM-R's own tokenizer returns none)
        reference = AutoModelForSequenceClassification.from_pretrained(folder).eval()
        with torch.no_grad():
            expected = reference(**batch).logits[:, 0]
        got = torch.tensor([o.score for o in engine.encode(requests)])
        assert torch.allclose(got, expected, atol=1e-5), (got, expected)
        assert got.std() > 0  # the pairs really differ


def test_a_request_for_the_other_task_is_refused(tiny_cross_encoder: Path) -> None:
    engine = _engine(tiny_cross_encoder)
    try:
        engine.add_request(PoolingRequest("e", [101, 102], PoolingParams()))
    except ValueError as exc:
        assert "serves score requests, not embed" in str(exc)
    else:
        raise AssertionError("an embed request to a cross-encoder was accepted")


@pytest.mark.parametrize("fixture", ["tiny_qwen3_embedding", "tiny_gte_qwen2"])
def test_decoder_embedding_last_token_matches_transformers(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    """Qwen3-Embedding's shape (q/k norms) and gte-Qwen2's (Qwen2Model, biased q/k/v), GQA."""
    from transformers import AutoModel

    folder = request.getfixturevalue(fixture)
    engine = _engine(folder)
    assert engine.pooler.pooling_type.value == "last" and engine.pooler.normalize
    reference = AutoModel.from_pretrained(folder).eval()
    ids = engine.tokenizer(SENTENCES, truncation=True, max_length=200).input_ids
    expected = []
    with torch.no_grad():
        for row in ids:  # one by one: no padding question on the reference side
            hidden = reference(input_ids=torch.tensor([row])).last_hidden_state
            expected.append(torch.nn.functional.normalize(hidden[0, -1], dim=-1))
    requests = [PoolingRequest(f"q{i}", row, PoolingParams()) for i, row in enumerate(ids)]
    got = torch.tensor([o.embedding for o in engine.encode(requests)])  # batched, packed
    assert torch.allclose(got, torch.stack(expected), atol=1e-5)


def test_xlm_roberta_mean_pooling_matches_transformers(tmp_path: Path) -> None:
    """bge-m3's shape (XLMRobertaModel; positions from pad + 1), here with mean pooling from
    sentence-transformers' files, batched (packed)."""
    from transformers import AutoModel, XLMRobertaConfig, XLMRobertaModel

    from tests.engine.pooling.conftest import _tokenizer_dir, write_sentence_transformers_files

    torch.manual_seed(4)
    folder = _tokenizer_dir(tmp_path)
    config = XLMRobertaConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=130, pad_token_id=0, type_vocab_size=1,
    )  # fmt: skip
    XLMRobertaModel(config, add_pooling_layer=False).eval().save_pretrained(folder)
    write_sentence_transformers_files(folder, "mean_tokens")
    engine = _engine(folder)
    assert engine.max_model_len == 129  # 130 positions less pad + 1 (bge-m3: 8194 - 2)
    ids = engine.tokenizer(SENTENCES, truncation=True, max_length=128).input_ids
    reference = AutoModel.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = torch.stack(
            [reference(input_ids=torch.tensor([row])).last_hidden_state[0].mean(0) for row in ids]
        )
    got = torch.tensor(
        [o.embedding for o in engine.encode(
            [PoolingRequest(f"x{i}", row, PoolingParams()) for i, row in enumerate(ids)]
        )]
    )  # fmt: skip
    assert torch.allclose(got, torch.nn.functional.normalize(expected, dim=-1), atol=1e-5)


def test_bert_checkpoint_missing_a_fused_part_is_refused(tiny_bert: Path) -> None:
    """query/key/value load into one fused qkv weight: each of the three must be there."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from model_server.models.bert import BertModel

    weights = load_file(str(tiny_bert / "model.safetensors"))
    gone = next(name for name in weights if name.endswith("layer.1.attention.self.key.weight"))
    del weights[gone]
    model = BertModel(AutoConfig.from_pretrained(tiny_bert))
    with pytest.raises(ValueError, match=r"missing weights: .*layer\.1\.attention\.self\.key\.w"):
        model.load_weights(weights.items())
