"""The OPEA payloads of the embedding and reranking microservices (opea-comps 1.5,
`comps/cores/proto/`), checked by hand into plain values, and the answers built from the model
server's.

Embedding, `POST /v1/embeddings`: a `TextDoc` (`{"text": str | [str]}`) answers an `EmbedDoc`
(the text, its embedding, and the retriever's search defaults); an OpenAI `EmbeddingRequest`
(`{"input": ...}`) answers the OpenAI embedding list. Reranking, `POST /v1/reranking`: a
`SearchedDoc` (`initial_query`, `retrieved_docs: [TextDoc]`, `top_n`) answers an `LLMParamsDoc`
for the LLM node (the query and the best documents' texts); a `RerankingRequest` (`input`,
`retrieved_docs` as strings or `{"text": ...}` objects, `top_n`) answers a `RerankingResponse`
(`reranked_docs: [{"text", "score"}]`). Fields these services do not honour are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from microservice.errors import ServiceError

# BaseDoc / TopologyInfo fields every OPEA doc may carry (ignored by design: identity and the
# orchestrator's routing, not parameters).
_DOC_FIELDS = {"id", "downstream_black_list"}
_OPENAI_EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user",
                            "request_type"}  # fmt: skip

# EmbedDoc's retriever defaults (opea-comps 1.5 docarray.EmbedDoc).
EMBED_DOC_DEFAULTS: dict[str, Any] = {
    "search_type": "similarity",
    "k": 4,
    "distance_threshold": None,
    "fetch_k": 20,
    "lambda_mult": 0.5,
    "score_threshold": 0.2,
    "constraints": None,
    "index_name": None,
}
# LLMParamsDoc's defaults (opea-comps 1.5 docarray.LLMParamsDoc), which the LLM node reads.
LLM_PARAMS_DEFAULTS: dict[str, Any] = {
    "model": None,
    "max_tokens": 1024,
    "max_new_tokens": 1024,
    "top_k": 10,
    "top_p": 0.95,
    "typical_p": 0.95,
    "temperature": 0.01,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.03,
    "stream": True,
    "language": "auto",
    "input_guardrail_params": None,
    "output_guardrail_params": None,
    "chat_template": None,
}


def _bad(message: str, param: str | None = None) -> ServiceError:
    return ServiceError(message, 400, param=param)


def _refuse_unknown(body: dict[str, Any], known: set[str], what: str) -> None:
    unknown = sorted(set(body) - known - _DOC_FIELDS)
    if unknown:
        raise _bad(f"{what} does not take {', '.join(unknown)}", unknown[0])


def _texts(value: Any, param: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    if isinstance(value, list) and not value:
        raise _bad(f"{param} is empty: give at least one text", param)
    raise _bad(f"{param} must be a string or a list of strings", param)


@dataclass(slots=True)
class EmbeddingInput:
    """`openai`: the body to forward as it is (an OpenAI request); else a TextDoc's texts."""

    texts: list[str]
    single: bool  # TextDoc.text was one string: EmbedDoc.embedding is one vector
    openai: dict[str, Any] | None = None


def parse_embedding(body: Any) -> EmbeddingInput:
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object (a TextDoc or an OpenAI EmbeddingRequest)")
    if "input" in body:
        _refuse_unknown(body, _OPENAI_EMBEDDING_FIELDS, "an EmbeddingRequest")
        forward = {k: v for k, v in body.items() if k != "request_type"}
        return EmbeddingInput([], False, openai=forward)
    if "text" in body:
        _refuse_unknown(body, {"text"}, "a TextDoc")
        return EmbeddingInput(_texts(body["text"], "text"), isinstance(body["text"], str))
    raise _bad("expected a TextDoc (`text`) or an OpenAI EmbeddingRequest (`input`)", "text")


def embed_doc(parsed: EmbeddingInput, original: Any, vectors: list[list[float]]) -> dict:
    return {
        "text": original,
        "embedding": vectors[0] if parsed.single else vectors,
        **EMBED_DOC_DEFAULTS,
    }


@dataclass(slots=True)
class RerankingInput:
    query: str
    documents: list[str]
    top_n: int
    searched_doc: bool  # a SearchedDoc (answer an LLMParamsDoc), else a RerankingRequest


def _top_n(body: dict[str, Any]) -> int:
    top_n = body.get("top_n", 1)
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
        raise _bad("top_n must be a positive integer", "top_n")
    return top_n


def _doc_text(doc: Any, param: str) -> str:
    if isinstance(doc, str):
        return doc
    if isinstance(doc, dict) and isinstance(doc.get("text"), str):
        return doc["text"]
    raise _bad(f"{param} must be a string or an object with a string `text`", param)


def parse_reranking(body: Any) -> RerankingInput:
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object (a SearchedDoc or a RerankingRequest)")
    if "initial_query" in body:
        _refuse_unknown(body, {"initial_query", "retrieved_docs", "top_n"}, "a SearchedDoc")
        query, searched = body["initial_query"], True
        param = "initial_query"
    elif "input" in body:
        _refuse_unknown(body, {"input", "retrieved_docs", "top_n", "request_type"},
                        "a RerankingRequest")  # fmt: skip
        query, searched = body["input"], False
        param = "input"
    else:
        raise _bad(
            "expected a SearchedDoc (`initial_query`, `retrieved_docs`) or a RerankingRequest "
            "(`input`, `retrieved_docs`)",
            "initial_query",
        )
    if not isinstance(query, str) or not query:
        raise _bad(f"{param} must be a non-empty string", param)
    docs = body.get("retrieved_docs")
    if not isinstance(docs, list):
        raise _bad("retrieved_docs must be a list", "retrieved_docs")
    texts = [_doc_text(d, f"retrieved_docs[{i}]") for i, d in enumerate(docs)]
    return RerankingInput(query, texts, _top_n(body), searched)


def reranking_answer(parsed: RerankingInput, ranked: list[tuple[int, float]]) -> dict:
    """`ranked`: (document index, score), best first, already cut to top_n."""
    if parsed.searched_doc:
        documents = [parsed.documents[i] for i, _ in ranked]
        return {**LLM_PARAMS_DEFAULTS, "query": parsed.query, "documents": documents}
    return {"reranked_docs": [{"text": parsed.documents[i], "score": s} for i, s in ranked]}
