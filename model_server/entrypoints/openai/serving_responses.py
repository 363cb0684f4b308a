"""`POST /v1/responses`: OpenAI's Responses API, stateless, served as a chat completion.

A request becomes a `ChatCompletionRequest` (instructions -> a system turn, `input` items -> chat
turns, function tools and `text.format` -> chat's tools and response_format) and runs through
`OpenAIServingChat`, so tool calls, structured outputs and reasoning work as there; its answer
(or its stream of chunks) is then written as a Response object (or as Responses events).

Nothing is stored: `store: true`, `previous_response_id`, `conversation`, `background` and the
other stateful or hosted features are 400s naming the field. `reasoning` items of an input (a
previous output fed back) are left out of the prompt, as chat templates drop past thinking.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from model_server.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    ResponsesNamedToolChoice,
    ResponsesRequest,
)
from model_server.entrypoints.openai.serving_chat import OpenAIServingChat
from model_server.entrypoints.openai.serving_engine import json_response, to_api_error

# Chat fields -> the Responses fields they came from (error messages name the latter).
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")


def _refuse_stateful(request: ResponsesRequest) -> None:
    """400 for what needs state or hosted tools this server does not have."""
    refusals = {
        "store": (
            request.store is True,
            "store: true is not supported: this server is stateless and keeps no responses "
            "(send store: false or leave it out)",
        ),
        "previous_response_id": (
            request.previous_response_id is not None,
            "previous_response_id is not supported: this server is stateless and keeps no "
            "responses; send the earlier turns (and their output items) in `input`",
        ),
        "conversation": (
            request.conversation is not None,
            "conversation is not supported: this server keeps no conversations; send the turns "
            "in `input`",
        ),
        "background": (
            request.background is True,
            "background: true is not supported: answers are given in the request",
        ),
        "prompt": (
            request.prompt is not None,
            "prompt (a stored prompt template) is not supported: send `instructions` and `input`",
        ),
        "reasoning": (
            bool(request.reasoning) and any(v is not None for v in request.reasoning.values()),
            "reasoning options (effort, summary) are not supported: a reasoning model thinks "
            "by its chat template; send enable_thinking: false to turn the thinking off",
        ),
        "include": (
            bool(request.include),
            "include is not supported: the response carries everything it has",
        ),
        "truncation": (
            request.truncation == "auto",
            "truncation: auto is not supported: a prompt longer than the context is a 400",
        ),
        "top_logprobs": (
            bool(request.top_logprobs),
            "top_logprobs is not supported on /v1/responses: use /v1/chat/completions",
        ),
        "max_tool_calls": (
            request.max_tool_calls is not None,
            "max_tool_calls is not supported: use parallel_tool_calls: false for at most one",
        ),
    }
    for param, (refused, message) in refusals.items():
        if refused:
            raise APIError(message, 400, param=param)


def _text(content: Any, where: str) -> str:
    """A message's content (a string or text parts) as one string; 400 naming `where`."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}: must be a string or a list of text parts", 400, param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise APIError(
                f"{where}[{j}]: content part type {kind!r} is not supported: this model takes "
                "text only (input_text, output_text)",
                400,
                param="input",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise APIError(f"{where}[{j}].text: must be a string", 400, param="input")
        texts.append(text)
    return "\n".join(texts)


def _messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat turns of `instructions` and `input`."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
        return messages
    if not request.input:
        raise APIError("input: must not be an empty list", 400, param="input")
    for i, item in enumerate(request.input):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise APIError(
                    f"{where}.role: must be one of {', '.join(_ROLES)}, got {role!r}",
                    400,
                    param="input",
                )
            text = _text(item.get("content"), where + ".content")
            messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _field(item, "name", where),
                    "arguments": _field(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _field(item, "call_id", where),
                    "content": _text(output, where + ".output"),
                }
            )
        elif kind == "reasoning":
            continue  # past thinking stays out of the prompt, as chat templates do
        else:
            raise APIError(
                f"{where}.type: {kind!r} is not supported: send message, function_call, "
                "function_call_output (or reasoning, which is left out) items",
                400,
                param="input",
            )
    return messages


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(f"{where}.{name}: must be a string", 400, param="input")
    return value


