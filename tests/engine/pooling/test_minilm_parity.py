"""all-MiniLM-L6-v2 (real weights) against sentence-transformers: 64 sentences of mixed lengths,
batched and one by one, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from model_server.config import EngineConfig
from model_server.engine.pooling.engine import PoolingEngine
from model_server.engine.pooling.params import PoolingParams
from model_server.engine.pooling.request import PoolingRequest
from tests.engine.pooling.conftest import minilm_path, mixed_sentences


@pytest.fixture(scope="module")
def reference() -> tuple[list[str], torch.Tensor]:
    from sentence_transformers import SentenceTransformer

    sentences = mixed_sentences(64)
    model = SentenceTransformer(minilm_path(), device="cpu")
    return sentences, model.encode(sentences, convert_to_tensor=True, batch_size=64).float()


def _requests(engine: PoolingEngine, sentences: list[str]) -> list[PoolingRequest]:
    ids = engine.tokenizer(sentences, truncation=True, max_length=engine.max_model_len).input_ids
    return [PoolingRequest(f"r{i}", list(t), PoolingParams()) for i, t in enumerate(ids)]


@pytest.mark.parametrize(("dtype", "floor"), [("float32", 0.9999), ("bfloat16", 0.999)])
def test_minilm_matches_sentence_transformers(reference, dtype: str, floor: float) -> None:
    sentences, expected = reference
    engine = PoolingEngine(EngineConfig(model=minilm_path(), dtype=dtype))
    assert engine.pooler.pooling_type.value == "mean" and engine.pooler.normalize
    assert engine.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    # Batched: a budget that holds all 64 padded to the longest (256) in as few steps as it can.
    requests = _requests(engine, sentences)
    assert max(r.num_tokens for r in requests) == 256  # the long ones were truncated
    batched = torch.tensor([o.embedding for o in engine.encode(requests)])
    one_by_one = torch.tensor(
        [engine.encode(_requests(engine, [s]))[0].embedding for s in sentences]
    )
    for got in (batched, one_by_one):
        cosine = torch.nn.functional.cosine_similarity(got, expected)
        assert cosine.min().item() >= floor, cosine.min()
        assert torch.allclose(got.norm(dim=1), torch.ones(64), atol=1e-3)  # 2_Normalize
