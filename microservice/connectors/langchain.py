"""The langchain connector: `ChatPromptTemplate | WickChatModel | StrOutputParser()`.

`WickChatModel` is a langchain-core chat model of our own over the model server's OpenAI API
(sync paths with httpx.Client, async paths with httpx.AsyncClient, both streaming and not), so
the service needs only langchain-core. It shares upstream.py's error mapping and SSE parsing
with the generic connector: for the same request both send the same body and give the same text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

import httpx
from langchain_core.callbacks import (
    AsyncCallbackHandler,
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult, LLMResult
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables import Runnable
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr

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


def _to_openai(message: BaseMessage) -> dict[str, str]:
    role = getattr(message, "role", None) or _ROLES.get(message.type)
    if role is None:
        raise ValueError(f"{message.type} messages are not supported by the model server")
    content = message.content
    if not isinstance(content, str):
        content = "".join(
            part if isinstance(part, str) else str(part.get("text", "")) for part in content
        )
    return {"role": role, "content": content}


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
            message=AIMessage(content=completion.text), generation_info=info
        )
        return ChatResult(generations=[generation])

    @staticmethod
    def _chunk(piece: Piece) -> ChatGenerationChunk:
        info = {"finish_reason": piece.finish_reason} if piece.finish_reason else None
        return ChatGenerationChunk(message=AIMessageChunk(content=piece.text), generation_info=info)

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
        """The runnable for `request` and its input."""
        params = dict(request.params)
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]  # langchain's stop is a list
        llm = self.llm.bind(model=request.model, **params)
        opea = request.opea
        if opea is not None:
            prompt = _OPEA_PROMPT if opea.system else _USER_PROMPT
            inputs: dict[str, Any] = {"system": opea.system, "user": opea.user}
        else:
            prompt, inputs = _MESSAGES_PROMPT, {"messages": request.messages}
        return prompt | llm | self.parser, inputs

    async def answer(self, request: GenerationRequest) -> Completion:
        chain, inputs = self.chain(request)
        finish = _FinishReason()
        text = await chain.ainvoke(inputs, config={"callbacks": [finish]})
        return Completion(text, finish.reason, finish.usage)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[Piece]:
        chain, inputs = self.chain(request)
        finish = _FinishReason()
        # aclosing: an early close reaches WickChatModel._astream, which closes the request.
        async with aclosing(chain.astream(inputs, config={"callbacks": [finish]})) as texts:
            async for text in texts:
                if text:
                    yield Piece(text)
        yield Piece("", finish.reason or "stop")
