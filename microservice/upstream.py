"""The model server's HTTP API as both connectors use it: clients with the right timeouts and
credentials, error mapping, SSE parsing, model discovery and the readiness probe.

Invariant: every failure leaves here as an `UpstreamError` (see errors.py), so the app maps
them to statuses (before a stream starts) or error events (after) without knowing httpx.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from microservice import safe_json
from microservice.errors import (
    UpstreamBroken,
    UpstreamError,
    UpstreamHTTPError,
    UpstreamStreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from microservice.request_id import forward_request_id

CHAT_PATH = "/v1/chat/completions"
TOKENIZE_PATH = "/tokenize"
# Statuses saying that the model server has no /tokenize (not Wick or vLLM): not asked again.
NO_ROUTE = frozenset({404, 405, 501})
# The chat fields that change how the model server renders (and so counts) the prompt.
TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
# Probes must answer fast even when the model server hangs.
HEALTH_TIMEOUT_S = 1.5

logger = logging.getLogger("microservice")


@dataclass(frozen=True)
class Piece:
    """A piece of the answer's text; the last one may carry only the finish reason."""

    text: str
    finish_reason: str | None = None
    # OpenAI's `delta.tool_calls` entries of this piece, as the model server sent them.
    tool_calls: list[dict[str, Any]] | None = None
    # A reasoning model's thinking (the model server's `delta.reasoning_content`).
    reasoning: str = ""


@dataclass(frozen=True)
class Completion:
    """A whole answer: its text, why it ended, the model server's token counts and the tool
    calls of `message.tool_calls` (OpenAI's objects)."""

    text: str
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # A reasoning model's thinking (`message.reasoning_content`), None when there was none.
    reasoning: str | None = None


def timeouts(connect: float, read: float) -> httpx.Timeout:
    # A full pool waits as long as a connect would: both mean "cannot reach it now" (503).
    return httpx.Timeout(read, connect=connect, pool=connect, write=read)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# Streams are long-lived: the default limit of 100 connections would queue the 101st stream.
LIMITS = httpx.Limits(max_connections=1024, max_keepalive_connections=64)


def map_transport_error(exc: httpx.HTTPError, base_url: str) -> UpstreamError:
    """An httpx failure as the error the client gets."""
    where = f"the model server at {base_url}"
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return UpstreamUnavailable(f"{where} is unreachable: {_why(exc)}")
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"{where} did not answer in time: {_why(exc)}")
    return UpstreamBroken(f"the connection to {where} broke: {_why(exc)}")


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def error_from_response(
    status: int, body: bytes, retry_after: str | None = None
) -> UpstreamHTTPError:
    """A non-200 answer: 4xx pass through (message, type, param, code), 503/504 stay, other
    5xx become 502. 401/403 mean our LLM_API_KEY is wrong, which is not the client's fault.
    A 503's (or 429's) `Retry-After` is passed on: the model server is overloaded or draining."""
    info = _error_info(body)
    message = info.get("message") or f"the model server answered HTTP {status}"
    kw = {"type": info.get("type"), "param": info.get("param"), "code": info.get("code")}
    if status in (401, 403):
        return UpstreamHTTPError(
            f"the model server refused this service's credentials (check LLM_API_KEY): {message}",
            502,
            upstream_status=status,
            code="model_server_auth",
        )
    if 400 <= status < 500:
        error = UpstreamHTTPError(message, status, upstream_status=status, **kw)
        error.retry_after = retry_after if status == 429 else None
        return error
    if status in (503, 504):
        error = UpstreamHTTPError(
            f"the model server is not ready: {message}",
            status,
            upstream_status=status,
            code=kw["code"] or "model_server_unavailable",
        )
        error.retry_after = retry_after if status == 503 else None
        return error
    return UpstreamHTTPError(
        f"the model server failed (HTTP {status}): {message}", 502, upstream_status=status
    )


def _error_info(body: bytes) -> dict[str, Any]:
    try:
        data = safe_json.loads(body)
    except ValueError:
        text = body.decode("utf-8", "replace").strip()
        return {"message": text[:500]} if text else {}
    if isinstance(data, dict):
        if isinstance(data.get("error"), dict):
            return data["error"]
        for key in ("message", "detail", "error"):
            if isinstance(data.get(key), str):
                return {"message": data[key]}
    return {"message": json.dumps(data)[:500]}


DONE = object()


