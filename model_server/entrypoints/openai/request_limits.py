"""What one request may make the server do, checked before any templating or tokenizing.

- `BodySizeLimitMiddleware`: 413 for a body over --max-request-body-size, never read whole.
- `RequestLimits`: prompts, stop strings, tools and messages per request (400 past one), each
  message naming the limit and its flag.
- `check_unicode`: 400 for a lone UTF-16 surrogate anywhere in a request (JSON allows the escape
  `"\\ud800"`, the tokenizer and UTF-8 do not).
- `max_chars_per_token`: times the context length, the longest text any prompt can be; a longer
  one is refused without being tokenized (tokenizing 10 MB of text takes seconds and a GB).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from model_server.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeChatRequest,
    TokenizeRequest,
)
from model_server.settings import ServerSettings
from model_server.settings_spec import SETTINGS_BY_NAME, format_byte_count

# ---------------------------------------------------------------------------------- body size


def body_too_large_message(limit: int, size: int | None) -> str:
    """`size`: the Content-Length; None for a chunked body, refused once past the limit."""
    shown = format_byte_count(limit)
    what = f"{size} bytes" if size is not None else f"more than {limit} bytes (chunked)"
    return (
        f"the request body is {what}, over the limit of {shown} "
        f"({_named('max_request_body_size', shown)}): send a smaller request"
    )


def _named(setting: str, value: object) -> str:
    """How a limit's message names it: `--flag value; LLM_VARIABLE`."""
    declared = SETTINGS_BY_NAME[setting]
    return f"{declared.flag} {value}; {declared.env_names[0]}"


class BodySizeLimitMiddleware:
    """413 for a request body over `max_size` bytes (pure ASGI: nothing is buffered here).

    A Content-Length over the limit is answered at once, before the body is read. A chunked
    body is counted as the app reads it: past the limit the read raises an HTTPException(413),
    which the app's handler answers (FastAPI re-raises HTTPExceptions from the body read as
    they are), so at most the limit is ever held."""

    def __init__(self, app: ASGIApp, max_size: int) -> None:
        self.app = app
        self.max_size = max_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_size:
            await _too_large_response(self.max_size, declared)(scope, receive, send)
            return
        read = 0

        async def counted() -> Message:
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.max_size:
                    raise HTTPException(413, body_too_large_message(self.max_size, None))
            return message

        await self.app(scope, counted, send)


