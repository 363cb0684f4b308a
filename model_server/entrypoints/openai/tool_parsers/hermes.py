"""Hermes-style calls, used by Qwen2.5/Qwen3 and SmolLM2's tool prompts:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call; tool results come back as `<tool_response>...</tool_response>`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from model_server.entrypoints.openai.tool_parsers.base import (
    ParsedToolCall,
    ToolParser,
    call_from_object,
    json_values,
)

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = (_OPEN,)

    def parse_section(self, section: str, final: bool) -> list[ParsedToolCall] | None:
        # Streaming sees the closed blocks so far; the final answer adds a last block the model
        # did not close (it stopped at EOS or max_tokens). A block that does not parse ends the
        # calls, so the streamed calls are always a prefix of the final ones.
        calls: list[ParsedToolCall] = []
        end = 0
        for match in _BLOCK.finditer(section):
            call = _parse_block(match.group(1))
            if call is None:
                return calls or None if final else calls
            calls.append(call)
            end = match.end()
        tail = section[end:].strip()
        if final and tail.startswith(_OPEN):
            call = _parse_block(tail[len(_OPEN) :])
            if call is not None:
                calls.append(call)
        return calls or None if final else calls

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(
            f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls
        )


def _parse_block(body: str) -> ParsedToolCall | None:
    values, whole = json_values(body.strip())
    if not whole or len(values) != 1:
        return None
    return call_from_object(values[0], ("arguments", "parameters"))
