"""The whole ChatQnA graph through GenAIComps' real `ServiceOrchestrator` (opea-comps 1.5, in its
own venv): embedding -> retriever -> reranking -> LLM, with Wick's three microservices as the
embedding, reranking and LLM nodes. The embedding and reranking microservices stand in front of
real Wick pooling model servers (all-MiniLM-L6-v2; a tiny random cross-encoder); the LLM
microservice in front of a fake OpenAI server that echoes its prompt, so the test can see which
documents reached the LLM, in which order; the retriever is the megaservice's stand-in, ranking a
small corpus by the query's real embedding."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import torch

from microservice.pooling_app import build_embedding_app, build_reranking_app
from microservice.pooling_settings import EmbeddingSettings, RerankingSettings
from model_server.engine.pooling.async_engine import AsyncPoolingEngine
from model_server.entrypoints.openai.pooling_server import build_pooling_app
from model_server.settings import ServerSettings
from tests.engine.pooling.conftest import minilm_path, tiny_cross_encoder  # noqa: F401
from tests.fake_openai_server import FakeOpenAI, serve
from tests.loopback import serve_asgi
from tests.microservice.opea.env import Megaservice, start_megaservice
from tests.microservice.test_opea_megaservice import streamed_text, wick_app

CORPUS = [
    "Wick serves embeddings with a pooling engine.",
    "Paris is the capital of France.",
    "The reranker scores each query and document pair.",
    "Bananas are rich in potassium.",
]
QUESTION = "How does Wick rerank documents?"


def _pooling_server(stack: ExitStack, model: str) -> str:
    settings = ServerSettings(model=model, dtype="float32", drain_timeout=5)
    app = build_pooling_app(AsyncPoolingEngine(settings.engine_config()), settings)
    url = stack.enter_context(serve_asgi(app))
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return url


@pytest.fixture(scope="module")
def pipeline(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_cross_encoder: Path,  # noqa: F811
) -> Iterator[tuple[Megaservice, FakeOpenAI, str, str]]:
    fake = FakeOpenAI(model="served-model")
    with serve(fake) as upstream, ExitStack() as stack:
        embed_server = _pooling_server(stack, minilm_path())
        rerank_server = _pooling_server(stack, str(tiny_cross_encoder))
        settings = EmbeddingSettings(model_server_endpoint=embed_server)
        embedding = stack.enter_context(serve_asgi(build_embedding_app(settings)))
        reranking = stack.enter_context(
            serve_asgi(build_reranking_app(RerankingSettings(model_server_endpoint=rerank_server)))
        )
        llm = stack.enter_context(serve_asgi(wick_app(upstream)))
        # The corpus's embeddings, as an indexing pipeline would have stored them.
        vectors = httpx.post(f"{embedding}/v1/embeddings", json={"text": CORPUS}).json()
        corpus = [
            {"text": t, "embedding": v} for t, v in zip(CORPUS, vectors["embedding"], strict=True)
        ]
        graphs = {"chatqna": {"llm": llm, "adapters": True, "embedding": embedding,
                              "reranking": reranking}}  # fmt: skip
        mega = start_megaservice(tmp_path_factory.mktemp("opea-rag"), graphs, corpus)
        try:
            yield mega, fake, embedding, rerank_server
        finally:
            mega.stop()


def test_orchestrator_runs_embedding_rerank_llm_and_streams(pipeline) -> None:
    mega, fake, _, rerank_server = pipeline
    fake.requests.clear()
    mega.received()
    response = mega.schedule("chatqna", {"text": QUESTION}, {"stream": True, "max_tokens": 64})
    answer = streamed_text(response)
    # The retriever got the query's real 384-dim embedding.
    assert mega.received() == ["retriever got 384 dims"]
    # What the retriever passed on: the corpus's 4 nearest by MiniLM, whose order the reranker
    # then changed to its own; the LLM got the reranker's best two, best first.
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(minilm_path(), device="cpu")
    similarity = (
        st.encode([QUESTION], convert_to_tensor=True) @ st.encode(CORPUS, convert_to_tensor=True).T
    )
    retrieved = [CORPUS[i] for i in torch.argsort(similarity[0], descending=True)[:4].tolist()]
    ranked = httpx.post(
        f"{rerank_server}/rerank", json={"query": QUESTION, "texts": retrieved}
    ).json()
    best = [retrieved[r["index"]] for r in ranked[:2]]
    (sent,) = [b for b in fake.requests if "messages" in b]
    prompt = " ".join(str(m["content"]) for m in sent["messages"])
    assert QUESTION in prompt
    assert all(doc in prompt for doc in best)
    assert not any(doc in prompt for doc in retrieved if doc not in best)
    assert prompt.index(best[0]) < prompt.index(best[1])
    assert sent["stream"] is True
    # The fake echoes its prompt word by word: the answer streamed back through every node.
    assert answer.startswith("you said:") and best[0].split()[0] in answer
