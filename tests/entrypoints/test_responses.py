"""`/v1/responses` through the real `openai` client against a loopback server (a tiny random
llama with the embedded SmolLM2 tokenizer and chat template): answers are the chat completion's
(greedy, the same text), streamed as Responses events; function tools and their outputs, and
`text.format` json_schema; stateful fields are 400s naming them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from model_server.engine.async_engine import AsyncLLM
from model_server.entrypoints.openai.api_server import build_app
from tests.entrypoints.conftest import MODEL_NAME, tiny_settings
from tests.loopback import serve_asgi

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": SCHEMA,
}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA}}


@dataclass
class Served:
    url: str
    client: openai.OpenAI
    http: httpx.Client


@pytest.fixture(scope="module")
def served(tiny_config: Path) -> Iterator[Served]:
    settings = tiny_settings(tiny_config, max_model_len=512)  # room for the tools prompt
    llm = AsyncLLM(settings.engine_config(), skip_warmup=True)
    with serve_asgi(build_app(llm, settings)) as url, httpx.Client(base_url=url, timeout=60) as h:
        llm_ready(h)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        yield Served(url, client, h)


def llm_ready(http: httpx.Client) -> None:
    import time

    deadline = time.monotonic() + 120
    while http.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the server did not get ready"
        time.sleep(0.1)


def _chat_text(served: Served, messages: list[dict], **fields) -> str:
    out = served.client.chat.completions.create(model=MODEL_NAME, messages=messages, **fields)
    return out.choices[0].message.content


def test_text_input_is_the_chat_answer(served: Served) -> None:
    resp = served.client.responses.create(
        model=MODEL_NAME, input="What is the capital of France?", max_output_tokens=6,
        temperature=0,
    )  # fmt: skip
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant"
    assert resp.output_text == _chat_text(
        served,
        [{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=6,
        temperature=0,
    )
    assert resp.usage.output_tokens == 6
    assert resp.usage.total_tokens == resp.usage.input_tokens + 6
    assert resp.store is False


def test_instructions_and_message_items_are_the_chat_turns(served: Served) -> None:
    resp = served.client.responses.create(
        model=MODEL_NAME,
        instructions="Answer in French.",
        input=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Why?"}],
            },
        ],
        max_output_tokens=5,
        temperature=0,
    )
    chat = _chat_text(
        served,
        [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Why?"},
        ],
        max_tokens=5,
        temperature=0,
    )
    assert resp.output_text == chat
    assert resp.instructions == "Answer in French."


def test_a_stream_sends_the_responses_events(served: Served) -> None:
    stream = served.client.responses.create(
        model=MODEL_NAME, input="Hello", max_output_tokens=5, temperature=0, stream=True
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # max_output_tokens reached
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == "".join(deltas)
    final = events[-1].response
    assert final.output_text == done.text and final.usage.output_tokens == 5
    whole = served.client.responses.create(
        model=MODEL_NAME, input="Hello", max_output_tokens=5, temperature=0
    )
    assert whole.output_text == done.text


def test_text_format_json_schema(served: Served) -> None:
    resp = served.client.responses.create(
        model=MODEL_NAME, input="Name a city.", text=JSON_FORMAT, max_output_tokens=40,
        temperature=0.8, extra_body={"seed": 1},
    )  # fmt: skip
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), SCHEMA)
    assert resp.text.format.type == "json_schema"
    # The stream helper: the same answer, finished with response.completed.
    with served.client.responses.stream(
        model=MODEL_NAME, input="Name a city.", text=JSON_FORMAT, max_output_tokens=40,
        temperature=0.8, extra_body={"seed": 1},
    ) as stream:  # fmt: skip
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(texts) == resp.output_text


def test_function_tools_calls_and_their_outputs(served: Served) -> None:
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    resp = served.client.responses.create(
        model=MODEL_NAME, input=ask, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=40, temperature=0,
    )  # fmt: skip
    (call,) = [item for item in resp.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    assert resp.tools[0].name == "get_weather"
    # The call and its output go back as input items (the output items as the client got them).
    follow = served.client.responses.create(
        model=MODEL_NAME,
        input=[
            *ask,
            *[item.model_dump(exclude_none=True) for item in resp.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
        ],
        tools=[WEATHER],
        max_output_tokens=4,
        temperature=0,
    )
    assert follow.output_text is not None
    assert follow.usage.input_tokens > resp.usage.input_tokens  # the call and result are in
    # A named function, streamed: the argument deltas add up to the call.
    with served.client.responses.stream(
        model=MODEL_NAME, input=ask, tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
        temperature=0,
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == "".join(pieces)
    (item,) = final.output
    assert item.type == "function_call" and item.arguments == done.arguments
    jsonschema.validate(json.loads(item.arguments), SCHEMA)


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"store": True}, "store", "stateless"),
        ({"previous_response_id": "resp_123"}, "previous_response_id", "stateless"),
        ({"background": True}, "background", "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning options"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "include"),
        ({"truncation": "auto"}, "truncation", "truncation"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "input[0].content[0]: content part type 'input_image'",
        ),
        ({"input": [{"type": "web_search_call"}]}, "input", "input[0].type"),
        ({"input": []}, "input", "input: must not be an empty list"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input", "input[0].role"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input",
            "input[0].call_id",
        ),
        ({"tools": [{"type": "web_search"}]}, "tools", "tools"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
            "text.format",
            "text.format",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
            "nope",
        ),
        ({"enable_thinking": "no"}, "enable_thinking", "enable_thinking"),
    ],
)
def test_bad_requests_are_400_naming_the_field(
    served: Served, fields: dict, param: str, needle: str
) -> None:
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2, **fields}
    resp = served.http.post("/v1/responses", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert needle in error["message"], error
    assert error["param"] == param, error


def test_store_false_is_fine(served: Served) -> None:
    resp = served.client.responses.create(
        model=MODEL_NAME, input="Hi", store=False, max_output_tokens=2, temperature=0
    )
    assert resp.status == "incomplete" and resp.store is False
