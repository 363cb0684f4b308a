"""The connector interface the app uses. The factory that picks one lives in `registry.py`:
it imports the concrete connectors, which import this module, so it cannot live here."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from microservice.protocol import GenerationRequest
from microservice.upstream import Completion, ModelServer, Piece


class Connector(ABC):
    """Generates over `model_server`. Contract: every failure raises an `UpstreamError`;
    closing `stream()`'s iterator early (or cancelling it) closes the upstream request, so
    the model server aborts it."""

    name: str

    def __init__(self, model_server: ModelServer) -> None:
        self.model_server = model_server

    @abstractmethod
    async def answer(self, request: GenerationRequest) -> Completion:
        """The whole answer: text, finish reason and (when known) usage."""

    async def complete(self, request: GenerationRequest) -> str:
        """The whole answer's text."""
        return (await self.answer(request)).text

    @abstractmethod
    def stream(self, request: GenerationRequest) -> AsyncIterator[Piece]:
        """The answer piece by piece; the request is sent on the first `__anext__`."""

    async def aclose(self) -> None:
        await self.model_server.aclose()
