"""Structured outputs through the real `openai` client against the real server (embedded
SmolLM2): JSON schemas, json_object, regex, choice and grammars hold for greedy and sampled runs,
streamed and not; bad constraints are 400s naming the field; a mixed batch leaves the free
requests' tokens as they are alone."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.json_schemas import SCHEMAS

pytestmark = pytest.mark.slow

MAX_TOKENS = 160


def _ask(name: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You answer in JSON only."},
        {"role": "user", "content": f"Give me an example of a {name.replace('_', ' ')}."},
    ]


def _schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


def test_json_schemas_hold_greedy_and_sampled(client: openai.OpenAI) -> None:
    """All 20 schemas, greedy and sampled, sent at once (the server batches them)."""
    runs = [
        (name, kwargs)
        for name in sorted(SCHEMAS)
        for kwargs in ({"temperature": 0}, {"temperature": 1.0, "top_p": 0.95, "seed": 7})
    ]

    def ask(name: str, kwargs: dict) -> tuple[str | None, str]:
        out = client.chat.completions.create(
            model="",
            messages=_ask(name),
            response_format=_schema_format(name),
            max_tokens=MAX_TOKENS,
            **kwargs,
        )
        return out.choices[0].finish_reason, out.choices[0].message.content

    with ThreadPoolExecutor(len(runs)) as pool:
        answers = list(pool.map(lambda run: ask(*run), runs))
    failures = []
    for (name, kwargs), (reason, text) in zip(runs, answers, strict=True):
        try:
            assert reason == "stop", f"finish_reason {reason}"
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{name} {kwargs}: {exc!s:.200} in {text!r:.300}")
    assert failures == []


def test_json_schema_with_n_and_streaming(client: openai.OpenAI) -> None:
    name = "sentiment"
    texts = [""] * 3
    stream = client.chat.completions.create(
        model="",
        messages=_ask(name),
        response_format=_schema_format(name),
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        n=3,
        seed=3,
        stream=True,
    )
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_object(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="",
        messages=_ask("user profile"),
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_regex_and_choice_on_both_endpoints(client: openai.OpenAI) -> None:
    pattern = r"[A-Z][a-z]{2,8} [0-9]{4}"
    chat = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Name a month and a year."}],
        extra_body={"guided_regex": pattern},
        max_tokens=30,
        temperature=0.8,
        seed=1,
    )
    assert re.fullmatch(pattern, chat.choices[0].message.content)
    choices = ["yes", "no", "maybe"]
    for seed in range(4):
        out = client.completions.create(
            model="",
            prompt="Is the sky blue? Answer:",
            extra_body={"structured_outputs": {"choice": choices}},
            max_tokens=10,
            temperature=1.0,
            seed=seed,
        )
        assert out.choices[0].text in choices
    grammar = 'root ::= "The answer is " ("red" | "blue") "."'
    out = client.completions.create(
        model="", prompt="Color?", extra_body={"guided_grammar": grammar}, max_tokens=12
    )
    assert out.choices[0].text in ("The answer is red.", "The answer is blue.")


def test_mixed_batch_leaves_free_requests_alone(client: openai.OpenAI) -> None:
    free = [f"Write one sentence about the number {i}." for i in range(3)]

    def ask_free(prompt: str) -> str:
        out = client.completions.create(model="", prompt=prompt, max_tokens=24, temperature=0)
        return out.choices[0].text

    def ask_constrained(i: int) -> str:
        out = client.chat.completions.create(
            model="",
            messages=_ask("person"),
            response_format=_schema_format("person"),
            max_tokens=MAX_TOKENS,
            temperature=0.7,
            seed=i,
        )
        return out.choices[0].message.content

    alone = [ask_free(p) for p in free]
    with ThreadPoolExecutor(8) as pool:
        constrained = [pool.submit(ask_constrained, i) for i in range(5)]
        mixed = [pool.submit(ask_free, p) for p in free]
        assert [f.result() for f in mixed] == alone
        for f in constrained:
            jsonschema.validate(json.loads(f.result()), SCHEMAS["person"])


def test_unsatisfiable_within_max_tokens_ends_with_length(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="",
        messages=_ask("long list"),
        extra_body={"guided_regex": "a{50}"},
        max_tokens=5,
    )
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content == "a" * len(out.choices[0].message.content)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },
            "response_format",
            "invalid JSON schema",
        ),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "cannot be compiled"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar", "cannot be compiled"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "response_format",
            "only one",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(
    http: httpx.Client, body: dict, param: str, words: str
) -> None:
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    r = http.post("/v1/chat/completions", json=request)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    # And on the streaming path, before any byte of the stream.
    r = http.post("/v1/chat/completions", json={**request, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
