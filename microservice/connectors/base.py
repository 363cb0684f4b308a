"""The connector interface the app uses, and the factory that picks one from the settings."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from microservice.protocol import GenerationRequest
from microservice.upstream import ModelServer, Piece

if TYPE_CHECKING:
    from microservice.settings import MicroserviceSettings


class Connector(ABC):
    """Generates over `model_server`. Contract: every failure raises an `UpstreamError`;
    closing `stream()`'s iterator early (or cancelling it) closes the upstream request, so
    the model server aborts it."""

    name: str

    def __init__(self, model_server: ModelServer) -> None:
        self.model_server = model_server

    @abstractmethod
    async def complete(self, request: GenerationRequest) -> str:
        """The whole answer's text."""

    @abstractmethod
    def stream(self, request: GenerationRequest) -> AsyncIterator[Piece]:
        """The answer piece by piece; the request is sent on the first `__anext__`."""

    async def aclose(self) -> None:
        await self.model_server.aclose()


def make_connector(settings: MicroserviceSettings) -> Connector:
    model_server = ModelServer(
        settings.model_server_endpoint,
        api_key=settings.api_key_value,
        connect_timeout=settings.connect_timeout,
        read_timeout=settings.read_timeout,
        model_name=settings.model_name,
    )
    if settings.connector == "langchain":
        # Imported here: langchain-core is only loaded when it is the chosen connector.
        try:
            from microservice.connectors.langchain import LangchainConnector
        except ImportError as exc:
            raise RuntimeError(
                f"LLM_CONNECTOR=langchain needs langchain-core ({exc}): "
                "pip install 'wick[microservice]'"
            ) from exc

        return LangchainConnector(model_server)
    from microservice.connectors.generic import GenericConnector

    return GenericConnector(model_server)