def _content_length(scope: Scope) -> int | None:
    value = Headers(scope=scope).get("content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None  # the HTTP server refuses a malformed one before we see it


def _too_large_response(limit: int, size: int) -> Response:
    error = APIError(body_too_large_message(limit, size), 413)
    body = json.dumps(error.to_response().model_dump(), separators=(",", ":"))
    # No `Connection: close`: closing with the body unread would reset the connection, and the
    # client, still sending, could lose the answer. The HTTP server reads the rest and drops it.
    return Response(body, status_code=413, media_type="application/json")


# ------------------------------------------------------------------------------ counted limits


@dataclass(slots=True, frozen=True)
class RequestLimits:
    """The per-request limits of settings_spec.py; 0 is no limit."""

    max_prompts_per_request: int = 0
    max_stop_strings: int = 0
    max_stop_string_length: int = 0
    max_tools: int = 0
    max_messages: int = 0

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> RequestLimits:
        return cls(
            max_prompts_per_request=settings.max_prompts_per_request,
            max_stop_strings=settings.max_stop_strings,
            max_stop_string_length=settings.max_stop_string_length,
            max_tools=settings.max_tools,
            max_messages=settings.max_messages,
        )

    def check_completion(self, request: CompletionRequest, num_prompts: int) -> None:
        self._check_count("prompt", num_prompts, "prompts", "max_prompts_per_request")
        self._check_stop(request.stop)

    def check_chat(self, request: ChatCompletionRequest) -> None:
        self._check_count("messages", len(request.messages), "messages", "max_messages")
        self._check_count("tools", len(request.tools or ()), "tools", "max_tools")
        self._check_stop(request.stop)

    def check_tokenize(self, request: TokenizeRequest) -> None:
        if isinstance(request, TokenizeChatRequest):
            self._check_count("messages", len(request.messages), "messages", "max_messages")

    def _check_stop(self, stop: str | list[str] | None) -> None:
        stops = [stop] if isinstance(stop, str) else stop or []
        self._check_count("stop", len(stops), "stop strings", "max_stop_strings")
        limit = self.max_stop_string_length
        for i, text in enumerate(stops):
            if limit and len(text) > limit:
                where = "stop" if isinstance(stop, str) else f"stop[{i}]"
                raise _over_limit(
                    f"{where}: {len(text)} characters, more than the longest stop string "
                    f"allowed, {limit}",
                    "max_stop_string_length",
                    limit,
                    param="stop",
                    code="string_above_max_length",
                )

    def _check_count(self, param: str, count: int, what: str, setting: str) -> None:
        limit: int = getattr(self, setting)
        if limit and count > limit:
            raise _over_limit(
                f"{param}: {count} {what} in one request, more than the limit of {limit}",
                setting,
                limit,
                param=param,
                code="array_above_max_length",
            )


def _over_limit(message: str, setting: str, limit: int, *, param: str, code: str) -> APIError:
    return APIError(f"{message} ({_named(setting, limit)})", 400, param=param, code=code)


# ---------------------------------------------------------------------------- lone surrogates

# A Python str holds a valid surrogate pair as one astral character (json.loads joins them), so
# any code point left in this range is a lone half that UTF-8 cannot encode.
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(request: BaseModel) -> None:
    """400 naming the first string of `request` (field, list item, dict key or value) that
    holds a lone UTF-16 surrogate, e.g. "messages[0].content: contains a lone UTF-16
    surrogate (\\ud800) at character 5"."""
    for path, text in _strings(request):
        if text.isascii():
            continue
        found = _SURROGATE.search(text)
        if found is not None:
            code = f"\\u{ord(found.group()):04x}"
            raise APIError(
                f"{path}: contains a lone UTF-16 surrogate ({code}) at character "
                f"{found.start()}: text must be valid Unicode (a \\ud800-\\udbff escape must be "
                "followed by its \\udc00-\\udfff partner)",
                400,
                param=re.split(r"[.\[]", path, maxsplit=1)[0],
            )


def _strings(root: BaseModel) -> Iterator[tuple[str, str]]:
    """Every string in a parsed request, with its path (an explicit stack: a JSON schema in
    `tools` may nest deeper than Python's recursion limit)."""
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            yield path or "body", value
        elif isinstance(value, BaseModel):
            fields = type(value).model_fields
            children = [(f.alias or name, getattr(value, name)) for name, f in fields.items()]
            stack.extend((_join(path, name), child) for name, child in reversed(children))
        elif isinstance(value, dict):
            for key, child in reversed(value.items()):
                if isinstance(key, str):
                    yield f"{_join(path, key)} (a key)", key
                stack.append((_join(path, str(key)), child))
        elif isinstance(value, list | tuple):
            stack.extend((f"{path}[{i}]", child) for i, child in reversed(list(enumerate(value))))


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# ------------------------------------------------------------------------------ prompt length


@functools.lru_cache(maxsize=8)
def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of input one token can stand for, or None when that has no bound.

    A BPE tokenizer whose normalizer and pre-tokenizer never drop or merge characters, and
    which never folds a run of unknown characters into one token, covers with each token at
    most as many characters as the token's vocabulary string has (byte-level vocabularies
    spell one byte per character, and a character is at least one byte; SentencePiece-style
    ones spell the text itself, byte-fallback tokens `<0xE4>` stand for one byte). Qwen's NFC
    normalizer and BERT's whitespace-dropping pre-tokenizer get None: no bound, no check."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE":
        return None
    model = backend.model
    if model.unk_token and model.fuse_unk and not model.byte_fallback:
        return None
    if not (_keeps_characters(backend.normalizer) and _keeps_characters(backend.pre_tokenizer)):
        return None
    return max(map(len, backend.get_vocab(with_added_tokens=True)), default=0) or None


# Normalizers and pre-tokenizers (tokenizers' JSON `type`) that keep every input character.
_KEEPING = frozenset({"Prepend", "ByteLevel", "Metaspace", "Digits", "Punctuation"})


def _keeps_characters(component: Any) -> bool:
    if component is None:
        return True
    try:
        spec = json.loads(component.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return False
    return _spec_keeps_characters(spec)


def _spec_keeps_characters(spec: dict[str, Any]) -> bool:
    kind = spec.get("type")
    if kind == "Sequence":
        parts: Sequence[dict[str, Any]] = spec.get("normalizers") or spec.get("pretokenizers") or []
        return all(_spec_keeps_characters(part) for part in parts)
    if kind == "Replace":
        pattern = (spec.get("pattern") or {}).get("String")
        return pattern is not None and len(spec.get("content") or "") >= len(pattern)
    if kind == "Split":
        return spec.get("behavior") != "Removed"
    return kind in _KEEPING


def prompt_too_long(param: str, length: int, max_model_len: int, per_token: int) -> APIError:
    return APIError(
        f"{param}: {length} characters, more than any prompt this model takes can have: its "
        f"context is {max_model_len} tokens of at most {per_token} characters each "
        f"({max_model_len * per_token} characters); send a shorter text",
        400,
        param=re.split(r"[.\[]", param, maxsplit=1)[0],
        code="context_length_exceeded",
    )
