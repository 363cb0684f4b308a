"""Function calling on chat completions: which tools a request offers and how they reach the
prompt, what `tool_choice` forces, and how an answer becomes OpenAI's `tool_calls`.

- `auto`: the tools go into the prompt (through the chat template when it knows tools, else as
  a system prompt in the parser's format) and the free output is parsed by the model's parser.
- `required` / a named function: the output is constrained by the grammar engine to a JSON array
  of `{"name", "parameters"}` (one of the tools, at least one call; at most one without
  `parallel_tool_calls`) / to the named function's arguments schema, as vLLM does, so the answer
  always parses whatever the model's own format is.
- `none` (or no tools): tools are left out of the prompt and nothing is parsed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from model_server.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
)
from model_server.entrypoints.openai.tool_parsers import ToolCallStream, ToolParser
from model_server.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    call_from_object,
    json_values,
    new_call_id,
)
from model_server.structured_output.params import StructuredOutputError, StructuredOutputsParams

Mode = Literal["none", "auto", "required", "named"]

# The arguments schema of a function declared without `parameters`.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(slots=True)
class ToolPlan:
    mode: Mode
    tools: list[dict[str, Any]] = field(default_factory=list)
    named: str | None = None
    parallel: bool = True

    @property
    def parses_output(self) -> bool:
        return self.mode != "none"

    def constraint(self) -> tuple[str, dict[str, Any]] | None:
        """The grammar that `required` and a named function impose ("tool_choice", kwargs)."""
        if self.mode == "named":
            return ("tool_choice", {"json": _parameters(self._tool(self.named))})
        if self.mode != "required":
            return None
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": _parameters(t),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": items[0] if len(items) == 1 else {"anyOf": items},
        }
        if not self.parallel:
            schema["maxItems"] = 1
        return ("tool_choice", {"json": schema})

    def _tool(self, name: str | None) -> dict[str, Any]:
        return next(t for t in self.tools if t["function"]["name"] == name)

    # ---- answers --------------------------------------------------------------------------

    def extract(self, parser: ToolParser, text: str) -> ExtractedToolCalls:
        if self.mode == "named":
            values, whole = json_values(text)
            if whole and len(values) == 1 and isinstance(values[0], dict):
                return ExtractedToolCalls(None, [ParsedToolCall(self.named or "", text.strip())])
            return ExtractedToolCalls(text, [])
        result = _REQUIRED.extract(text) if self.mode == "required" else parser.extract(text)
        if not self.parallel:
            result.calls = result.calls[:1]  # the grammar holds `required` to one already
        return result

    def stream(self, parser: ToolParser) -> ToolDeltas:
        if self.mode == "named":
            return ToolDeltas(None, self.named)
        calls = ToolCallStream(_REQUIRED if self.mode == "required" else parser)
        return ToolDeltas(calls, max_calls=None if self.parallel else 1)

    def finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        """OpenAI's: `tool_calls` when the model chose to call (auto, required); a named
        function keeps `stop`."""
        if has_calls and reason == "stop" and self.mode != "named":
            return "tool_calls"
        return reason


def plan_tools(request: ChatCompletionRequest) -> ToolPlan:
    """The request's tool plan; 400s naming the field for unknown tools and bad schemas."""
    tools = [t.model_dump(exclude_none=True) for t in request.tools or ()]
    choice = request.tool_choice
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise APIError(f"tools: the function name {dup!r} is given twice", 400, param="tools")
    for i, tool in enumerate(tools):
        params = tool["function"].get("parameters")
        if params is not None:
            try:
                StructuredOutputsParams(json=params)
            except StructuredOutputError as exc:
                where = f"tools[{i}].function.parameters"
                raise APIError(f"{where}: {exc}", 400, param=where) from None
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            offered = ", ".join(names) if names else "none"
            raise APIError(
                f"tool_choice names the function {choice.function.name!r}, which is not among "
                f"the tools (offered: {offered})",
                400,
                param="tool_choice",
            )
        return ToolPlan("named", tools, choice.function.name, request.parallel_tool_calls)
    if choice == "required" and not tools:
        raise APIError("tool_choice 'required' needs tools", 400, param="tool_choice")
    if not tools or choice == "none":
        return ToolPlan("none")
    return ToolPlan(choice or "auto", tools, None, request.parallel_tool_calls)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or _NO_PARAMETERS


