"""The pooling endpoints: OpenAI `/v1/embeddings`, TEI's `/embed` and `/rerank`, Jina/Cohere's
`/v1/rerank`, vLLM's `/v1/score` (the last two also on embedding models: cosine similarity).

Each turns its body into engine `PoolingRequest`s (tokenized here, on the event loop: fast
tokenizers take microseconds per sentence), awaits them from the `AsyncPoolingEngine` and shapes
the answer. Inputs longer than the model's maximum are refused unless the request asks for
truncation (TEI's `truncate`, vLLM's `truncate_prompt_tokens`); truncation keeps the start, as
sentence-transformers does.
"""

from __future__ import annotations

import base64
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from model_server.engine.pooling.async_engine import AsyncPoolingEngine
from model_server.engine.pooling.config import PoolingTask
from model_server.engine.pooling.params import PoolingParams
from model_server.engine.pooling.request import PoolingOutput, PoolingRequest
from model_server.entrypoints.openai.pooling_protocol import (
    MAX_INPUTS,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    TEIEmbedRequest,
    TEIRerankRequest,
)
from model_server.entrypoints.openai.protocol import APIError
from model_server.entrypoints.openai.serving_engine import to_api_error
from model_server.entrypoints.openai.serving_models import OpenAIServingModels

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
POOLING_PATHS = ("/v1/embeddings", "/embed", "/rerank", "/v1/rerank", "/v1/score")


@dataclass(slots=True)
class _Encoded:
    token_ids: list[int]
    token_type_ids: list[int] | None = None


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


