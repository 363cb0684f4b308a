"""The embedding and reranking microservices for real: each on a loopback port in front of a
real Wick pooling model server (all-MiniLM-L6-v2; a tiny random cross-encoder), driven with
OPEA's payloads over HTTP."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from microservice.pooling_app import build_embedding_app, build_reranking_app
from microservice.pooling_settings import EmbeddingSettings, RerankingSettings
from model_server.engine.pooling.async_engine import AsyncPoolingEngine
from model_server.entrypoints.openai.pooling_server import build_pooling_app
from model_server.settings import ServerSettings
from tests.engine.pooling.conftest import minilm_path, tiny_cross_encoder  # noqa: F401  (fixture)
from tests.loopback import free_port, serve_asgi


def _model_server(model: str, name: str) -> Iterator[str]:
    settings = ServerSettings(model=model, served_model_name=name, dtype="float32", drain_timeout=5)
    with serve_asgi(
        build_pooling_app(AsyncPoolingEngine(settings.engine_config()), settings)
    ) as url:
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield url


@pytest.fixture(scope="module")
def embedding_chain() -> Iterator[tuple[str, str]]:
    """(the embedding service's URL, its model server's)."""
    for model_server in _model_server(minilm_path(), "minilm"):
        settings = EmbeddingSettings(model_server_endpoint=model_server)
        with serve_asgi(build_embedding_app(settings)) as url:
            yield url, model_server


@pytest.fixture(scope="module")
def embedding_service(embedding_chain: tuple[str, str]) -> str:
    return embedding_chain[0]


@pytest.fixture(scope="module")
def reranking_service(tiny_cross_encoder: Path) -> Iterator[str]:  # noqa: F811
    for model_server in _model_server(str(tiny_cross_encoder), "reranker"):
        settings = RerankingSettings(model_server_endpoint=model_server, model_name="reranker")
        with serve_asgi(build_reranking_app(settings)) as url:
            yield url


def _st_embed(texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_path(), device="cpu").encode(texts, convert_to_tensor=True)


def test_text_doc_answers_an_embed_doc(embedding_service: str) -> None:
    answer = httpx.post(f"{embedding_service}/v1/embeddings", json={"text": "What is OPEA?"})
    assert answer.status_code == 200, answer.text
    doc = answer.json()
    assert doc["text"] == "What is OPEA?" and doc["search_type"] == "similarity" and doc["k"] == 4
    expected = _st_embed(["What is OPEA?"])[0]
    cosine = torch.nn.functional.cosine_similarity(torch.tensor(doc["embedding"]), expected, dim=0)
    assert cosine >= 0.9999
    several = httpx.post(f"{embedding_service}/v1/embeddings", json={"text": ["a", "b c"]}).json()
    assert len(several["embedding"]) == 2 and len(several["embedding"][1]) == 384


def test_openai_request_answers_an_embedding_list(embedding_service: str) -> None:
    body = {"input": ["one", "two"], "encoding_format": "float", "request_type": "embedding"}
    answer = httpx.post(f"{embedding_service}/v1/embeddings", json=body).json()
    assert answer["object"] == "list" and [d["index"] for d in answer["data"]] == [0, 1]
    assert answer["model"] == "minilm" and answer["usage"]["prompt_tokens"] == 6


def test_embedding_bad_input(embedding_service: str) -> None:
    url = f"{embedding_service}/v1/embeddings"
    for body, param in [
        ({"text": []}, "text"),
        ({"text": "x", "k": 3}, "k"),
        ({"nothing": 1}, "text"),
        ({"input": "word " * 400}, "input"),  # the model server's 400 passes through
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ]:
        response = httpx.post(url, json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, response.json()
    assert httpx.post(url, content=b"{not json").status_code == 400


DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "The Seine flows there."]


def _reference_order(folder: Path, query: str) -> list[int]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = model(**tok([query] * 3, DOCS, padding=True, return_tensors="pt")).logits[:, 0]
    return torch.argsort(logits, descending=True).tolist()


def test_searched_doc_answers_llm_params_with_the_best_documents(
    reranking_service: str,
    tiny_cross_encoder: Path,  # noqa: F811
) -> None:
    order = _reference_order(tiny_cross_encoder, "capital of France?")
    body = {
        "initial_query": "capital of France?",
        "retrieved_docs": [{"text": d} for d in DOCS],
        "top_n": 2,
    }
    answer = httpx.post(f"{reranking_service}/v1/reranking", json=body)
    assert answer.status_code == 200, answer.text
    doc = answer.json()
    assert doc["query"] == "capital of France?"
    assert doc["documents"] == [DOCS[i] for i in order[:2]]
    assert doc["max_new_tokens"] == 1024 and doc["stream"] is True  # LLMParamsDoc defaults
    empty = {"initial_query": "q", "retrieved_docs": []}
    assert httpx.post(f"{reranking_service}/v1/reranking", json=empty).json()["documents"] == []


def test_reranking_request_answers_scores(reranking_service: str, tiny_cross_encoder) -> None:  # noqa: F811
    order = _reference_order(tiny_cross_encoder, "capital of France?")
    body = {"input": "capital of France?", "retrieved_docs": DOCS, "top_n": 3}
    reranked = httpx.post(f"{reranking_service}/v1/reranking", json=body).json()["reranked_docs"]
    assert [r["text"] for r in reranked] == [DOCS[i] for i in order]
    assert all(0 < r["score"] < 1 for r in reranked)
    assert reranked[0]["score"] >= reranked[1]["score"] >= reranked[2]["score"]
    for bad, param in [
        ({**body, "top_n": 0}, "top_n"),
        ({**body, "retrieved_docs": [{"txt": "x"}]}, "retrieved_docs[0]"),
        ({"input": "", "retrieved_docs": DOCS}, "input"),
    ]:
        response = httpx.post(f"{reranking_service}/v1/reranking", json=bad)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_health_check_and_metrics(embedding_service: str, reranking_service: str) -> None:
    for url, prefix in [
        (embedding_service, "embedding_microservice"),
        (reranking_service, "reranking_microservice"),
    ]:
        health = httpx.get(f"{url}/v1/health_check")
        assert health.status_code == 200 and health.json()["model_server"]["ready"] is True
        metrics = httpx.get(f"{url}/metrics").text
        assert f'{prefix}_requests_total{{status="200"}}' in metrics
        assert f'{prefix}_requests_total{{status="400"}}' in metrics


def test_model_server_down_is_a_quick_503() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    app = build_reranking_app(RerankingSettings(model_server_endpoint=dead))
    with serve_asgi(app) as url:
        started = time.monotonic()
        body = {"input": "q", "retrieved_docs": ["a"]}
        response = httpx.post(f"{url}/v1/reranking", json=body)
        assert response.status_code == 503 and time.monotonic() - started < 5
        assert httpx.get(f"{url}/v1/health_check").status_code == 503
        metrics = httpx.get(f"{url}/metrics").text
        assert 'reranking_microservice_upstream_errors_total{kind="connect"} 1.0' in metrics


def test_a_client_that_leaves_the_service_stops_the_model_server_work(
    embedding_chain: tuple[str, str],
) -> None:
    """The client gives up on a big request: the service cancels its model server call, whose
    queued inputs are dropped (the model server's queue empties and most inputs never run)."""
    from tests.e2e.conftest import metric

    service, model_server = embedding_chain
    pooled = metric(model_server, "wick:pooling_inputs_total")
    text = " ".join(["the service forwards every input to the model server"] * 20)  # < 256
    body = {"input": [f"{i} {text}" for i in range(1024)]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{service}/v1/embeddings", json=body, timeout=httpx.Timeout(60, read=1.5))
    deadline = time.monotonic() + 20
    while metric(model_server, "vllm:num_requests_waiting") > 0:
        assert time.monotonic() < deadline, "the model server still works for a client gone"
        time.sleep(0.05)
    ran = metric(model_server, "wick:pooling_inputs_total") - pooled
    assert ran < 512, f"{ran} of 1024 inputs ran for a client that left"
    assert httpx.post(f"{service}/v1/embeddings", json={"text": "next"}).status_code == 200