def parse_sse_line(line: str) -> Any:
    """One SSE line: a chunk dict, DONE, or None (blank, comment, other fields). An error
    event raises UpstreamStreamError."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return DONE
    try:
        payload = safe_json.loads(data)
    except ValueError:
        raise UpstreamBroken(f"the model server sent an unreadable event: {data[:200]!r}") from None
    if isinstance(payload, dict) and "error" in payload:
        err = payload["error"]
        info = err if isinstance(err, dict) else {"message": str(err)}
        raise UpstreamStreamError(
            f"the model server failed mid-stream: {info.get('message', err)}", info.get("code")
        )
    if not isinstance(payload, dict):
        raise UpstreamBroken(f"the model server sent an unexpected event: {data[:200]!r}")
    return payload


def chunk_piece(chunk: dict[str, Any]) -> Piece | None:
    """The first choice's delta of an OpenAI chat chunk (None: nothing in it). A chunk of
    another shape raises UpstreamBroken."""
    try:
        return _first_delta(chunk)
    except (KeyError, IndexError, TypeError, AttributeError):
        shown = json.dumps(chunk)[:200]
        raise UpstreamBroken(f"the model server sent an unexpected event: {shown}") from None


def _first_delta(chunk: dict[str, Any]) -> Piece | None:
    choices = chunk.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    delta = choice.get("delta") or {}
    text = delta.get("content") or ""
    if not isinstance(text, str):
        raise TypeError("content is not a string")
    tool_calls = checked_tool_calls(delta.get("tool_calls"), delta=True)
    reasoning = _reasoning(delta) or ""
    reason = choice.get("finish_reason")
    if not (text or reason or tool_calls or reasoning):
        return None
    return Piece(text, reason, tool_calls, reasoning)


def _reasoning(body: dict[str, Any]) -> str | None:
    """The thinking of a message or delta: vLLM's `reasoning_content`, or its newer
    `reasoning`; TypeError when it is not a string."""
    value = body.get("reasoning_content")
    if value is None:
        value = body.get("reasoning")
    if not isinstance(value, str | None):
        raise TypeError("reasoning_content is not a string")
    return value


def checked_tool_calls(calls: Any, *, delta: bool) -> list[dict[str, Any]] | None:
    """OpenAI's `tool_calls` (None when empty), else TypeError: objects whose `function` is an
    object with a string `name` (optional in a stream's deltas, which may carry only more
    `arguments`) and `arguments` a string (or, in a whole message, an object)."""
    if not calls:
        return None
    if not isinstance(calls, list):
        raise TypeError("tool_calls is not a list")
    arguments_types = str | None if delta else str | dict | None
    for call in calls:
        if not isinstance(call, dict):
            raise TypeError("a tool call is not an object")
        function = call.get("function") or ({} if delta else None)
        if not isinstance(function, dict):
            raise TypeError("a tool call has no function object")
        name = function.get("name")
        if not isinstance(name, str) and not (delta and name is None):
            raise TypeError("a tool call's function has no name")
        if not isinstance(function.get("arguments"), arguments_types):
            raise TypeError("a tool call's arguments are not a string")
        if not isinstance(call.get("id"), str | None):
            raise TypeError("a tool call's id is not a string")
        if not isinstance(call.get("index"), int | None):
            raise TypeError("a tool call's index is not an integer")
    return calls


def parse_completion(body: bytes) -> Completion:
    """A non-streaming chat completion's first choice and usage."""
    try:
        data = safe_json.loads(body)
        choice = data["choices"][0]
        text = choice["message"]["content"] or ""
        tool_calls = checked_tool_calls(choice["message"].get("tool_calls"), delta=False)
        reasoning = _reasoning(choice["message"])
        if not isinstance(text, str):
            raise TypeError("content is not a string")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise UpstreamBroken(
            f"the model server sent an unexpected answer: {body[:200]!r}"
        ) from None
    usage = data.get("usage")
    return Completion(
        text,
        choice.get("finish_reason"),
        usage if isinstance(usage, dict) else None,
        tool_calls if isinstance(tool_calls, list) else None,
        reasoning,
    )


def is_model_not_found(exc: UpstreamError) -> bool:
    """The model server's 404 for a model it does not serve (Wick's and vLLM's)."""
    if not isinstance(exc, UpstreamHTTPError) or exc.upstream_status != 404:
        return False
    message = exc.message.lower()
    named = "model" in message and "not exist" in message
    return exc.code == "model_not_found" or exc.param == "model" or named


async def aiter_pieces(response: httpx.Response, base_url: str) -> AsyncIterator[Piece]:
    """The pieces of a streamed chat completion, until `[DONE]`."""
    try:
        async for line in response.aiter_lines():
            item = parse_sse_line(line)
            if item is DONE:
                return
            if item is not None and (piece := chunk_piece(item)) is not None:
                yield piece
    except httpx.HTTPError as exc:
        raise map_transport_error(exc, base_url) from exc
    raise UpstreamBroken("the model server ended the stream without [DONE]")