class _RequiredCallsParser(ToolParser):
    """The JSON array that `tool_choice: required` constrains the output to."""

    name = "required"
    markers = ("[",)
    at_start_only = True

    def parse_section(self, section: str, final: bool) -> list[ParsedToolCall] | None:
        values, _ = json_values(section.strip()[1:])
        calls: list[ParsedToolCall] = []
        for value in values:
            call = call_from_object(value, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
        return calls or None if final else calls

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:  # pragma: no cover - unused
        raise NotImplementedError

    def render_calls(self, calls: list[dict[str, Any]]) -> str:  # pragma: no cover - unused
        raise NotImplementedError


_REQUIRED = _RequiredCallsParser()


@dataclass(slots=True)
class ToolDeltas:
    """One streamed choice's deltas as OpenAI sends them: content, and per call a first delta
    with its `index`, `id`, `type` and `function.name`, then `function.arguments` pieces. Parsed
    calls come whole (one delta each, once complete); a named function's arguments are the
    whole output, so they stream token by token."""

    calls: ToolCallStream | None
    named: str | None = None
    # Without parallel_tool_calls, calls after the first are dropped (as in the whole answer).
    max_calls: int | None = None
    num_calls: int = 0

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        if self.calls is None:
            return "", self._named_delta(delta)
        content, calls = self.calls.feed(delta)
        return content, self._call_deltas(calls)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self.calls is None:
            return "", self._named_delta("") if self.num_calls == 0 else []
        content, calls = self.calls.finish()
        return content, self._call_deltas(calls)

    def _named_delta(self, delta: str) -> list[dict[str, Any]]:
        if self.num_calls:
            return [{"index": 0, "function": {"arguments": delta}}] if delta else []
        self.num_calls = 1
        return [
            {
                "index": 0,
                "id": new_call_id(),
                "type": "function",
                "function": {"name": self.named, "arguments": delta},
            }
        ]

    def _call_deltas(self, calls: list[ParsedToolCall]) -> list[dict[str, Any]]:
        deltas = []
        for call in calls:
            if self.max_calls is not None and self.num_calls >= self.max_calls:
                break
            deltas.append(
                {
                    "index": self.num_calls,
                    "id": new_call_id(),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            )
            self.num_calls += 1
        return deltas


# ------------------------------------------------------------------------------ prompts


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def conversation(
    messages: list[ChatMessage], plan: ToolPlan, parser: ToolParser, chat_template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages as the chat template gets them, and extra template arguments (`tools`).

    A template that knows tools gets OpenAI's tool objects and HF's message shapes (assistant
    `tool_calls` with dict arguments, `tool` turns). Any other template gets plain turns: the
    tools described in the system prompt, calls written in the parser's format, tool results as
    user turns (templates without tools often refuse unknown roles)."""
    knows = template_knows_tools(chat_template)
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.template_role
        text = m.text()
        calls = [
            {"name": c.function.name, "arguments": _arguments_dict(c.function.arguments)}
            for c in m.tool_calls or ()
        ]
        if knows:
            msg: dict[str, Any] = {"role": role, "content": text}
            if calls:
                msg["tool_calls"] = [
                    {"id": c.id or new_call_id(), "type": "function", "function": f}
                    for c, f in zip(m.tool_calls or (), calls, strict=True)
                ]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None and role == "tool":
                msg["name"] = m.name
            out.append(msg)
            continue
        if role == "tool":
            out.append({"role": "user", "content": parser.render_result(text)})
        elif calls:
            rendered = parser.render_calls(calls)
            out.append({"role": role, "content": f"{text}\n{rendered}" if text else rendered})
        else:
            out.append({"role": role, "content": text})
    extra: dict[str, Any] = {}
    if plan.mode != "none":
        if knows:
            extra["tools"] = plan.tools
        else:
            prompt = parser.tools_prompt(plan.tools)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
            else:
                out.insert(0, {"role": "system", "content": prompt})
    return out, extra


def _arguments_dict(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def tool_call_objects(calls: list[ParsedToolCall]) -> list[dict[str, Any]]:
    """`message.tool_calls` of a non-streamed answer."""
    return [
        {
            "id": new_call_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]
