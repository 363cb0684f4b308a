"""Request limits (`LLM_USVC_MAX_*`, 0: none): the body's size, checked before and while it is
read, and the counts and sizes in a parsed body, checked before any prompt is built or upstream
call made.

Each refusal names the limit and the variable and flag that raise it: 413 for the body, 400 for
the rest (as the model server answers its own limits). The body is not read past its limit: a
declared `Content-Length` over it is answered at once, a chunked body as soon as its bytes pass
it (the server discards the rest, so the client still reads the 413).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from microservice.errors import ServiceError

if TYPE_CHECKING:
    from microservice.settings import MicroserviceSettings

# Defaults a real deployment does not reach, each well above what a model's context can use:
# - 16 MiB of body: the documents' 8 MiB below, JSON escaping (a CJK character escaped as
#   \uXXXX is 6 bytes for 3 of UTF-8) and the messages fit;
# - 1000 documents: ChatQnA passes the reranker's top_n (1 by default) or a retriever's k (4 by
#   default, tens at most); 1000 chunks of a usual 512 tokens are 512k tokens;
# - 8 MiB of document text: about 2M tokens at 4 bytes a token, above any served context;
# - 1000 messages: a long agent session is a few hundred turns.
DEFAULT_MAX_REQUEST_BODY_SIZE = 16 << 20
DEFAULT_MAX_DOCUMENTS = 1000
DEFAULT_MAX_DOCUMENTS_SIZE = 8 << 20
DEFAULT_MAX_MESSAGES = 1000

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmg]i?b|[kmg]|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9}
_UNITS |= {"k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_size(value: str | int) -> int:
    """Bytes from `16MiB`, `512KiB`, `2MB`, `1.5GiB` or a plain byte count (K, M, G alone are
    binary). Raises ValueError."""
    if isinstance(value, int):
        return value
    match = _SIZE.match(value)
    if match is None:
        raise ValueError(f"cannot read the size {value!r}: write e.g. 16MiB, 512KiB or 1000000")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()])


def format_size(size: int) -> str:
    """`16 MiB` for whole binary units, else the byte count."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor} {unit}"
    return f"{size} bytes"


@dataclass(frozen=True)
class Limit:
    value: int  # 0: no limit
    variable: str
    flag: str

    def passed_by(self, amount: int) -> bool:
        return 0 < self.value < amount

    def refuse(
        self, what: str, shown: str, status: int, *, code: str, param: str | None = None
    ) -> ServiceError:
        """The error saying `what` is wrong, and this limit (`shown`: as a reader wants it)."""
        limit = f"this service's limit is {shown} (raise it with {self.variable} or {self.flag})"
        return ServiceError(f"{what}: {limit}", status, code=code, param=param)


@dataclass(frozen=True)
class RequestLimits:
    body_size: Limit
    documents: Limit
    documents_size: Limit
    messages: Limit

    @classmethod
    def from_values(
        cls,
        body_size: int = DEFAULT_MAX_REQUEST_BODY_SIZE,
        documents: int = DEFAULT_MAX_DOCUMENTS,
        documents_size: int = DEFAULT_MAX_DOCUMENTS_SIZE,
        messages: int = DEFAULT_MAX_MESSAGES,
    ) -> RequestLimits:
        return cls(
            Limit(body_size, "LLM_USVC_MAX_REQUEST_BODY_SIZE", "--max-request-body-size"),
            Limit(documents, "LLM_USVC_MAX_DOCUMENTS", "--max-documents"),
            Limit(documents_size, "LLM_USVC_MAX_DOCUMENTS_SIZE", "--max-documents-size"),
            Limit(messages, "LLM_USVC_MAX_MESSAGES", "--max-messages"),
        )

    @classmethod
    def from_settings(cls, settings: MicroserviceSettings) -> RequestLimits:
        return cls.from_values(
            settings.max_request_body_size,
            settings.max_documents,
            settings.max_documents_size,
            settings.max_messages,
        )


DEFAULT_LIMITS = RequestLimits.from_values()


async def read_body(request: Request, limit: Limit) -> bytes:
    """The request's body, refused (413) by its Content-Length or, for a chunked body, as soon
    as the bytes received pass `limit`: the rest is never read."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and limit.passed_by(int(declared)):
        raise _body_too_large(limit, f"the request body is {declared} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if limit.passed_by(size):
            raise _body_too_large(limit, "the request body is too large")
        chunks.append(chunk)
    return b"".join(chunks)


def _body_too_large(limit: Limit, what: str) -> ServiceError:
    return limit.refuse(what, format_size(limit.value), 413, code="request_too_large")


def check_request(data: dict[str, Any], limits: RequestLimits) -> None:
    """400 when the parsed body holds more documents or messages than allowed. Runs on the raw
    JSON, before validation: a refused body costs no model building."""
    documents = data.get("documents")
    if isinstance(documents, list):
        _check_documents(documents, limits)
    messages = data.get("messages")
    if isinstance(messages, list) and limits.messages.passed_by(len(messages)):
        raise limits.messages.refuse(
            f"the request has {len(messages)} messages",
            str(limits.messages.value),
            400,
            code="too_many_messages",
            param="messages",
        )


def _check_documents(documents: list[Any], limits: RequestLimits) -> None:
    if limits.documents.passed_by(len(documents)):
        raise limits.documents.refuse(
            f"the request has {len(documents)} documents",
            str(limits.documents.value),
            400,
            code="too_many_documents",
            param="documents",
        )
    if not limits.documents_size.value:
        return
    size = sum(len(text.encode("utf-8")) for text in map(_document_text, documents))
    if limits.documents_size.passed_by(size):
        raise limits.documents_size.refuse(
            f"the documents hold {size} bytes of text",
            format_size(limits.documents_size.value),
            400,
            code="documents_too_large",
            param="documents",
        )


def _document_text(document: Any) -> str:
    """A document's text as protocol.Document reads it; "" for shapes validation refuses."""
    if isinstance(document, dict):
        document = document.get("text")
    return document if isinstance(document, str) else ""