def iter_pieces(response: httpx.Response, base_url: str) -> Iterator[Piece]:
    """The sync twin of `aiter_pieces`."""
    try:
        for line in response.iter_lines():
            item = parse_sse_line(line)
            if item is DONE:
                return
            if item is not None and (piece := chunk_piece(item)) is not None:
                yield piece
    except httpx.HTTPError as exc:
        raise map_transport_error(exc, base_url) from exc
    raise UpstreamBroken("the model server ended the stream without [DONE]")


async def post_chat(client: httpx.AsyncClient, payload: dict[str, Any], base_url: str) -> str:
    """The text of a non-streaming chat completion."""
    return (await post_completion(client, payload, base_url)).text


async def post_completion(
    client: httpx.AsyncClient, payload: dict[str, Any], base_url: str
) -> Completion:
    """A non-streaming chat completion."""
    try:
        response = await client.post(CHAT_PATH, json=payload)
    except httpx.HTTPError as exc:
        raise map_transport_error(exc, base_url) from exc
    if response.status_code != 200:
        raise error_from_response(
            response.status_code, response.content, response.headers.get("retry-after")
        )
    return parse_completion(response.content)


# Pump tasks run unawaited: the event loop holds tasks weakly, so they are held here.
_PUMPS: set[asyncio.Task[None]] = set()
_END = object()


