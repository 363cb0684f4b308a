"""OpenAI protocol models and their error messages (no engine, milliseconds)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from model_server.entrypoints.openai.api_server import validation_message
from model_server.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)

MSG = [{"role": "user", "content": "hi"}]


def message_for(model: type, body: dict) -> str:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_message(info.value.errors())[0]


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_shapes(prompt: object, expected: list) -> None:
    assert CompletionRequest(prompt=prompt).prompts() == expected


def test_completion_defaults_follow_openai() -> None:
    params = CompletionRequest(prompt="x").to_sampling_params()
    assert params.max_tokens == 16 and params.temperature == 1.0 and params.top_p == 1.0
    assert params.n == 1 and params.logprobs is None and params.stop == []


def test_chat_defaults_have_no_token_limit() -> None:
    request = ChatCompletionRequest(messages=MSG)
    assert request.to_sampling_params().max_tokens is None


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    request = ChatCompletionRequest(messages=MSG, max_tokens=5, max_completion_tokens=7)
    assert request.to_sampling_params().max_tokens == 7


def test_vllm_extra_fields_reach_sampling_params() -> None:
    params = ChatCompletionRequest(
        messages=MSG,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        ignore_eos=True,
        min_tokens=2,
        max_tokens=9,
        stop_token_ids=[7],
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        stop="END",
        seed=3,
        n=2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        temperature=0.7,
        top_p=0.9,
        logprobs=True,
        top_logprobs=4,
    ).to_sampling_params()
    assert (params.top_k, params.min_p, params.repetition_penalty) == (5, 0.1, 1.2)
    assert params.ignore_eos and params.min_tokens == 2 and params.stop_token_ids == [7]
    assert not params.skip_special_tokens and params.include_stop_str_in_output
    assert params.stop == ["END"] and params.seed == 3 and params.n == 2
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert (params.temperature, params.top_p, params.logprobs) == (0.7, 0.9, 4)


def test_chat_logprobs_off_means_none_on_means_top_k() -> None:
    assert ChatCompletionRequest(messages=MSG).to_sampling_params().logprobs is None
    on = ChatCompletionRequest(messages=MSG, logprobs=True).to_sampling_params()
    assert on.logprobs == 0


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("temperature", -0.5, "temperature must be non-negative"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
        ("top_p", 1.5, "top_p must be in (0, 1]"),
        ("n", 0, "n must be at least 1"),
        ("max_tokens", -1, "max_tokens must be at least 1"),
        ("logprobs", 50, "logprobs must be in [0, 20]"),
        # vLLM's rules: top_k -1 or 0 is off, below -1 an error; seeds are 64-bit signed.
        ("top_k", -2, "top_k must be -1 or 0 (disabled) or at least 1, got -2"),
        ("seed", 2**63, "seed must be a 64-bit signed integer"),
        ("seed", -(2**63) - 1, "seed must be a 64-bit signed integer"),
        # NaN passes `x < 0` checks; JSON bodies can carry NaN/Infinity (Python's json reads them).
        ("temperature", float("nan"), "temperature must be a finite number"),
        ("temperature", float("inf"), "temperature must be a finite number"),
        ("repetition_penalty", float("nan"), "repetition_penalty must be a finite number"),
        ("repetition_penalty", float("inf"), "repetition_penalty must be a finite number"),
    ],
)
def test_out_of_range_values_raise_sampling_params_messages(
    field: str, value: object, needle: str
) -> None:
    request = CompletionRequest(prompt="x", **{field: value})
    with pytest.raises(ValueError) as info:
        request.to_sampling_params()
    assert needle in str(info.value)


@pytest.mark.parametrize(("top_k", "stored"), [(None, 0), (-1, 0), (0, 0), (1, 1), (40, 40)])
def test_top_k_off_values(top_k: int | None, stored: int) -> None:
    assert CompletionRequest(prompt="x", top_k=top_k).to_sampling_params().top_k == stored


@pytest.mark.parametrize("seed", [None, 0, -1, -(2**63), 2**63 - 1])
def test_64_bit_seeds_are_kept(seed: int | None) -> None:
    assert CompletionRequest(prompt="x", seed=seed).to_sampling_params().seed == seed


def test_text_parts_join_like_vllm() -> None:
    message = ChatMessage(
        role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    )
    assert message.text() == "a\nb"


def test_image_parts_are_refused_by_name() -> None:
    message = ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}])
    with pytest.raises(ValueError, match="'image_url' is not supported"):
        message.text()


@pytest.mark.parametrize(
    ("model", "body", "needle"),
    [
        (ChatCompletionRequest, {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        (ChatCompletionRequest, {"messages": []}, "messages"),
        (ChatCompletionRequest, {}, "messages: Field required"),
        (ChatCompletionRequest, {"messages": MSG, "max_tokens": "many"}, "max_tokens"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}, "text parts"),
        (ChatCompletionRequest, {"messages": MSG, "tools": [{"type": "x"}]}, "tools"),
        (ChatCompletionRequest, {"messages": MSG, "top_logprobs": 2}, "requires logprobs"),
        (CompletionRequest, {"prompt": ["a", [1]]}, "prompt: must be a string, a list"),
        (CompletionRequest, {"prompt": []}, "must not be an empty list"),
        (
            CompletionRequest,
            {"prompt": "x", "logit_bias": {"one": 5}},
            "logit_bias: keys must be token ids",
        ),
        (CompletionRequest, {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
        (CompletionRequest, {"prompt": "x", "best_of": 3}, "best_of"),
        (CompletionRequest, {"prompt": "x", "stream_options": {}}, "only allowed when stream"),
        (CompletionRequest, {"prompt": "x", "n": 100000}, "n must be at most 128"),
    ],
)
def test_validation_errors_read_well(model: type, body: dict, needle: str) -> None:
    message = message_for(model, body)
    assert needle in message
    assert "Value error," not in message


def test_developer_role_is_the_system_role_for_templates() -> None:
    request = ChatCompletionRequest(
        messages=[{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    )
    assert [m.template_role for m in request.messages] == ["system", "user"]


def test_unknown_role_message_names_the_roles() -> None:
    message = message_for(ChatCompletionRequest, {"messages": [{"role": "wizard", "content": "x"}]})
    assert message.startswith("messages.0.role:")
    assert "'system', 'developer', 'user', 'assistant' or 'tool'" in message
    assert "wizard" in message


def test_non_json_body_message_names_the_content_type() -> None:
    errors = [{"type": "model_attributes_type", "loc": ("body",), "msg": "bad", "input": b"x"}]
    message, _ = validation_message(errors, "application/x-www-form-urlencoded")
    assert "must be JSON" in message and "x-www-form-urlencoded" in message


def test_malformed_json_message() -> None:
    errors = [
        {"type": "json_invalid", "loc": ("body", 9), "msg": "JSON decode error",
         "ctx": {"error": "Expecting ',' delimiter"}},
    ]  # fmt: skip
    message, _ = validation_message(errors, "application/json")
    assert message == "the request body is not valid JSON: Expecting ',' delimiter at position 9"


def test_unknown_fields_are_ignored() -> None:
    request = ChatCompletionRequest(messages=MSG, store=True, service_tier="auto")
    assert request.to_sampling_params().n == 1
