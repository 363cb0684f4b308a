"""The generic connector: httpx straight to the model server's `/v1/chat/completions`."""

from __future__ import annotations

from collections.abc import AsyncIterator

from microservice.connectors.base import Connector
from microservice.protocol import GenerationRequest
from microservice.upstream import Completion, Piece, post_completion, stream_chat


class GenericConnector(Connector):
    name = "generic"

    async def answer(self, request: GenerationRequest) -> Completion:
        ms = self.model_server
        return await post_completion(ms.client, request.payload(stream=False), ms.base_url)

    def stream(self, request: GenerationRequest) -> AsyncIterator[Piece]:
        ms = self.model_server
        return stream_chat(ms.client, request.payload(stream=True), ms.base_url)