async def stream_chat(
    client: httpx.AsyncClient, payload: dict[str, Any], base_url: str
) -> AsyncIterator[Piece]:
    """The pieces of a streamed chat completion; the request is sent on the first `__anext__`.

    The HTTP exchange runs in a task of its own, which this generator cancels exactly once when
    it ends early (closed, cancelled, garbage-collected). The reason: a caller can be cancelled
    over and over (anyio cancel scopes, as in Starlette, re-cancel a task until it leaves the
    scope, and langchain runs each step in a new task where anyio's shields do not apply), and a
    second cancellation landing while httpcore closes the connection leaves it open: the model
    server would keep generating for nobody.
    """
    queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=16)
    pump = asyncio.create_task(_pump(client, payload, base_url, queue))
    _PUMPS.add(pump)
    pump.add_done_callback(_PUMPS.discard)
    try:
        while (item := await queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        pump.cancel()  # a no-op once it has finished


async def _pump(
    client: httpx.AsyncClient, payload: dict[str, Any], base_url: str, queue: asyncio.Queue[Any]
) -> None:
    try:
        # `async with`: a cancelled, unfinished response closes its connection.
        async with client.stream("POST", CHAT_PATH, json=payload) as response:
            if response.status_code != 200:
                await response.aread()
                raise error_from_response(
                    response.status_code, response.content, response.headers.get("retry-after")
                )
            async for piece in aiter_pieces(response, base_url):
                await queue.put(piece)
    except httpx.HTTPError as exc:
        await queue.put(map_transport_error(exc, base_url))
    except Exception as exc:  # UpstreamError, or a bug: the consumer raises it
        await queue.put(exc)
    else:
        await queue.put(_END)


class ModelServer:
    """The shared async client (connection pool) plus model discovery and the probe."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        connect_timeout: float = 1.5,
        read_timeout: float = 300.0,
        model_name: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.configured_model = model_name
        self._discovered: str | None = None
        # Names the model server does not serve -> the model serving them (see `substitute`).
        self._substitutes: dict[str, str] = {}
        self._can_tokenize = True
        self.client = httpx.AsyncClient(
            base_url=base_url,
            headers=auth_headers(api_key),
            timeout=timeouts(connect_timeout, read_timeout),
            limits=LIMITS,
            transport=transport,
            event_hooks={"request": [forward_request_id]},
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    async def resolve_model(self, requested: str | None) -> str:
        """LLM_MODEL_NAME, else the request's `model` (or what `substitute` chose for it), else
        the model server's first model (asked once, then remembered)."""
        name = self.configured_model or requested
        if name:
            return self._substitutes.get(name, name)
        if self._discovered:
            return self._discovered
        self._discovered = (await self.served_models())[0]
        return self._discovered

    async def served_models(self) -> list[str]:
        """The ids /v1/models lists (at least one, else UpstreamBroken)."""
        try:
            response = await self.client.get("/v1/models", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            raise map_transport_error(exc, self.base_url) from exc
        if response.status_code != 200:
            raise error_from_response(response.status_code, response.content)
        try:
            models = [str(entry["id"]) for entry in safe_json.loads(response.content)["data"]]
        except (ValueError, KeyError, TypeError):
            models = []
        if not models:
            raise UpstreamBroken(
                f"the model server's /v1/models lists no model: {response.text[:200]!r}"
            )
        return models

    async def substitute(self, name: str) -> str | None:
        """The model to serve requests naming `name` with, after the model server answered
        that it does not serve `name`: its only model (OPEA's microservice sends every request
        to the one model it serves). Remembered, so the warning comes once per name. None when
        it serves several models (which one was meant cannot be told) or lists `name` itself."""
        models = await self.served_models()
        if len(models) != 1 or models[0] == name:
            return None
        self._substitutes[name] = models[0]
        logger.warning(
            "the model server does not serve %r: requests naming it are served by %r "
            "(set LLM_STRICT_MODEL_NAME=true to answer 404 instead; logged once per name)",
            name,
            models[0],
        )
        return models[0]

    async def completion_room(
        self, model: str, messages: list[dict[str, str]], params: dict[str, Any]
    ) -> int | None:
        """How many tokens the model server's context leaves after this chat's prompt
        (`max_model_len` minus the prompt's tokens, both from its /tokenize, which renders the
        same chat template the chat endpoint does); None when it cannot tell. Transport
        failures raise, as the chat request itself would."""
        if not self._can_tokenize:
            return None
        body: dict[str, Any] = {"model": model, "messages": messages}
        body.update({name: params[name] for name in TEMPLATE_FIELDS if name in params})
        if params.get("enable_thinking") is not None:  # the chat endpoint's shortcut
            kwargs = {**body.get("chat_template_kwargs", {})}
            kwargs.setdefault("enable_thinking", params["enable_thinking"])
            body["chat_template_kwargs"] = kwargs
        try:
            response = await self.client.post(TOKENIZE_PATH, json=body)
        except httpx.HTTPError as exc:
            raise map_transport_error(exc, self.base_url) from exc
        if response.status_code == 404:
            error = error_from_response(404, response.content)
            if is_model_not_found(error):
                raise error  # the chat request would get the same: the app may substitute
        if response.status_code in NO_ROUTE:
            self._can_tokenize = False
            return None
        if response.status_code != 200:
            return None  # the chat request will answer the same problem with its own status
        return _room(response)

    async def probe(self) -> dict[str, Any]:
        """The model server's readiness, as reported by its /health (never raises)."""
        state: dict[str, Any] = {"endpoint": self.base_url}
        started = time.monotonic()
        try:
            response = await self.client.get("/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            reason = map_transport_error(exc, self.base_url).message
            return {**state, "ready": False, "status": "unreachable", "detail": reason}
        state["latency_seconds"] = round(time.monotonic() - started, 4)
        state["http_status"] = response.status_code
        try:
            body = safe_json.loads(response.content)
        except ValueError:
            body = {}
        if isinstance(body, dict) and body.get("phase"):
            state["phase"] = body["phase"]
        if response.status_code != 200:
            detail = body.get("message") if isinstance(body, dict) else None
            return {**state, "ready": False, "status": "not_ready", "detail": detail}
        # /health is open on the model server: a wrong or missing LLM_API_KEY would still say
        # ready while every chat request fails, so ask the (authenticated) API once as well.
        try:
            models = await self.client.get("/v1/models", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            reason = map_transport_error(exc, self.base_url).message
            return {**state, "ready": False, "status": "unreachable", "detail": reason}
        if models.status_code in (401, 403):
            return {
                **state,
                "ready": False,
                "status": "unauthorized",
                "http_status": models.status_code,
                "detail": f"the model server refuses this service's key (LLM_API_KEY): "
                f"HTTP {models.status_code} on /v1/models",
            }
        return {**state, "ready": True, "status": "ready"}


def _room(response: httpx.Response) -> int | None:
    """max_model_len - count of a /tokenize answer; None when either is missing."""
    try:
        body = safe_json.loads(response.content)
        count, max_model_len = body["count"], body["max_model_len"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(count, int) or not isinstance(max_model_len, int):
        return None
    return max_model_len - count


def default_limit(default: int, room: int | None) -> int | None:
    """The token limit to send for a default of `default` new tokens: at most what the context
    leaves (`room`). None (send no limit) when the prompt leaves no room, so that the model
    server's own "prompt too long" message answers instead of one about a limit the client
    never chose."""
    if room is None:
        return default
    if room < 1:
        return None
    return min(default, room)