class OpenAIServingPooling:
    def __init__(self, engine: AsyncPoolingEngine, served: OpenAIServingModels) -> None:
        self.engine = engine
        self.served = served

    # ------------------------------------------------------------------- helpers

    @property
    def task(self) -> PoolingTask:
        pooler = self.engine.pooler
        assert pooler is not None  # check_ready ran
        return pooler.task

    def _require(self, task: PoolingTask | None, path: str) -> None:
        """The engine is ready and serves `task` (None: either)."""
        try:
            self.engine.check_ready()  # loading / draining: 503; failed: 500
        except Exception as exc:
            raise to_api_error(exc) from None
        if task is None or self.task is task:
            return
        if self.task is PoolingTask.EMBED:
            hint = "it is an embedding model: use /v1/embeddings or /embed"
        else:
            hint = "it is a cross-encoder: use /v1/rerank, /rerank or /v1/score"
        raise APIError(f"{path} is not served by this model: {hint}", 400, param="model")

    @staticmethod
    def _count(param: str, n: int) -> None:
        if n == 0:
            raise APIError(f"{param} is empty: give at least one input", 400, param=param)
        if n > MAX_INPUTS:
            raise APIError(
                f"{param} has {n} inputs; at most {MAX_INPUTS} per request", 400, param=param
            )

    def _limit(self, param: str, truncate: int | bool | None) -> int | None:
        """Tokens to keep: None refuses longer inputs; -1 / True: the model's maximum."""
        max_len = self.engine.max_model_len
        assert max_len is not None
        if truncate is None or truncate is False:
            return None
        if truncate is True or truncate == -1:
            return max_len
        if truncate > max_len:
            raise APIError(
                f"truncate_prompt_tokens {truncate} exceeds the model's maximum input length "
                f"({max_len} tokens)",
                400,
                param="truncate_prompt_tokens",
            )
        return int(truncate)

    def _check_len(self, param: str, n: int) -> None:
        max_len = self.engine.max_model_len
        assert max_len is not None
        if n > max_len:
            raise APIError(
                f"{param} has {n} tokens, more than the model's maximum input length of "
                f"{max_len}; shorten it or ask for truncation (truncate, truncate_prompt_tokens)",
                400,
                param=param,
            )

    def _texts(self, param: str, texts: Sequence[str], limit: int | None) -> list[_Encoded]:
        tok = self.engine.tokenizer
        if limit is None:
            batch = tok(list(texts), add_special_tokens=True)
        else:
            batch = tok(list(texts), add_special_tokens=True, truncation=True, max_length=limit)
        out = [_Encoded(list(ids)) for ids in batch["input_ids"]]
        for i, e in enumerate(out):
            self._check_len(f"{param}[{i}]" if len(out) > 1 else param, len(e.token_ids))
        return out

    def _pairs(
        self, param: str, pairs: Sequence[tuple[str, str]], limit: int | None
    ) -> list[_Encoded]:
        tok = self.engine.tokenizer
        firsts, seconds = [p[0] for p in pairs], [p[1] for p in pairs]
        if limit is None:
            batch = tok(firsts, seconds, add_special_tokens=True)
        else:
            batch = tok(firsts, seconds, truncation=True, max_length=limit)
        types = batch.get("token_type_ids")
        out = [
            _Encoded(list(ids), list(types[i]) if types is not None else None)
            for i, ids in enumerate(batch["input_ids"])
        ]
        for i, e in enumerate(out):
            self._check_len(f"{param}[{i}]", len(e.token_ids))
        return out

    async def _run(self, encoded: list[_Encoded], params: PoolingParams) -> list[PoolingOutput]:
        base = uuid.uuid4().hex
        requests = [
            PoolingRequest(f"{base}-{i}", e.token_ids, params, e.token_type_ids)
            for i, e in enumerate(encoded)
        ]
        try:
            return await self.engine.encode(requests)
        except Exception as exc:
            raise to_api_error(exc) from None

    async def _scores(
        self, param: str, pairs: list[tuple[str, str]], truncate: int | bool | None
    ) -> tuple[list[float], int]:
        """Raw logits of each (query, document) pair and the tokens they took."""
        encoded = self._pairs(param, pairs, self._limit(param, truncate))
        outputs = await self._run(encoded, PoolingParams(task=PoolingTask.SCORE))
        return [o.score for o in outputs], sum(o.num_prompt_tokens for o in outputs)  # type: ignore[misc]

    async def _relevance(
        self, param: str, pairs: list[tuple[str, str]], truncate: int | bool | None
    ) -> tuple[list[float], int]:
        """Each (query, document) pair's relevance and the tokens it took: a cross-encoder's
        logit through a sigmoid, or, for an embedding model, the cosine similarity of the two
        texts' embeddings (as vLLM scores with embedding models; each distinct text is
        embedded once)."""
        if self.task is PoolingTask.SCORE:
            logits, tokens = await self._scores(param, pairs, truncate)
            return [_sigmoid(x) for x in logits], tokens
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        encoded = self._texts(param, texts, self._limit(param, truncate))
        outputs = await self._run(encoded, PoolingParams(PoolingTask.EMBED))
        vectors = {
            t: np.asarray(o.embedding, dtype=np.float64)
            for t, o in zip(texts, outputs, strict=True)
        }
        scores = []
        for a, b in pairs:
            va, vb = vectors[a], vectors[b]
            norm = float(np.linalg.norm(va) * np.linalg.norm(vb))
            scores.append(float(va @ vb) / norm if norm > 0 else 0.0)
        return scores, sum(o.num_prompt_tokens for o in outputs)

    # ----------------------------------------------------------------- endpoints

    async def create_embedding(self, request: EmbeddingRequest) -> dict[str, Any]:
        self._require(PoolingTask.EMBED, "/v1/embeddings")
        self.served.check_model(request.model)
        limit = self._limit("input", request.truncate_prompt_tokens)
        data = request.input
        if isinstance(data, str):
            encoded = self._texts("input", [data], limit)
        elif data and all(isinstance(x, int) for x in data):
            encoded = [self._ids("input", data, limit)]  # type: ignore[arg-type]
        else:
            self._count("input", len(data))
            if all(isinstance(x, str) for x in data):
                encoded = self._texts("input", data, limit)  # type: ignore[arg-type]
            else:
                encoded = [self._ids(f"input[{i}]", x, limit) for i, x in enumerate(data)]  # type: ignore[arg-type]
        params = self._embed_params("dimensions", request.dimensions, request.normalize)
        outputs = await self._run(encoded, params)
        items = []
        for i, o in enumerate(outputs):
            vector: Any = o.embedding
            if request.encoding_format == "base64":
                vector = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
            items.append({"object": "embedding", "index": i, "embedding": vector})
        tokens = sum(o.num_prompt_tokens for o in outputs)
        return {
            "object": "list",
            "data": items,
            "model": self.served.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    def _ids(self, param: str, ids: list[int], limit: int | None) -> _Encoded:
        if not ids:
            raise APIError(f"{param} is empty: give at least one token", 400, param=param)
        if limit is not None:
            ids = ids[:limit]
        self._check_len(param, len(ids))
        return _Encoded(list(ids))

    def _embed_params(
        self, param: str, dimensions: int | None, normalize: bool | None
    ) -> PoolingParams:
        hidden = int(self.engine.engine.source.hf_config.hidden_size)  # type: ignore[union-attr]
        if dimensions is not None and dimensions > hidden:
            raise APIError(
                f"dimensions {dimensions} exceeds the model's embedding size ({hidden})",
                400,
                param=param,
            )
        return PoolingParams(PoolingTask.EMBED, normalize=normalize, dimensions=dimensions)

    async def tei_embed(self, request: TEIEmbedRequest) -> list[list[float]]:
        self._require(PoolingTask.EMBED, "/embed")
        texts = [request.inputs] if isinstance(request.inputs, str) else request.inputs
        self._count("inputs", len(texts))
        encoded = self._texts("inputs", texts, self._limit("inputs", request.truncate))
        params = self._embed_params("dimensions", request.dimensions, request.normalize)
        return [o.embedding for o in await self._run(encoded, params)]  # type: ignore[misc]

    async def tei_rerank(self, request: TEIRerankRequest) -> list[dict[str, Any]]:
        self._require(PoolingTask.SCORE, "/rerank")
        self._count("texts", len(request.texts))
        pairs = [(request.query, t) for t in request.texts]
        logits, _ = await self._scores("texts", pairs, request.truncate)
        results = []
        for i, logit in enumerate(logits):
            item: dict[str, Any] = {
                "index": i,
                "score": logit if request.raw_scores else _sigmoid(logit),
            }
            if request.return_text:
                item["text"] = request.texts[i]
            results.append(item)
        return sorted(results, key=lambda r: -r["score"])

    async def rerank(self, request: RerankRequest) -> dict[str, Any]:
        self._require(None, "/v1/rerank")
        self.served.check_model(request.model)
        self._count("documents", len(request.documents))
        pairs = [(request.query, d) for d in request.documents]
        scores, tokens = await self._relevance("documents", pairs, request.truncate_prompt_tokens)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if request.top_n is not None:
            order = order[: request.top_n]
        results = []
        for i in order:
            item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if request.return_documents:
                item["document"] = {"text": request.documents[i]}
            results.append(item)
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": self.served.model_name,
            "usage": {"total_tokens": tokens},
            "results": results,
        }

    async def score(self, request: ScoreRequest) -> dict[str, Any]:
        self._require(None, "/v1/score")
        self.served.check_model(request.model)
        t1 = [request.text_1] if isinstance(request.text_1, str) else request.text_1
        t2 = [request.text_2] if isinstance(request.text_2, str) else request.text_2
        self._count("text_1", len(t1))
        self._count("text_2", len(t2))
        if len(t1) == 1:
            t1 = t1 * len(t2)
        elif len(t1) != len(t2):
            raise APIError(
                f"text_1 has {len(t1)} texts and text_2 {len(t2)}: give one text_1, or as many "
                "as text_2",
                400,
                param="text_2",
            )
        pairs = list(zip(t1, t2, strict=True))
        scores, tokens = await self._relevance("text_2", pairs, request.truncate_prompt_tokens)
        return {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": self.served.model_name,
            "data": [{"index": i, "object": "score", "score": x} for i, x in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
