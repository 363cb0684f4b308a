"""Tool-call parsers, one per model family's format, chosen by `--tool-call-parser` or from the
model's chat template (`detect_tool_parser`)."""

from __future__ import annotations

from model_server.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
)
from model_server.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from model_server.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from model_server.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from model_server.entrypoints.openai.tool_parsers.streaming import ToolCallStream

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}

__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "ParsedToolCall",
    "ToolCallStream",
    "ToolParser",
    "detect_tool_parser",
    "get_tool_parser",
]


def detect_tool_parser(chat_template: str | None) -> str:
    """The format a chat template writes tool calls in; Hermes when it says nothing (the format
    SmolLM2 and Qwen were trained on, and the prompt Wick writes for templates without tools)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def get_tool_parser(name: str | None, chat_template: str | None) -> ToolParser:
    """The parser `name` (`auto`/None: detected from the template); ValueError if unknown."""
    if name in (None, "", "auto"):
        name = detect_tool_parser(chat_template)
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose one of: auto, {', '.join(TOOL_PARSERS)}"
        ) from None
