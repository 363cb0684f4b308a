"""Function calling and structured outputs through the LLM microservice in front of the real
model server: a LangChain agent loop on the langchain connector's chat model (`bind_tools`, a
tool result fed back), `with_structured_output` both ways, and OpenAI requests with tools passed
through the running microservice (both connectors, streamed and not)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from microservice.connectors.langchain import WickChatModel
from tests.e2e.conftest import ServerProcess
from tests.e2e.test_microservice import Microservice, start_microservice, stop_all
from tests.e2e.test_tool_calling import ASK, SCHEMAS, TOOLS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@tool
def get_weather(city: str, unit: str) -> str:
    """Get the current weather in a city (unit: celsius or fahrenheit)."""
    return json.dumps({"city": city, "temperature": 21, "unit": unit})


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


def test_langchain_agent_loop_completes(server: ServerProcess) -> None:
    llm = WickChatModel(base_url=server.url, model_kwargs={"temperature": 0, "max_tokens": 120})
    agent = llm.bind_tools([get_weather], tool_choice="any")
    messages = [HumanMessage("What is the weather in Paris?")]
    reply = agent.invoke(messages)
    assert isinstance(reply, AIMessage) and reply.tool_calls
    messages.append(reply)
    for call in reply.tool_calls:
        assert call["name"] == "get_weather"
        messages.append(get_weather.invoke(call))  # a ToolMessage with the call's id
    assert isinstance(messages[-1], ToolMessage)
    final = llm.bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert isinstance(final, AIMessage) and final.content and not final.tool_calls


def test_langchain_streamed_tool_calls_match(server: ServerProcess) -> None:
    llm = WickChatModel(base_url=server.url, model_kwargs={"temperature": 0, "max_tokens": 120})
    agent = llm.bind_tools([get_weather], tool_choice="get_weather")
    whole = agent.invoke("Weather in Rome?")
    merged = None
    for chunk in agent.stream("Weather in Rome?"):
        merged = chunk if merged is None else merged + chunk
    assert [c["args"] for c in merged.tool_calls] == [c["args"] for c in whole.tool_calls]
    assert whole.tool_calls[0]["name"] == "get_weather"


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(server: ServerProcess, method: str) -> None:
    llm = WickChatModel(base_url=server.url, model_kwargs={"temperature": 0, "max_tokens": 80})
    person = llm.with_structured_output(Person, method=method).invoke("Invent a person.")
    assert isinstance(person, Person)


@pytest.fixture(scope="module")
def openai_services(
    server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Microservice]]:
    log_dir = tmp_path_factory.mktemp("microservice-tools")
    started = [start_microservice(log_dir, server.url, c) for c in ("generic", "langchain")]
    try:
        for service in started:
            service.wait_up()
        yield started
    finally:
        stop_all(started)


def test_tools_pass_through_the_microservice(openai_services: list[Microservice]) -> None:
    for service in openai_services:
        client = openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0)
        kwargs = dict(
            model="",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=120,
            temperature=0,
        )
        whole = client.chat.completions.create(**kwargs).choices[0]
        calls = whole.message.tool_calls
        assert calls, service.connector
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        streamed: dict[int, dict[str, str]] = {}
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                for delta in choice.delta.tool_calls or ():
                    entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
                    entry["name"] += delta.function.name or ""
                    entry["arguments"] += delta.function.arguments or ""
        assert [json.loads(c["arguments"]) for c in streamed.values()] == [
            json.loads(c.function.arguments) for c in calls
        ], service.connector
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        out = client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": "Is water wet?"}],
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            max_tokens=20,
            temperature=0,
        )
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
