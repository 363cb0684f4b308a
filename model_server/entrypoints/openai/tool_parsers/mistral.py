"""Mistral's tool calls: `[TOOL_CALLS]` and a JSON array

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

(v11+ tokenizers write `[TOOL_CALLS]name[ARGS]{...}` per call; both are read).
"""

from __future__ import annotations

import json
import re
from typing import Any

from model_server.entrypoints.openai.tool_parsers.base import (
    ParsedToolCall,
    ToolParser,
    arguments_text,
    call_from_object,
    json_values,
)

_MARKER = "[TOOL_CALLS]"
_ARGS = "[ARGS]"
_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*$")


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (_MARKER,)

    def parse_section(self, section: str, final: bool) -> list[ParsedToolCall] | None:
        body = section[len(_MARKER) :]
        if _ARGS in body:
            calls = _parse_v11(section)
        else:
            body = body.strip()
            # The array's complete items so far (json_values stops at `]` or an unfinished tail).
            values, _ = json_values(body[1:]) if body.startswith("[") else ([], False)
            calls = []
            for value in values:
                call = call_from_object(value, ("arguments", "parameters"))
                if call is None:
                    break
                calls.append(call)
        return calls or None if final else calls

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            f"[AVAILABLE_TOOLS] {json.dumps(tools, ensure_ascii=False)} [/AVAILABLE_TOOLS]\n"
            f'To call tools, answer with {_MARKER} [{{"name": ..., "arguments": {{...}}}}].'
        )

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return f"{_MARKER} {json.dumps(calls, ensure_ascii=False)}"

    def render_result(self, content: str) -> str:
        return f"[TOOL_RESULTS] {content} [/TOOL_RESULTS]"


def _parse_v11(section: str) -> list[ParsedToolCall]:
    calls: list[ParsedToolCall] = []
    for part in section.split(_MARKER)[1:]:
        name, sep, args = part.partition(_ARGS)
        match = _NAME.match(name)
        if not sep or match is None:
            break
        values, _ = json_values(args)
        if not values or not isinstance(values[0], dict):
            break
        calls.append(ParsedToolCall(match.group(1), arguments_text(values[0])))
    return calls
