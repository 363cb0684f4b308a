"""The langchain connector: `ChatPromptTemplate | WickChatModel | StrOutputParser()`.

`WickChatModel` is a langchain-core chat model of our own over the model server's OpenAI API
(sync paths with httpx.Client, async paths with httpx.AsyncClient, both streaming and not), so
the service needs only langchain-core. It shares upstream.py's error mapping and SSE parsing
with the generic connector: for the same request both send the same body and give the same text.
It does function calling the langchain way: `bind_tools` (tools and `tool_choice` in the
request, `AIMessage.tool_calls` / `tool_call_chunks` back, `ToolMessage`s sent as `tool` turns)
and `with_structured_output` (a forced tool call, or `response_format` with
`method="json_schema"`). Requests that carry tools go through the chain without the string
parser, so their calls reach the client.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing
from typing import Any

import httpx
from langchain_core.callbacks import (
    AsyncCallbackHandler,
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ToolMessage,
)
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser, StrOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult, LLMResult
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr

from microservice import safe_json
from microservice.connectors.base import Connector
from microservice.protocol import GenerationRequest
from microservice.upstream import (
    CHAT_PATH,
    LIMITS,
    Completion,
    ModelServer,
    Piece,
    auth_headers,
    error_from_response,
    iter_pieces,
    map_transport_error,
    parse_completion,
    stream_chat,
    timeouts,
)

_ROLES = {"system": "system", "human": "user", "ai": "assistant"}


def _to_openai(message: BaseMessage) -> dict[str, Any]:
    role = getattr(message, "role", None) or _ROLES.get(message.type)
    if isinstance(message, ToolMessage):
        role = "tool"
    if role is None:
        raise ValueError(f"{message.type} messages are not supported by the model server")
    content = message.content
    if not isinstance(content, str):
        content = "".join(
            part if isinstance(part, str) else str(part.get("text", "")) for part in content
        )
    out: dict[str, Any] = {"role": role, "content": content}
    if isinstance(message, ToolMessage):
        out["tool_call_id"] = message.tool_call_id
    elif isinstance(message, AIMessage) and message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["args"])},
            }
            for call in message.tool_calls
        ]
    return out


def _ai_message(text: str, calls: list[dict[str, Any]] | None) -> AIMessage:
    """An AIMessage with OpenAI's `tool_calls` as langchain's (arguments parsed; calls whose
    arguments are not a JSON object kept as invalid ones)."""
    valid, invalid = [], []
    for call in calls or ():
        function = call.get("function") or {}
        name, arguments = function.get("name"), function.get("arguments") or "{}"
        try:
            args = arguments if isinstance(arguments, dict) else safe_json.loads(arguments)
        except ValueError as exc:
            invalid.append(
                invalid_tool_call(name=name, args=arguments, id=call.get("id"), error=str(exc))
            )
            continue
        if not isinstance(args, dict):
            invalid.append(
                invalid_tool_call(
                    name=name,
                    args=arguments,
                    id=call.get("id"),
                    error="arguments are not an object",
                )
            )
            continue
        valid.append(tool_call(name=name, args=args, id=call.get("id")))
    return AIMessage(content=text, tool_calls=valid, invalid_tool_calls=invalid)


def _tool_choice(choice: Any, tools: list[dict[str, Any]]) -> Any:
    """langchain's tool_choice spellings as OpenAI's: "any"/True -> "required" (True with one
    tool: that tool), a bare function name -> the named-function object."""
    if choice is None or isinstance(choice, dict):
        return choice
    if choice is True:
        if len(tools) == 1:
            return {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
        return "required"
    if choice is False:
        return "none"
    if choice == "any":
        return "required"
    if choice in ("auto", "none", "required"):
        return choice
    return {"type": "function", "function": {"name": choice}}


class WickChatModel(BaseChatModel):
    """A chat model served by an OpenAI-compatible `/v1/chat/completions` (the Wick model
    server). Call-time kwargs (e.g. from `.bind(top_k=10)`) are sent as request fields."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    base_url: str = "http://localhost:8008"
    model: str | None = None
    api_key: SecretStr | None = None
    connect_timeout: float = 1.5
    read_timeout: float = 300.0
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    # Clients to share (the connector passes its pool); made on first use when not given.
    http_client: httpx.Client | None = Field(default=None, exclude=True)
    http_async_client: httpx.AsyncClient | None = Field(default=None, exclude=True)
    _own_client: httpx.Client | None = PrivateAttr(default=None)
    _own_async_client: httpx.AsyncClient | None = PrivateAttr(default=None)

    @property
    def _llm_type(self) -> str:
        return "wick-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "model": self.model, **self.model_kwargs}

    def _client_kwargs(self) -> dict[str, Any]:
        key = self.api_key.get_secret_value() if self.api_key is not None else None
        return {
            "base_url": self.base_url,
            "headers": auth_headers(key),
            "timeout": timeouts(self.connect_timeout, self.read_timeout),
            "limits": LIMITS,
        }

    def _sync(self) -> httpx.Client:
        if self.http_client is not None:
            return self.http_client
        if self._own_client is None:
            self._own_client = httpx.Client(**self._client_kwargs())
        return self._own_client

    def _async(self) -> httpx.AsyncClient:
        if self.http_async_client is not None:
            return self.http_async_client
        if self._own_async_client is None:
            self._own_async_client = httpx.AsyncClient(**self._client_kwargs())
        return self._own_async_client

    def _payload(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: dict[str, Any],
        stream: bool,
    ) -> dict[str, Any]:
        kwargs.pop("stream", None)
        kwargs.pop("ls_structured_output_format", None)  # langchain's tracing, not a field
        payload = {**self.model_kwargs, **{k: v for k, v in kwargs.items() if v is not None}}
        model = payload.pop("model", None) or self.model
        if model:
            payload["model"] = model
        if stop:
            payload["stop"] = stop
        payload["messages"] = [_to_openai(m) for m in messages]
        payload["stream"] = stream
        return payload

    @staticmethod
    def _result(completion: Completion) -> ChatResult:
        info: dict[str, Any] = {"finish_reason": completion.finish_reason}
        if completion.usage is not None:
            info["usage"] = completion.usage
        generation = ChatGeneration(
            message=_ai_message(completion.text, completion.tool_calls), generation_info=info
        )
        return ChatResult(generations=[generation])

    @staticmethod
    def _chunk(piece: Piece) -> ChatGenerationChunk:
        info = {"finish_reason": piece.finish_reason} if piece.finish_reason else None
        chunks = [
            tool_call_chunk(
                name=(call.get("function") or {}).get("name"),
                args=(call.get("function") or {}).get("arguments"),
                id=call.get("id"),
                index=call.get("index"),
            )
            for call in piece.tool_calls or ()
        ]
        message = AIMessageChunk(content=piece.text, tool_call_chunks=chunks)
        return ChatGenerationChunk(message=message, generation_info=info)

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: str | bool | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """This model with `tools` (langchain tools, pydantic models, functions or OpenAI tool
        dicts) sent on every request; `tool_choice` as langchain spells it ("any", a name,
        True) or as OpenAI does."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        choice = _tool_choice(tool_choice, formatted)
        if choice is not None:
            kwargs["tool_choice"] = choice
        return self.bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        include_raw: bool = False,
        method: str = "function_calling",
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Any]:
        """Answers parsed into `schema`: by a forced tool call (`function_calling`, langchain's
        default), or with `method="json_schema"` by `response_format` (the grammar engine
        constrains the text itself)."""
        if method != "json_schema":
            return super().with_structured_output(schema, include_raw=include_raw, **kwargs)
        if include_raw:
            raise ValueError("include_raw is supported with method='function_calling' only")
        json_schema = convert_to_json_schema(schema)
        name = json_schema.get("title", "response")
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": json_schema, "strict": True},
        }
        llm = self.bind(response_format=response_format)
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            return llm | PydanticOutputParser(pydantic_object=schema)
        return llm | JsonOutputParser()

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        payload = self._payload(messages, stop, kwargs, stream=False)
        try:
            response = self._sync().post(CHAT_PATH, json=payload)
        except httpx.HTTPError as exc:
            raise map_transport_error(exc, self.base_url) from exc
        if response.status_code != 200:
            raise error_from_response(
                response.status_code, response.content, response.headers.get("retry-after")
            )
        return self._result(parse_completion(response.content))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        payload = self._payload(messages, stop, kwargs, stream=False)
        try:
            response = await self._async().post(CHAT_PATH, json=payload)
        except httpx.HTTPError as exc:
            raise map_transport_error(exc, self.base_url) from exc
        if response.status_code != 200:
            raise error_from_response(
                response.status_code, response.content, response.headers.get("retry-after")
            )
        return self._result(parse_completion(response.content))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        payload = self._payload(messages, stop, kwargs, stream=True)
        yielded = False
        try:
            with self._sync().stream("POST", CHAT_PATH, json=payload) as response:
                if response.status_code != 200:
                    response.read()
                    raise error_from_response(
                        response.status_code, response.content, response.headers.get("retry-after")
                    )
                for piece in iter_pieces(response, self.base_url):
                    chunk = self._chunk(piece)
                    if run_manager is not None:
                        run_manager.on_llm_new_token(piece.text, chunk=chunk)
                    yielded = True
                    yield chunk
        except httpx.HTTPError as exc:
            raise map_transport_error(exc, self.base_url) from exc
        if not yielded:  # langchain rejects an empty stream; an empty answer is valid here
            yield self._chunk(Piece("", "stop"))

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        payload = self._payload(messages, stop, kwargs, stream=True)
        yielded = False
        # aclosing: however this generator ends, the upstream request is closed at once.
        async with aclosing(stream_chat(self._async(), payload, self.base_url)) as pieces:
            async for piece in pieces:
                chunk = self._chunk(piece)
                if run_manager is not None:
                    await run_manager.on_llm_new_token(piece.text, chunk=chunk)
                yielded = True
                yield chunk
        if not yielded:
            yield self._chunk(Piece("", "stop"))


class _FinishReason(AsyncCallbackHandler):
    """Hears the finish reason and usage that StrOutputParser drops (for OpenAI formats)."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.usage: dict[str, int] | None = None

    async def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        for generation in response.generations[0] if response.generations else ():
            info = generation.generation_info or {}
            self.reason = info.get("finish_reason") or self.reason
            self.usage = info.get("usage") or self.usage