def to_chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion that answers `request`."""
    _refuse_stateful(request)
    if request.max_output_tokens is not None and request.max_output_tokens < 1:
        raise APIError(
            f"max_output_tokens must be at least 1, got {request.max_output_tokens}",
            400,
            param="max_output_tokens",
        )
    body: dict[str, Any] = {
        "model": request.model,
        "messages": _messages(request),
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "parallel_tool_calls": request.parallel_tool_calls,
        "stream": request.stream,
        "user": request.user,
        "seed": request.seed,
        "top_k": request.top_k,
        "logit_bias": request.logit_bias,
        "enable_thinking": request.enable_thinking,
        "chat_template_kwargs": request.chat_template_kwargs,
    }
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    if request.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": tool.model_dump(exclude_none=True, exclude={"type"}),
            }
            for tool in request.tools
        ]
    choice = request.tool_choice
    if isinstance(choice, ResponsesNamedToolChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name or "response", "schema": fmt.json_schema}
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    try:
        given = {k: v for k, v in body.items() if v is not None}
        return ChatCompletionRequest.model_validate(given)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(x) for x in err.get("loc", ())]
        where = ".".join([_PARAMS.get(loc[0], loc[0]), *loc[1:]]) if loc else "the request"
        message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        raise APIError(f"{where}: {message}", 400, param=where.split(".")[0]) from None


def _renamed(exc: APIError) -> APIError:
    """A chat error, with the Responses field names."""
    param = exc.param
    if param in _PARAMS:
        exc.message = exc.message.replace(param, _PARAMS[param], 1)
        exc.param = _PARAMS[param]
        exc.args = (exc.message,)
    return exc


def _usage(chat_usage: dict[str, int] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


@dataclass
class _Shell:
    """What every Response object of one request repeats (the request's settings)."""

    request: ResponsesRequest
    response_id: str
    model: str
    created_at: int = field(default_factory=lambda: int(time.time()))

    def __call__(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        r = self.request
        choice = r.tool_choice
        fmt = r.text.format if r.text is not None and r.text.format is not None else None
        incomplete = status == "incomplete"
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": r.temperature,
            "text": {
                "format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt is not None
                else {"type": "text"}
            },
            "tool_choice": choice.model_dump()
            if isinstance(choice, ResponsesNamedToolChoice)
            else (choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()],
            "top_p": r.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": r.user,
            "metadata": r.metadata or {},
        }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        chat_request = to_chat_request(request)
        given = raw_request.headers.get("x-request-id")
        response_id = f"resp_{given or uuid.uuid4().hex}"
        shell = _Shell(request, response_id, self.chat.model_name)
        try:
            answer = await self.chat.create_chat_completion(chat_request, raw_request)
        except APIError as exc:
            raise _renamed(exc) from None
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(
                self._events(shell, answer.body_iterator), media_type="text/event-stream"
            )
        return json_response(self._response(shell, json.loads(answer.body)))

    @staticmethod
    def _response(shell: _Shell, body: dict[str, Any]) -> dict[str, Any]:
        choice = body["choices"][0]
        message = choice["message"]
        output: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            output.append(_reasoning_item(_item_id("rs"), message["reasoning_content"]))
        calls = message.get("tool_calls") or []
        content = message.get("content")
        if content or (content is not None and not calls):
            output.append(_message_item(_item_id("msg"), content))
        for call in calls:
            function = call["function"]
            output.append(
                _call_item(
                    _item_id("fc"), call["id"], function["name"], function["arguments"], "completed"
                )
            )
        reason = choice["finish_reason"]
        return shell(_status(reason), output, _usage(body.get("usage")))

    async def _events(
        self, shell: _Shell, chunks: AsyncIterator[str | bytes]
    ) -> AsyncGenerator[str, None]:
        writer = _EventWriter(shell)
        try:
            for event in writer.start():
                yield event
            async for raw in chunks:
                text = raw.decode() if isinstance(raw, bytes) else raw
                for line in text.split("\n"):
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for event in writer.chunk(json.loads(line[len("data: ") :])):
                        yield event
            for event in writer.finish():
                yield event
        except Exception as exc:  # a bug of ours: still end the stream with an error event
            yield writer.error(to_api_error_safe(exc))
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()


def to_api_error_safe(exc: BaseException) -> APIError:
    try:
        return to_api_error(exc)
    except BaseException:
        return APIError(f"internal error: {type(exc).__name__}: {exc}", 500)


@dataclass
class _Open:
    """An output item being streamed."""

    kind: str  # "reasoning" | "message" | "function_call"
    index: int
    item_id: str
    text: str = ""
    call_id: str = ""
    name: str = ""


class _EventWriter:
    """Chat chunks -> Responses events (`event:` and `data:` lines, numbered)."""

    def __init__(self, shell: _Shell) -> None:
        self.shell = shell
        self.sequence = 0
        self.done: list[dict[str, Any]] = []  # finished output items, in order
        self.open: _Open | None = None
        self.calls: dict[int, _Open] = {}  # chat tool-call index -> its item
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.failed = False

    def _event(self, kind: str, **payload: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        response = self.shell("in_progress", [])
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        if "error" in chunk:
            error = chunk["error"]
            self.failed = True
            return [
                self._event(
                    "error",
                    code=error.get("code"),
                    message=error.get("message"),
                    param=error.get("param"),
                )
            ]
        if chunk.get("usage"):
            self.usage = _usage(chunk["usage"])
        events: list[str] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def _text(self, kind: str, delta: str, with_delta: bool = True) -> list[str]:
        events: list[str] = []
        current = self.open
        if current is None or current.kind != kind:
            events += self._close()
            current = self.open = _Open(kind, self._next_index(), _item_id(kind[:3]))
            if kind == "message":
                item = _message_item(current.item_id, "", "in_progress")
                item["content"] = []
                events.append(
                    self._event("response.output_item.added", output_index=current.index, item=item)
                )
                events.append(
                    self._event(
                        "response.content_part.added",
                        item_id=current.item_id,
                        output_index=current.index,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                    )
                )
            else:
                item = _reasoning_item(current.item_id, "")
                item.update(content=[], status="in_progress")
                events.append(
                    self._event("response.output_item.added", output_index=current.index, item=item)
                )
        if not with_delta:
            return events
        current.text += delta
        kind_event = "output_text" if kind == "message" else "reasoning_text"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(
            self._event(
                f"response.{kind_event}.delta",
                item_id=current.item_id,
                output_index=current.index,
                content_index=0,
                delta=delta,
                **extra,
            )
        )
        return events

    def _call(self, call: dict[str, Any]) -> list[str]:
        events: list[str] = []
        function = call.get("function") or {}
        index = call.get("index", 0)
        current = self.calls.get(index)
        if current is None:
            events += self._close()
            current = _Open(
                "function_call",
                self._next_index(),
                _item_id("fc"),
                call_id=call.get("id") or _item_id("call"),
                name=function.get("name") or "",
            )
            self.calls[index] = self.open = current
            item = _call_item(current.item_id, current.call_id, current.name, "", "in_progress")
            events.append(
                self._event("response.output_item.added", output_index=current.index, item=item)
            )
        arguments = function.get("arguments") or ""
        if arguments:
            current.text += arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=current.item_id,
                    output_index=current.index,
                    delta=arguments,
                )
            )
        return events

    def _next_index(self) -> int:
        return len(self.done)  # called once the open item (if any) is closed

    def _close(self) -> list[str]:
        current, self.open = self.open, None
        if current is None:
            return []
        at = {"item_id": current.item_id, "output_index": current.index}
        if current.kind == "message":
            item = _message_item(current.item_id, current.text)
            part = item["content"][0]
            events = [
                self._event(
                    "response.output_text.done",
                    **at,
                    content_index=0,
                    text=current.text,
                    logprobs=[],
                ),
                self._event("response.content_part.done", **at, content_index=0, part=part),
            ]
        elif current.kind == "reasoning":
            item = _reasoning_item(current.item_id, current.text)
            events = [
                self._event(
                    "response.reasoning_text.done", **at, content_index=0, text=current.text
                )
            ]
        else:
            item = _call_item(
                current.item_id, current.call_id, current.name, current.text, "completed"
            )
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    **at,
                    name=current.name,
                    arguments=current.text,
                )
            ]
        self.done.append(item)
        done = self._event("response.output_item.done", output_index=current.index, item=item)
        events.append(done)
        return events

    def finish(self) -> list[str]:
        if self.failed:
            return []
        events = self._close()
        if not self.done:  # an empty answer is still a message
            events += self._text("message", "", with_delta=False)
            events += self._close()
        status = _status(self.finish_reason)
        response = self.shell(status, self.done, self.usage)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        events.append(self._event(kind, response=response))
        return events

    def error(self, exc: APIError) -> str:
        self.failed = True
        return self._event("error", code=exc.code, message=exc.message, param=exc.param)
