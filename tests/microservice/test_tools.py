"""Function calling and structured outputs through the app (both connectors) over a scripted
model server: the fields reach the model server as sent, tool and assistant-call turns pass
through, and `tool_calls` come back in OpenAI's format, streamed and not."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.microservice.fakes import CONNECTORS, FakeModelServer, completion_body
from tests.microservice.test_app import chat, events

pytestmark = pytest.mark.parametrize("connector", CONNECTORS)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def _tool_answer(request: httpx.Request, payload: dict[str, Any]) -> httpx.Response:
    if payload.get("stream"):
        chunks = [
            {"role": "assistant", "content": ""},
            {"tool_calls": [{"index": 0, **CALL}]},
        ]
        body = ""
        for i, delta in enumerate([*chunks, {}]):
            reason = "tool_calls" if i == len(chunks) else None
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            body += f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"
        body += "data: [DONE]\n\n"
        return httpx.Response(
            200, content=body.encode(), headers={"content-type": "text/event-stream"}
        )
    body = completion_body("", "tool_calls")
    body["choices"][0]["message"] = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    return httpx.Response(200, json=body)


REQUEST = {
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "user", "content": "And now?"},
    ],
    "tools": TOOLS,
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "max_tokens": 30,
}


def test_tools_and_turns_reach_the_model_server(connector: str) -> None:
    fake = FakeModelServer(chat=_tool_answer)
    response = chat(connector, fake, REQUEST)
    assert response.status_code == 200, response.text
    sent = fake.bodies()[0]
    assert sent["tools"] == TOOLS and sent["tool_choice"] == "required"
    assert sent["parallel_tool_calls"] is False
    assert sent["messages"][1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(sent["messages"][1]["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris"
    }
    assert sent["messages"][2] == {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_streamed_tool_calls_come_back_as_deltas(connector: str) -> None:
    fake = FakeModelServer(chat=_tool_answer)
    response = chat(connector, fake, {**REQUEST, "stream": True})
    assert response.status_code == 200, response.text
    payloads = [json.loads(e) for e in events(response) if e != "[DONE]"]
    deltas = [d for p in payloads for c in p["choices"] for d in c["delta"].get("tool_calls", [])]
    assert [d["function"].get("name") for d in deltas if d["function"].get("name")] == [
        "get_weather"
    ]
    arguments = "".join(d["function"].get("arguments") or "" for d in deltas)
    assert json.loads(arguments) == {"city": "Paris"}
    assert payloads[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_response_format_and_guided_fields_are_forwarded(connector: str) -> None:
    fake = FakeModelServer(chat=lambda r, p: httpx.Response(200, json=completion_body('{"a":1}')))
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    body = {"messages": [{"role": "user", "content": "x"}], "response_format": fmt}
    response = chat(connector, fake, body)
    assert response.json()["choices"][0]["message"]["content"] == '{"a":1}'
    assert fake.bodies()[0]["response_format"] == fmt
    chat(connector, fake, {"messages": [{"role": "user", "content": "x"}], "guided_regex": "a+"})
    assert fake.bodies()[1]["guided_regex"] == "a+"
