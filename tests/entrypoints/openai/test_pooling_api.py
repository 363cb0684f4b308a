"""The pooling endpoints over real HTTP (uvicorn on loopback ports): an embedding server on the
real all-MiniLM-L6-v2 and a reranking server on a tiny random cross-encoder, driven by the
`openai` client and httpx; bad input answered 400 naming the field; and the generative server
refusing pooling routes."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from model_server.engine.pooling.async_engine import AsyncPoolingEngine
from model_server.entrypoints.openai.pooling_protocol import MAX_INPUTS
from model_server.entrypoints.openai.pooling_server import build_pooling_app
from model_server.settings import ServerSettings
from tests.engine.pooling.conftest import (  # noqa: F401  (fixtures)
    minilm_path,
    tiny_cross_encoder,
)
from tests.entrypoints.conftest import api, tiny_config  # noqa: F401  (fixtures)
from tests.loopback import serve_asgi

EMBED_NAME = "minilm"
RERANK_NAME = "tiny-reranker"


def _serve(model: str, name: str) -> Iterator[str]:
    settings = ServerSettings(model=model, served_model_name=name, dtype="float32", drain_timeout=5)
    app = build_pooling_app(AsyncPoolingEngine(settings.engine_config()), settings)
    with serve_asgi(app) as url:
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.monotonic() < deadline, httpx.get(f"{url}/health").text
            time.sleep(0.05)
        yield url


@pytest.fixture(scope="module")
def embed_url() -> Iterator[str]:
    yield from _serve(minilm_path(), EMBED_NAME)


@pytest.fixture(scope="module")
def rerank_url(tiny_cross_encoder: Path) -> Iterator[str]:  # noqa: F811
    yield from _serve(str(tiny_cross_encoder), RERANK_NAME)


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_path(), device="cpu")


def _error(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def test_openai_client_embeddings_match_sentence_transformers(embed_url: str, reference) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{embed_url}/v1", api_key="unused")
    texts = ["What is paged attention?", "Blocks of sixteen tokens hold the KV cache.", "hi"]
    result = client.embeddings.create(model=EMBED_NAME, input=texts)
    got = torch.tensor([d.embedding for d in result.data])
    expected = reference.encode(texts, convert_to_tensor=True)
    assert torch.nn.functional.cosine_similarity(got, expected).min() >= 0.9999
    assert [d.index for d in result.data] == [0, 1, 2]
    n_tokens = sum(len(ids) for ids in reference.tokenizer(texts).input_ids)
    assert result.usage.prompt_tokens == result.usage.total_tokens == n_tokens
    # The openai client asks for base64 by default when numpy is there; ask both explicitly.
    raw = httpx.post(
        f"{embed_url}/v1/embeddings",
        json={"input": texts[0], "encoding_format": "base64", "dimensions": 128},
    ).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert vector.shape == (128,)
    np.testing.assert_allclose(np.linalg.norm(vector), 1.0, rtol=1e-5)  # normalized again
    full = torch.tensor(got[0, :128].tolist())
    np.testing.assert_allclose(vector, torch.nn.functional.normalize(full, dim=0), atol=1e-5)


def test_token_id_input_and_tei_embed(embed_url: str, reference) -> None:
    ids = reference.tokenizer("a cat sat on the mat").input_ids
    by_ids = httpx.post(f"{embed_url}/v1/embeddings", json={"input": [ids, ids[:3]]}).json()
    by_text = httpx.post(f"{embed_url}/embed", json={"inputs": "a cat sat on the mat"}).json()
    assert len(by_ids["data"]) == 2 and len(by_text) == 1
    np.testing.assert_allclose(by_ids["data"][0]["embedding"], by_text[0], atol=1e-6)
    assert by_ids["usage"]["prompt_tokens"] == len(ids) + 3
    unnormalized = httpx.post(
        f"{embed_url}/embed", json={"inputs": ["a cat sat on the mat"], "normalize": False}
    ).json()
    assert abs(np.linalg.norm(unnormalized[0]) - 1.0) > 1e-3


def test_bad_embedding_input_is_a_400_naming_the_field(embed_url: str) -> None:
    url = f"{embed_url}/v1/embeddings"
    assert "empty" in _error(httpx.post(url, json={"input": []}), "input")
    too_many = ["x"] * (MAX_INPUTS + 1)
    assert str(MAX_INPUTS) in _error(httpx.post(url, json={"input": too_many}), "input")
    long_text = "word " * 400
    assert "maximum input length of 256" in _error(
        httpx.post(url, json={"input": long_text}), "input"
    )
    truncated = httpx.post(url, json={"input": long_text, "truncate_prompt_tokens": -1}).json()
    assert truncated["usage"]["prompt_tokens"] == 256
    assert "maximum input length" in _error(
        httpx.post(f"{embed_url}/embed", json={"inputs": [long_text]}), "inputs"
    )
    tei = httpx.post(f"{embed_url}/embed", json={"inputs": [long_text], "truncate": True})
    assert tei.status_code == 200
    _error(httpx.post(url, json={"input": "x", "encoding_format": "int8"}), "encoding_format")
    assert "384" in _error(httpx.post(url, json={"input": "x", "dimensions": 1000}), "dimensions")
    _error(httpx.post(url, json={"input": "x", "temperature": 0.5}), "temperature")
    assert "out of range" in httpx.post(url, json={"input": [[99999999]]}).text


def test_models_capabilities_and_wrong_task_routes(embed_url: str, rerank_url: str) -> None:
    card = httpx.get(f"{embed_url}/v1/models").json()["data"][0]
    assert card["id"] == EMBED_NAME and card["max_model_len"] == 256
    assert card["capabilities"] == ["embed", "score", "rerank"]
    card = httpx.get(f"{rerank_url}/v1/models").json()["data"][0]
    assert card["capabilities"] == ["score", "rerank"]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    message = _error(httpx.post(f"{embed_url}/v1/chat/completions", json=chat), "model")
    assert "generates no text" in message
    assert "it is an embedding model" in _error(
        httpx.post(f"{embed_url}/rerank", json={"query": "q", "texts": ["a"]}), "model"
    )
    assert "it is a cross-encoder" in _error(
        httpx.post(f"{rerank_url}/v1/embeddings", json={"input": "a"}), "model"
    )


def _reference_scores(folder: Path, query: str, docs: list[str]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    batch = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits[:, 0]


DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "The Seine flows through it."]


def test_tei_rerank_as_chatqna_sends_it(rerank_url: str, tiny_cross_encoder: Path) -> None:  # noqa: F811
    logits = _reference_scores(tiny_cross_encoder, "capital of France?", DOCS)
    body = {"query": "capital of France?", "texts": DOCS}
    ranked = httpx.post(f"{rerank_url}/rerank", json=body).json()
    assert [r["index"] for r in ranked] == torch.argsort(logits, descending=True).tolist()
    for r in ranked:
        assert r["score"] == pytest.approx(torch.sigmoid(logits[r["index"]]).item(), abs=1e-5)
    raw = httpx.post(f"{rerank_url}/rerank", json={**body, "raw_scores": True, "return_text": True})
    top = raw.json()[0]
    assert top["score"] == pytest.approx(logits.max().item(), abs=1e-5)
    assert top["text"] == DOCS[top["index"]]


def test_v1_rerank_and_score(rerank_url: str, tiny_cross_encoder: Path) -> None:  # noqa: F811
    logits = _reference_scores(tiny_cross_encoder, "capital of France?", DOCS)
    body = {"model": RERANK_NAME, "query": "capital of France?", "documents": DOCS, "top_n": 2}
    result = httpx.post(f"{rerank_url}/v1/rerank", json=body).json()
    order = torch.argsort(logits, descending=True).tolist()
    assert [r["index"] for r in result["results"]] == order[:2]
    assert result["results"][0]["document"] == {"text": DOCS[order[0]]}
    assert result["usage"]["total_tokens"] > 0 and result["model"] == RERANK_NAME
    plain = httpx.post(f"{rerank_url}/v1/rerank", json={**body, "return_documents": False})
    assert "document" not in plain.json()["results"][0]
    scores = httpx.post(
        f"{rerank_url}/v1/score", json={"text_1": "capital of France?", "text_2": DOCS}
    ).json()
    assert [d["score"] for d in scores["data"]] == pytest.approx(
        torch.sigmoid(logits).tolist(), abs=1e-5
    )
    _error(httpx.post(f"{rerank_url}/v1/rerank", json={"query": "q", "documents": []}), "documents")
    _error(
        httpx.post(f"{rerank_url}/v1/score", json={"text_1": ["a", "b"], "text_2": DOCS}), "text_2"
    )
    _error(httpx.post(f"{rerank_url}/v1/rerank", json={**body, "top_n": 0}), "top_n")
    missing = httpx.post(f"{rerank_url}/v1/rerank", json={**body, "model": "nope"})
    assert missing.status_code == 404


def test_embedding_model_scores_are_cosine_similarities(embed_url: str, reference) -> None:
    """/v1/score and /v1/rerank on an embedding model: sentence-transformers' cosine
    similarities (as vLLM scores with embedding models)."""
    query = "What is the capital of France?"
    want = torch.nn.functional.cosine_similarity(
        reference.encode([query], convert_to_tensor=True),
        reference.encode(DOCS, convert_to_tensor=True),
    )
    scores = httpx.post(f"{embed_url}/v1/score", json={"text_1": query, "text_2": DOCS}).json()
    assert [d["score"] for d in scores["data"]] == pytest.approx(want.tolist(), abs=1e-4)
    assert scores["usage"]["prompt_tokens"] > 0
    body = {"model": EMBED_NAME, "query": query, "documents": DOCS}
    ranked = httpx.post(f"{embed_url}/v1/rerank", json=body).json()["results"]
    assert [r["index"] for r in ranked] == torch.argsort(want, descending=True).tolist()
    assert ranked[0]["relevance_score"] == pytest.approx(want.max().item(), abs=1e-4)
    pairs = {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}
    _error(httpx.post(f"{embed_url}/v1/score", json=pairs), "text_2")


def test_a_request_of_many_steps_runs_each_input_once(embed_url: str, reference) -> None:
    """Inputs that fill several engine steps (about 32 of MiniLM's longest per step): each runs
    once, the answer keeps their order, and the server serves on."""
    from tests.e2e.conftest import metric

    pooled = metric(embed_url, "wick:pooling_inputs_total")
    words = [
        "a",
        "step",
        "holds",
        "as",
        "many",
        "padded",
        "tokens",
        "as",
        "the",
        "budget",
        "allows",
    ]
    texts = [" ".join(words[: 1 + i % len(words)] * 20) for i in range(100)]
    body = {"input": texts, "truncate_prompt_tokens": -1}
    answer = httpx.post(f"{embed_url}/v1/embeddings", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    got = torch.tensor([d["embedding"] for d in answer.json()["data"]])
    expected = reference.encode(texts, convert_to_tensor=True)
    assert torch.nn.functional.cosine_similarity(got, expected).min() >= 0.9999
    assert metric(embed_url, "wick:pooling_inputs_total") - pooled == len(texts)
    assert httpx.post(f"{embed_url}/embed", json={"inputs": "again"}).status_code == 200


def test_a_client_that_leaves_drops_its_queued_inputs(embed_url: str) -> None:
    """A client gone mid-request: its inputs not yet run are dropped (the queue empties within
    a step, far fewer than all were pooled), the server logs a 499 and answers the next."""
    from tests.e2e.conftest import metric

    pooled = metric(embed_url, "wick:pooling_inputs_total")
    long_text = " ".join(["paged attention keeps the KV cache in fixed-size blocks"] * 25)
    body = {"input": [f"{i} {long_text}" for i in range(MAX_INPUTS)], "truncate_prompt_tokens": -1}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{embed_url}/v1/embeddings", json=body, timeout=httpx.Timeout(60, read=1.5))
    deadline = time.monotonic() + 20
    while metric(embed_url, "vllm:num_requests_waiting") > 0 or (
        metric(embed_url, "wick:pooling_requests_total", 'status="499"') < 1
    ):
        assert time.monotonic() < deadline, "the abandoned inputs still wait"
        time.sleep(0.05)
    ran = metric(embed_url, "wick:pooling_inputs_total") - pooled
    assert ran < MAX_INPUTS / 2, f"{ran} of {MAX_INPUTS} inputs ran for a client that left"
    assert httpx.post(f"{embed_url}/embed", json={"inputs": "still here"}).status_code == 200


def test_generative_server_refuses_pooling_routes(api) -> None:  # noqa: F811
    assert api.get("/v1/models").json()["data"][0]["capabilities"] == ["generate"]
    for path, body in [("/v1/embeddings", {"input": "x"}), ("/rerank", {"query": "q"})]:
        response = api.post(path, json=body)
        assert response.status_code == 400
        assert "generative model" in response.json()["error"]["message"]


def test_a_pooling_engine_that_cannot_start_reports_why(tiny_cross_encoder: Path) -> None:  # noqa: F811
    settings = ServerSettings(model=str(tiny_cross_encoder), quantization="int8", drain_timeout=1)
    app = build_pooling_app(AsyncPoolingEngine(settings.engine_config()), settings)
    with serve_asgi(app) as url:
        deadline = time.monotonic() + 30
        while (health := httpx.get(f"{url}/health").json())["phase"] != "error":
            assert time.monotonic() < deadline, health
            time.sleep(0.05)
        assert "--quantization is not supported for pooling models" in health["message"]
        response = httpx.post(f"{url}/v1/score", json={"text_1": "a", "text_2": "b"})
        assert response.status_code == 500 and response.json()["error"]["code"] == "engine_dead"


def test_a_pooling_model_runs_on_the_native_build_cpu_isa_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--cpu-isa (WICK_CPU_ISA) is a process setting the pooling kernels honour too: exported
    for the machine, it must not stop an embedding server (it once did: refused as a
    generative-only flag), and the embeddings equal the default build's."""
    from model_server.engine.pooling.engine import PoolingEngine
    from model_server.engine.pooling.params import PoolingParams
    from model_server.engine.pooling.request import PoolingRequest
    from model_server.kernels.cpu.isa import choose_isas

    model = minilm_path()
    want = PoolingEngine(ServerSettings(model=model, dtype="float32").engine_config())
    monkeypatch.setenv("WICK_CPU_ISA", "avx2")
    if choose_isas()[0].name != "avx2":
        pytest.skip("this CPU has no AVX2")
    engine = PoolingEngine(ServerSettings(model=model, dtype="float32").engine_config())
    texts = ["the cat sat on the mat", "a longer sentence about kernels and instruction sets"]

    def embed(e: PoolingEngine) -> torch.Tensor:
        requests = [
            PoolingRequest(f"r{i}", e.tokenizer.encode(t), PoolingParams())
            for i, t in enumerate(texts)
        ]
        return torch.tensor([o.embedding for o in e.encode(requests)])

    torch.testing.assert_close(embed(engine), embed(want), rtol=1e-4, atol=1e-5)
    from model_server.kernels.cpu.native import load_kernels

    native = load_kernels()  # what the pooling model's CPU kernels load under the variable
    assert native is None or native.isa == "avx2"


def test_generation_settings_are_refused_for_a_pooling_model() -> None:
    from model_server.entrypoints.openai.pooling_server import check_pooling_settings

    check_pooling_settings(ServerSettings(model=minilm_path()))  # defaults: fine
    with pytest.raises(ValueError, match="--temperature is a text-generation setting"):
        check_pooling_settings(ServerSettings(model=minilm_path(), temperature=0.5))
    from model_server.engine.pooling.engine import PoolingEngine

    with pytest.raises(ValueError, match="--block-size is not supported for pooling models"):
        PoolingEngine(ServerSettings(model=minilm_path(), block_size=32).engine_config())
