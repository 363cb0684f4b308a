"""The generic connector: httpx straight to the model server's `/v1/chat/completions`."""

from __future__ import annotations

from collections.abc import AsyncIterator

from microservice.connectors.base import Connector
from microservice.protocol import GenerationRequest
from microservice.upstream import Piece, post_chat, stream_chat


class GenericConnector(Connector):
    name = "generic"

    async def complete(self, request: GenerationRequest) -> str:
        ms = self.model_server
        return await post_chat(ms.client, request.payload(stream=False), ms.base_url)

    def stream(self, request: GenerationRequest) -> AsyncIterator[Piece]:
        ms = self.model_server
        return stream_chat(ms.client, request.payload(stream=True), ms.base_url)