# OPEA's two parts as a template; OpenAI message lists go in as they are.
_OPEA_PROMPT = ChatPromptTemplate.from_messages([("system", "{system}"), ("human", "{user}")])
_USER_PROMPT = ChatPromptTemplate.from_messages([("human", "{user}")])
_MESSAGES_PROMPT = ChatPromptTemplate.from_messages([MessagesPlaceholder("messages")])


class LangchainConnector(Connector):
    name = "langchain"

    def __init__(self, model_server: ModelServer) -> None:
        super().__init__(model_server)
        self.llm = WickChatModel(
            base_url=model_server.base_url,
            api_key=model_server.api_key,
            connect_timeout=model_server.connect_timeout,
            read_timeout=model_server.read_timeout,
            http_async_client=model_server.client,
        )
        self.parser = StrOutputParser()

    def chain(self, request: GenerationRequest) -> tuple[Runnable, dict[str, Any]]:
        """The runnable for `request` and its input. With tools, the chain ends at the model
        (its AIMessages carry the calls, which the string parser would drop)."""
        params = dict(request.params)
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]  # langchain's stop is a list
        llm = self.llm.bind(model=request.model, **params)
        opea = request.opea
        if opea is not None:
            prompt = _OPEA_PROMPT if opea.system else _USER_PROMPT
            inputs: dict[str, Any] = {"system": opea.system, "user": opea.user}
        else:
            prompt, inputs = (
                _MESSAGES_PROMPT,
                {"messages": [_to_langchain(m) for m in request.messages]},
            )
        if _wants_messages(request):
            return prompt | llm, inputs
        return prompt | llm | self.parser, inputs

    async def answer(self, request: GenerationRequest) -> Completion:
        chain, inputs = self.chain(request)
        finish = _FinishReason()
        result = await chain.ainvoke(inputs, config={"callbacks": [finish]})
        if isinstance(result, AIMessage):
            text = result.content if isinstance(result.content, str) else ""
            calls = _openai_calls(result)
            return Completion(text, finish.reason, finish.usage, calls or None)
        return Completion(result, finish.reason, finish.usage)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[Piece]:
        chain, inputs = self.chain(request)
        finish = _FinishReason()
        # aclosing: an early close reaches WickChatModel._astream, which closes the request.
        async with aclosing(chain.astream(inputs, config={"callbacks": [finish]})) as items:
            async for item in items:
                if isinstance(item, AIMessageChunk):
                    text = item.content if isinstance(item.content, str) else ""
                    calls = [
                        {
                            "index": c.get("index"),
                            **({"id": c["id"], "type": "function"} if c.get("id") else {}),
                            "function": {
                                k: v
                                for k, v in (("name", c.get("name")), ("arguments", c.get("args")))
                                if v is not None
                            },
                        }
                        for c in item.tool_call_chunks
                    ]
                    if text or calls:
                        yield Piece(text, None, calls or None)
                elif item:
                    yield Piece(item)
        yield Piece("", finish.reason or "stop")


def _wants_messages(request: GenerationRequest) -> bool:
    return any(request.params.get(name) is not None for name in ("tools", "tool_choice"))


def _to_langchain(message: dict[str, Any]) -> Any:
    """An OpenAI message for the prompt template: plain (role, content) pairs stay tuples, as
    before; assistant tool calls and tool results become langchain messages."""
    role, content = message["role"], message.get("content") or ""
    if role == "tool":
        return ToolMessage(content=content, tool_call_id=message.get("tool_call_id") or "")
    if role == "assistant" and message.get("tool_calls"):
        return _ai_message(content, message["tool_calls"])
    return message


def _openai_calls(message: AIMessage) -> list[dict[str, Any]]:
    return [
        {
            "id": call.get("id"),
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["args"])},
        }
        for call in message.tool_calls
    ]
