"""Request parsing and translation: OPEA's payload and defaults, OpenAI's list form, every
forwarded field, clear 4xx messages."""

from __future__ import annotations

import json
from typing import Any

import pytest

from microservice.errors import ServiceError
from microservice.protocol import FORWARDED, generated_doc, parse_chat_request

OPEA = {"messages": {"system": "Be brief.", "user": "Hi?"}}


def parse(body: dict[str, Any] | bytes) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_chat_request(raw)


def test_opea_payload_gets_opea_defaults() -> None:
    req = parse(OPEA)
    assert req.is_opea and req.wants_stream  # OPEA streams unless told not to
    assert req.sampling_params() == {
        "top_k": 10,
        "top_p": 0.95,
        "temperature": 0.01,
        "repetition_penalty": 1.03,
    }
    # "At most 1024": the app caps it to the context the prompt leaves (see test_app.py).
    assert req.default_max_tokens == 1024
    assert req.chat_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
    ]
    assert req.prompt() == "Hi?"
    assert req.unsupported_fields() == ["typical_p"]  # OPEA's default 0.95, not implemented


def test_opea_values_translate_to_openai_names() -> None:
    req = parse({**OPEA, "max_new_tokens": 17, "streaming": False, "top_k": 3, "typical_p": 1.0})
    params = req.sampling_params()
    assert params["max_tokens"] == 17 and params["top_k"] == 3
    assert "max_new_tokens" not in params and "typical_p" not in params
    assert not req.wants_stream
    assert req.unsupported_fields() == []  # typical_p 1.0 is "off": nothing lost


def test_empty_system_message_is_left_out() -> None:
    req = parse({"messages": {"system": "", "user": "Hi?"}})
    assert req.chat_messages() == [{"role": "user", "content": "Hi?"}]


def test_opea_query_form() -> None:
    req = parse({"query": "What is Deep Learning?", "streaming": False})
    assert req.chat_messages() == [{"role": "user", "content": "What is Deep Learning?"}]
    assert req.default_max_tokens == 1024 and "max_tokens" not in req.sampling_params()


def test_openai_list_form_sends_only_what_was_given() -> None:
    req = parse(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "last"},
            ],
            "max_tokens": 5,
        }
    )
    assert not req.is_opea and not req.wants_stream  # OpenAI's default
    assert req.sampling_params() == {"max_tokens": 5} and req.default_max_tokens is None
    assert req.chat_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "last"},
    ]
    assert req.prompt() == "last" and req.model == "m"
    assert parse({"messages": [{"role": "user", "content": "x"}], "stream": True}).wants_stream


@pytest.mark.parametrize("name", ["max_new_tokens", "max_tokens", "max_completion_tokens"])
def test_a_given_token_limit_is_sent_as_is_and_no_default_applies(name: str) -> None:
    req = parse({**OPEA, name: 4096})
    assert req.sampling_params()["max_tokens"] == 4096 and req.default_max_tokens is None


def test_openai_form_gets_no_default_token_limit() -> None:
    req = parse({"messages": [{"role": "user", "content": "x"}]})
    assert req.default_max_tokens is None and "max_tokens" not in req.sampling_params()


@pytest.mark.parametrize("top_k", [-1, 0, 1, 50])
def test_top_k_off_values_and_positive_values_are_forwarded(top_k: int) -> None:
    assert parse({**OPEA, "top_k": top_k}).sampling_params()["top_k"] == top_k


@pytest.mark.parametrize("seed", [0, -1, -(2**63), 2**63 - 1])
def test_64_bit_seeds_are_forwarded(seed: int) -> None:
    assert parse({**OPEA, "seed": seed}).sampling_params()["seed"] == seed


SAMPLE_VALUES: dict[str, Any] = {
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 7,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "presence_penalty": 0.2,
    "frequency_penalty": 0.3,
    "seed": 1234,
    "stop": ["\n\n", "###"],
    "ignore_eos": True,
    "min_tokens": 2,
    "stop_token_ids": [2, 3],
    "skip_special_tokens": False,
    "include_stop_str_in_output": True,
    "logit_bias": {"42": -100.0},
    "user": "alice",
    "add_generation_prompt": True,
    "continue_final_message": False,
    "chat_template_kwargs": {"enable_thinking": False},
    "enable_thinking": False,
    "response_format": {"type": "json_object"},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "structured_outputs": {"regex": "a+"},
    "guided_json": {"type": "object"},
    "guided_regex": "b+",
    "guided_choice": ["yes", "no"],
    "guided_grammar": 'root ::= "x"',
}


