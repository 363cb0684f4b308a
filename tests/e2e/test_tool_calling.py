"""Function calling through the real `openai` client against the real server: `required` and a
named function always give calls whose arguments validate; `auto` gives text or a call; streamed
deltas reassemble to the non-streamed answer; tool results go back in `tool` turns; bad tool
choices are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(calls) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_always_calls(client: openai.OpenAI, temperature: float) -> None:
    # Sampled: one call (parallel_tool_calls false). With parallel calls allowed, the grammar
    # cannot end the array for the model: sampled at T=1 the 135M model kept adding calls until
    # max_tokens (finish_reason length), as any model may.
    for seed in range(3):
        out = client.chat.completions.create(
            model="",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=temperature == 0.0,
            max_tokens=120,
            temperature=temperature,
            seed=seed,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message.tool_calls)


def test_required_without_parallel_calls_gives_one(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    assert len(out.choices[0].message.tool_calls) == 1


def test_named_function_is_called(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=80,
        temperature=0.7,
        seed=0,
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _check_calls([call])


def test_auto_gives_text_or_a_call(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0
    )
    message = out.choices[0].message
    if message.tool_calls:
        assert out.choices[0].finish_reason == "tool_calls"
        for call in message.tool_calls:
            assert call.function.name in SCHEMAS
            json.loads(call.function.arguments)
    else:
        assert message.content


def _reassemble(stream) -> tuple[str | None, list[dict], str | None]:
    content, calls, reason = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.function.name:
                    call["name"] += delta.function.name
                call["arguments"] += delta.function.arguments or ""
            reason = choice.finish_reason or reason
    return content or None, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize(
    "tool_choice",
    ["required", "auto", {"type": "function", "function": {"name": "get_weather"}}],
)
def test_streamed_deltas_reassemble_to_the_answer(client: openai.OpenAI, tool_choice) -> None:
    kwargs = dict(
        model="",
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=120,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, reason = _reassemble(client.chat.completions.create(**kwargs, stream=True))
    assert reason == whole.finish_reason
    assert content == whole.message.content
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls or ()
    ]
    assert calls == expected


def test_tool_results_go_back_in_the_conversation(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0
    )
    message = first.choices[0].message
    call = message.tool_calls[0]
    follow = client.chat.completions.create(
        model="",
        messages=[
            *ASK,
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
        ],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=40,
        temperature=0,
    )
    assert follow.choices[0].message.content
    assert not follow.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope'",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "objekt"}},
                    }
                ]
            },
            "tools[0].function.parameters",
            "invalid JSON schema",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "only one",
        ),
    ],
)
def test_bad_tool_requests_are_400s(http: httpx.Client, body: dict, param: str, words: str) -> None:
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
