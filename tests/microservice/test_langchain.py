"""WickChatModel on its own: langchain's sync, async and streaming paths over the model
server's API, call-time parameters, and errors as UpstreamErrors."""

from __future__ import annotations

import json

import httpx
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate

from microservice.connectors import make_connector
from microservice.connectors.generic import GenericConnector
from microservice.connectors.langchain import LangchainConnector, WickChatModel
from microservice.errors import UpstreamHTTPError, UpstreamUnavailable
from microservice.protocol import GenerationRequest
from microservice.settings import MicroserviceSettings
from tests.microservice.conftest import run
from tests.microservice.fakes import MODEL, FakeModelServer

URL = "http://model-server:8008"
MESSAGES = [SystemMessage("Be brief."), HumanMessage("Hi"), AIMessage("Hello"), HumanMessage("?")]


def model(fake: FakeModelServer, **kw: object) -> WickChatModel:
    transport = httpx.MockTransport(fake.handler)
    return WickChatModel(
        base_url=URL,
        model=MODEL,
        http_client=httpx.Client(base_url=URL, transport=transport),
        http_async_client=httpx.AsyncClient(base_url=URL, transport=transport),
        **kw,
    )


def test_sync_invoke_and_stream() -> None:
    fake = FakeModelServer(pieces=["Hel", "lo"])
    llm = model(fake, model_kwargs={"top_k": 3})
    answer = llm.invoke(MESSAGES, stop=["###"], seed=7)
    assert answer.content == "Hello"
    assert answer.response_metadata["finish_reason"] == "stop"
    chunks = list(llm.stream(MESSAGES, max_tokens=5))
    assert "".join(str(c.content) for c in chunks) == "Hello"
    first, second = fake.bodies()
    assert first["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "?"},
    ]
    assert (first["model"], first["top_k"], first["stop"], first["seed"]) == (MODEL, 3, ["###"], 7)
    assert first["stream"] is False and second["stream"] is True and second["max_tokens"] == 5


def test_async_invoke_and_stream_in_a_chain() -> None:
    fake = FakeModelServer(pieces=["Hel", "lo"])
    prompt = ChatPromptTemplate.from_messages([("system", "{system}"), ("human", "{user}")])
    chain = prompt | model(fake) | StrOutputParser()

    async def go() -> tuple[str, list[str]]:
        inputs = {"system": "Be {brief}.", "user": "Hi"}  # braces in values stay literal
        return await chain.ainvoke(inputs), [t async for t in chain.astream(inputs)]

    text, pieces = run(go())
    assert text == "Hello" and "".join(pieces) == "Hello"
    assert fake.bodies()[0]["messages"][0] == {"role": "system", "content": "Be {brief}."}


def test_errors_are_upstream_errors() -> None:
    def too_long(request: httpx.Request, _: object) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "prompt too long"}})

    llm = model(FakeModelServer(chat=too_long))
    with pytest.raises(UpstreamHTTPError, match="prompt too long"):
        llm.invoke("hi")
    with pytest.raises(UpstreamHTTPError, match="prompt too long"):
        list(llm.stream("hi"))
    down = WickChatModel(base_url="http://127.0.0.1:9", model=MODEL, connect_timeout=0.5)
    with pytest.raises(UpstreamUnavailable):
        down.invoke("hi")


def test_both_connectors_send_the_same_body() -> None:
    request = GenerationRequest(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        params={"max_tokens": 4, "temperature": 0.0, "top_k": 1, "stop": ["x"]},
    )
    bodies = []
    for cls in (GenericConnector, LangchainConnector):
        fake = FakeModelServer()
        from microservice.upstream import ModelServer

        connector = cls(ModelServer(URL, transport=httpx.MockTransport(fake.handler)))
        assert run(connector.complete(request)) == "Hello"
        run(connector.aclose())
        bodies.append(fake.bodies()[0])
    assert bodies[0] == bodies[1]
    assert json.dumps(bodies[0], sort_keys=True)  # plain JSON, nothing langchain-specific


def test_make_connector_follows_the_settings() -> None:
    for name, cls in (("generic", GenericConnector), ("langchain", LangchainConnector)):
        settings = MicroserviceSettings(
            connector=name, model_server_endpoint="http://ms:1/v1", api_key="k", model_name="m"
        )
        connector = make_connector(settings)
        assert isinstance(connector, cls) and connector.name == name
        ms = connector.model_server
        assert (ms.base_url, ms.configured_model) == ("http://ms:1", "m")
        assert ms.client.headers["authorization"] == "Bearer k"
        run(connector.aclose())
