"""Llama 3.1/3.2's JSON tool calls: the whole answer is one or more JSON objects

    {"name": "get_weather", "parameters": {"city": "Paris"}}

separated by `;`, optionally after `<|python_tag|>`; tool results come back in the `ipython`
role, which templates without tools do not know, so they are user turns here.
"""

from __future__ import annotations

import json
from typing import Any

from model_server.entrypoints.openai.tool_parsers.base import (
    ParsedToolCall,
    ToolParser,
    call_from_object,
    json_values,
)

_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = (_PYTHON_TAG, "{")
    at_start_only = True

    def parse_section(self, section: str, final: bool) -> list[ParsedToolCall] | None:
        body = section.strip().removeprefix(_PYTHON_TAG)
        values, _ = json_values(body, " \t\r\n;")
        calls: list[ParsedToolCall] = []
        for value in values:  # complete objects only: stable once seen
            call = call_from_object(value, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
        return calls or None if final else calls

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        signatures = "\n\n".join(json.dumps(t, ensure_ascii=False, indent=4) for t in tools)
        return (
            "Given the following functions, please respond with a JSON for a function call "
            "with its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}. Do not use variables.\n\n"
            f"{signatures}"
        )

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(
            json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
            for c in calls
        )

    def render_result(self, content: str) -> str:
        return content