def test_every_supported_field_is_forwarded() -> None:
    assert set(SAMPLE_VALUES) == set(FORWARDED)
    for form in (OPEA, {"messages": [{"role": "user", "content": "x"}]}):
        params = parse({**form, **SAMPLE_VALUES, "max_new_tokens": 9}).sampling_params()
        assert params == {**SAMPLE_VALUES, "max_tokens": 9}


def test_unknown_fields_are_reported_not_forwarded() -> None:
    req = parse({**OPEA, "chat_template": "{question}", "k": 4, "typical_p": 0.5})
    assert req.unsupported_fields() == ["typical_p", "chat_template", "k"]
    assert not {"chat_template", "k", "typical_p"} & set(req.sampling_params())


def test_generated_doc_is_opeas_body() -> None:
    req = parse({**OPEA, "data": {"k": 1}, "output_guardrail_params": {"x": True}})
    assert generated_doc("id-1", "Hello", req) == {
        "id": "id-1",
        "text": "Hello",
        "prompt": "Hi?",
        "streaming": False,
        "output_guardrail_params": {"x": True},
        "data": {"k": 1},
    }


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b"\xff\xfe{}", 400, ["UTF-8"]),
        (b'{"messages": ', 400, ["not valid JSON", "line 1"]),
        (b"", 400, ["empty"]),
        (b"[1, 2]", 400, ["JSON object", "list"]),
        (b"{}", 422, ["messages is required"]),
        (b'{"messages": {"system": "s"}}', 422, ["messages.user", "required"]),
        (b'{"messages": "hi"}', 422, ["messages", '{"system"']),
        (b'{"messages": []}', 422, ["messages", "at least 1"]),
        (
            b'{"messages": {"user": "u"}, "max_new_tokens": 0}',
            422,
            ["max_new_tokens", "greater than or equal to 1"],
        ),
        (b'{"messages": {"user": "u"}, "max_new_tokens": "abc"}', 422, ["max_new_tokens", "'abc'"]),
        (b'{"messages": {"user": "u"}, "temperature": "hot"}', 422, ["temperature", "number"]),
        (b'{"messages": {"user": "u"}, "streaming": "maybe"}', 422, ["streaming", "boolean"]),
        (b'{"messages": {"user": "u"}, "stop": 5}', 422, ["stop: must be a string or a list"]),
        (b'{"messages": {"user": "u"}, "n": 2}', 422, ["n:"]),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', 422, ["messages.0.role"]),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            422,
            ["messages.0.content: must be a string or a list of text parts"],
        ),
        # vLLM's rules: top_k -1 or 0 is off, below -1 is an error (was forwarded as "off").
        (
            b'{"messages": {"user": "u"}, "top_k": -2}',
            422,
            ["top_k: must be -1 or 0 (disabled) or at least 1, got -2"],
        ),
        # Seeds are 64-bit signed integers (was forwarded whatever its size).
        (b'{"messages": {"user": "u"}, "seed": 9223372036854775808}', 422, ["seed:", "64-bit"]),
        (b'{"messages": {"user": "u"}, "seed": -9223372036854775809}', 422, ["seed:", "64-bit"]),
        (b'{"messages": {"user": "u"}, "seed": 1e400}', 400, ["1e400", "finite"]),
        (b'{"messages": {"user": "u"}, "stream": true, "streaming": false}', 422, ["disagree"]),
        (b'{"messages": {"user": "u"}, "max_tokens": 3, "max_new_tokens": 4}', 422, ["disagree"]),
        # Python's json reads these; the request upstream could not carry them (was a 500).
        (b'{"messages": {"user": "u"}, "temperature": NaN}', 400, ["NaN", "finite"]),
        (b'{"messages": {"user": "u"}, "top_p": -Infinity}', 400, ["-Infinity", "finite"]),
        (b'{"messages": {"user": "u"}, "temperature": 1e999}', 400, ["1e999", "finite"]),
    ],
)
def test_bad_requests_say_what_is_wrong(body: bytes, status: int, words: list[str]) -> None:
    with pytest.raises(ServiceError) as info:
        parse_chat_request(body)
    assert info.value.status_code == status
    for word in words:
        assert word in info.value.message, info.value.message
    assert len(info.value.message) < 300  # one readable line, not pydantic's dump
