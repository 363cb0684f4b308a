"""A tiny fake OpenAI-compatible server for client-side tests (bench serve, examples/chat.py).

Completions answer `max_tokens` words " w0 w1 …" (one SSE chunk per word), chat completions
answer "you said: <last user message>" word by word after a role-only chunk. Usage counts words
(prompt words, answer words). Every request body is kept in `FakeOpenAI.requests`. With
`prefix_cache=True`, `/metrics` exports vLLM's prefix-cache counters as a server whose cache holds
every prompt it has seen (whole prompts, counted in words).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from tests.loopback import serve_asgi


@dataclass
class FakeOpenAI:
    model: str = "fake-model"
    report_usage: bool = True  # honour stream_options.include_usage
    delay_s: float = 0.0  # pause before every chunk
    fail_every: int = 0  # every k-th generation request answers HTTP 500 (0: never)
    unready_requests: int = 0  # the first k generation requests answer 503 (still starting)
    prefix_cache: bool = False  # serve /metrics with vllm:prefix_cache_{queries,hits}
    # serve /metrics with vllm:spec_decode_*: each generation adds 2 drafts of 3 tokens, 4 taken
    spec_decode: bool = False
    requests: list[dict[str, Any]] = field(default_factory=list)
    _seen_prompts: set[str] = field(default_factory=set)
    _prefix_queries: int = 0
    _prefix_hits: int = 0
    _generations: int = 0

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        async def models(_: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

        async def generate(request: Request) -> Response:
            body = await request.json()
            self.requests.append(body)
            if len(self.requests) <= self.unready_requests:
                return JSONResponse({"error": {"message": "loading"}}, 503)
            if self.fail_every and len(self.requests) % self.fail_every == 0:
                return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, 500)
            chat = request.url.path.endswith("chat/completions")
            if chat:
                prompt = " ".join(str(m["content"]) for m in body["messages"])
                user = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
                words = f"you said: {user}".split()
            else:
                prompt = body["prompt"]
                words = [f"w{i}" for i in range(int(body.get("max_tokens") or 16))]
            pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
            self._prefix_queries += len(prompt.split())
            if prompt in self._seen_prompts:
                self._prefix_hits += len(prompt.split())
            self._seen_prompts.add(prompt)
            self._generations += 1
            usage = {
                "prompt_tokens": len(prompt.split()),
                "completion_tokens": len(pieces),
                "total_tokens": len(prompt.split()) + len(pieces),
            }
            if not body.get("stream"):
                text = "".join(pieces)
                choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
                if chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                return JSONResponse({"id": "x", "choices": [choice], "usage": usage})
            include_usage = self.report_usage and bool(
                (body.get("stream_options") or {}).get("include_usage")
            )
            return StreamingResponse(
                self._stream(pieces, chat, usage if include_usage else None),
                media_type="text/event-stream",
            )

        async def metrics(_: Request) -> Response:
            lines = []
            counters = []
            if self.prefix_cache:
                counters += [
                    ("vllm:prefix_cache_queries", self._prefix_queries),
                    ("vllm:prefix_cache_hits", self._prefix_hits),
                ]
            if self.spec_decode:
                n = self._generations
                counters += [
                    ("vllm:spec_decode_num_drafts", 2 * n),
                    ("vllm:spec_decode_num_draft_tokens", 6 * n),
                    ("vllm:spec_decode_num_accepted_tokens", 4 * n),
                ]
            for name, value in counters:
                lines += [f"# TYPE {name} counter", f'{name}_total{{model_name="m"}} {value}.0']
            return Response("\n".join(lines) + "\n", media_type="text/plain")

        return Starlette(
            routes=[
                Route("/v1/models", models),
                *([Route("/metrics", metrics)] if self.prefix_cache or self.spec_decode else []),
                Route("/v1/completions", generate, methods=["POST"]),
                Route("/v1/chat/completions", generate, methods=["POST"]),
            ]
        )

    async def _stream(
        self, pieces: list[str], chat: bool, usage: dict[str, int] | None
    ) -> AsyncIterator[str]:
        def event(choices: list[dict[str, Any]], **extra: Any) -> str:
            return "data: " + json.dumps({"id": "x", "choices": choices, **extra}) + "\n\n"

        if chat:
            yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}}])
        for i, piece in enumerate(pieces):
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            last = i == len(pieces) - 1
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
            if chat:
                choice["delta"] = {"content": piece}
            else:
                choice["text"] = piece
            yield event([choice])
        if usage is not None:
            yield event([], usage=usage)
        yield "data: [DONE]\n\n"


def serve(fake: FakeOpenAI) -> AbstractContextManager[str]:
    """Run `fake` on a free loopback port in a thread; the context yields its base URL."""
    return serve_asgi(fake.app(), lifespan="off")
