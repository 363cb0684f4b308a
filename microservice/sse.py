"""The streaming formats: Enterprise-RAG's (`data: '<repr of the piece>'`), OpenAI's chunks, and
the `data: b'<text>'` lines GenAIComps' orchestrator strips before feeding a next node."""

from __future__ import annotations

import json
import time
from typing import Any

from microservice.errors import ServiceError
from microservice.upstream import Piece

DONE = "data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(exc: ServiceError) -> str:
    """An error after the status line was sent: an event in the stream instead."""
    return _event({"error": exc.body()["error"]})


class ThinkingText:
    """The text modes' view of a reasoning model's answer: its text only, or (with
    LLM_USVC_INCLUDE_REASONING) the thinking too, between <think> and </think> before the
    answer, as the model wrote it."""

    def __init__(self, include_reasoning: bool = False) -> None:
        self.include_reasoning = include_reasoning
        self._thinking = False

    def __call__(self, piece: Piece) -> str:
        if not self.include_reasoning:
            return piece.text
        text = ""
        if piece.reasoning:
            text = piece.reasoning if self._thinking else f"<think>{piece.reasoning}"
            self._thinking = True
        if self._thinking and (piece.text or piece.tool_calls or piece.finish_reason):
            text += "</think>"
            self._thinking = False
        return text + piece.text


def thinking_text(text: str, reasoning: str | None, include_reasoning: bool) -> str:
    """A whole answer's text in the text modes (see ThinkingText)."""
    if include_reasoning and reasoning:
        return f"<think>{reasoning}</think>{text}"
    return text


class OpeaFormat:
    """What OPEA clients parse: the repr of each text piece, then [DONE]."""

    def __init__(self, include_reasoning: bool = False) -> None:
        self.text = ThinkingText(include_reasoning)

    def start(self) -> list[str]:
        return []

    def piece(self, piece: Piece) -> list[str]:
        text = self.text(piece)
        return [f"data: {text!r}\n\n"] if text else []


class DownstreamFormat:
    """`data: b'<text>'` lines: GenAIComps' ServiceOrchestrator, when the LLM node has a next
    node, cuts `data: b'` and `'\n\n` off each line it reads and posts the rest, as text, to
    that node. So the text goes in raw (no escaping), which gives that node the text itself;
    the orchestrator reads one network chunk per line, which holds as each line is one chunk."""

    def __init__(self, include_reasoning: bool = False) -> None:
        self.text = ThinkingText(include_reasoning)

    def start(self) -> list[str]:
        return []

    def piece(self, piece: Piece) -> list[str]:
        text = self.text(piece)
        return [f"data: b'{text}'\n\n"] if text else []


class OpenAIFormat:
    """OpenAI's `chat.completion.chunk` events: the role first, then content deltas, the
    finish reason in the last one."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> str:
        return _event(
            {
                "id": self.request_id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
                ],
            }
        )

    def start(self) -> list[str]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def piece(self, piece: Piece) -> list[str]:
        delta: dict[str, Any] = {"content": piece.text} if piece.text else {}
        if piece.reasoning:  # the model server's fields, passed through
            delta["reasoning_content"] = delta["reasoning"] = piece.reasoning
        if piece.tool_calls:
            delta["tool_calls"] = piece.tool_calls
        if not delta and piece.finish_reason is None:
            return []
        return [self._chunk(delta, piece.finish_reason)]
