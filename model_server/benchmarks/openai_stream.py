"""One streaming request to an OpenAI-compatible server, timed token by token (httpx, SSE).

Definitions (as in vLLM's serving benchmark):
- TTFT: request sent → first chunk carrying text.
- ITL: the gaps between successive chunks carrying text (one entry per gap).
- E2EL (`latency`): request sent → end of the stream.
- Output tokens: the server's `usage.completion_tokens` (asked for with
  `stream_options.include_usage`); servers that do not report usage get the number of chunks
  carrying text, which equals the token count for servers that stream one token per chunk.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx


@dataclass(slots=True)
class RequestResult:
    """What one request measured. Times are seconds (perf_counter differences)."""

    success: bool = False
    # Prompt tokens: the server's usage.prompt_tokens when reported, else the client's count.
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # perf_counter at send
    generated_text: str = ""
    error: str = ""
    usage_reported: bool = False
    # HTTP status of the response; None when no response came (connection refused, timeout).
    status_code: int | None = None


def is_chat_endpoint(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("chat/completions")


def build_payload(
    *,
    model: str,
    prompt: str,
    max_tokens: int,
    chat: bool,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The request body: streaming, usage requested, vLLM's `ignore_eos` only when asked for."""
    body: dict[str, Any] = {"model": model, "temperature": temperature, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        # Newer OpenAI name; vLLM and most servers also accept max_tokens.
        body["max_completion_tokens"] = max_tokens
    else:
        body["prompt"] = prompt
    body["max_tokens"] = max_tokens
    if ignore_eos:
        body["ignore_eos"] = True
    if extra:
        body.update(extra)
    return body


def chunk_text(data: dict[str, Any], chat: bool) -> str | None:
    """Text carried by a stream chunk's first choice; None when it has no choice."""
    choices = data.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def stream_request(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    *,
    prompt_len: int,
    headers: dict[str, str] | None = None,
) -> RequestResult:
    """Send `payload` (with stream=true) to `url` and time its SSE chunks. Never raises."""
    chat = "messages" in payload
    result = RequestResult(prompt_len=prompt_len)
    num_text_chunks = 0
    last = start = time.perf_counter()
    result.start_time = start
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            result.status_code = response.status_code
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:500]}"
                return result
            async for line in response.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators, comments (": ping"), event: lines
                data_str = line[len("data:") :].strip()
                if data_str == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(data_str)
                if "error" in data:
                    result.error = f"error in stream: {data['error']}"
                    return result
                text = chunk_text(data, chat)
                if text:
                    if num_text_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    num_text_chunks += 1
                    result.generated_text += text
                usage = data.get("usage")
                if usage:
                    result.usage_reported = True
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    if usage.get("prompt_tokens") is not None:
                        result.prompt_len = int(usage["prompt_tokens"])
        result.latency = time.perf_counter() - start
    except Exception as exc:  # network errors, bad JSON: a failed request, not a crash
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if not result.usage_reported:
        result.output_tokens = num_text_chunks
    if num_text_chunks == 0:
        result.error = "the stream carried no text (cannot measure TTFT)"
        return result
    result.success = True
    return result
