"""Which answer format a request gets, and the non-streaming bodies of each.

| format | non-streaming | streaming |
|---|---|---|
| enterprise_rag | GeneratedDoc (`protocol.generated_doc`) | `data: '<repr>'` lines |
| openai | `chat.completion` JSON | `chat.completion.chunk` events |
| downstream | GeneratedDoc | `data: b'<text>'` lines (sse.DownstreamFormat) |

With `LLM_RESPONSE_FORMAT=auto` the request decides, as OPEA's microservices do: GenAIComps'
bodies (what its orchestrator sends; its adapters read OpenAI JSON) get `openai`; everything
else keeps the Enterprise-RAG contract (this service's answer to OpenAI-list requests too).
`downstream` is never chosen by itself: which node comes next is not in the request.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from microservice.protocol import ChatRequest
from microservice.settings import MicroserviceSettings
from microservice.sse import DownstreamFormat, OpeaFormat, OpenAIFormat
from microservice.upstream import Completion

Format = Literal["enterprise_rag", "openai", "downstream"]
StreamFormat = OpeaFormat | OpenAIFormat | DownstreamFormat


def choose(settings: MicroserviceSettings, chat: ChatRequest, stream: bool) -> Format:
    if stream and settings.openai_format_streaming:
        return "openai"
    if settings.response_format != "auto":
        return settings.response_format
    if chat.dialect == "genaicomps" or (chat.uses_tools and not chat.is_opea):
        return "openai"
    return "enterprise_rag"


def stream_format(
    fmt: Format, request_id: str, model: str, include_reasoning: bool = False
) -> StreamFormat:
    """OpenAI's chunks carry a reasoning model's thinking in their own fields; the text formats
    leave it out unless `include_reasoning` (LLM_USVC_INCLUDE_REASONING)."""
    if fmt == "openai":
        return OpenAIFormat(request_id, model)
    if fmt == "downstream":
        return DownstreamFormat(include_reasoning)
    return OpeaFormat(include_reasoning)


def chat_completion(request_id: str, model: str, completion: Completion) -> dict[str, Any]:
    """OpenAI's non-streaming `chat.completion` body."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": _message(completion),
                "logprobs": None,
                "finish_reason": completion.finish_reason or "stop",
            }
        ],
    }
    if completion.usage is not None:
        body["usage"] = completion.usage
    return body


def _message(completion: Completion) -> dict[str, Any]:
    if not completion.tool_calls:
        message = {"role": "assistant", "content": completion.text}
    else:
        message = {
            "role": "assistant",
            "content": completion.text or None,
            "tool_calls": completion.tool_calls,
        }
    if completion.reasoning is not None:
        message["reasoning_content"] = message["reasoning"] = completion.reasoning
    return message
