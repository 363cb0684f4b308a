"""Reasoning models end to end: a loopback server started with `--reasoning-parser auto`, the real
`openai` client.

The model is tiny and random, so its output is forced: its tokenizer (the embedded SmolLM2's)
gets Qwen3's `<think>` / `</think>` as added tokens, its chat template opens `<think>` for the
answer (closes it with enable_thinking false, as Qwen3's does), and requests bias `</think>`
(`logit_bias`), so seeded samples think a few random tokens, close the thinking and answer. What
the model wrote is read back through /v1/completions with the same prompt tokens and seed (that
endpoint does not split), and must be reasoning + `</think>` + content."""

from __future__ import annotations

import ast
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from model_server.engine.async_engine import AsyncLLM
from model_server.entrypoints.cli import build_parser
from model_server.entrypoints.openai.api_server import build_app
from model_server.loader.embedded import embedded_model_available, embedded_model_path
from tests.entrypoints.conftest import MODEL_NAME, TINY_CONFIG, tiny_settings
from tests.loopback import serve_asgi

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            # Letters only: a random model's strings may hold control characters otherwise.
            "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@dataclass
class Served:
    url: str
    client: openai.OpenAI
    http: httpx.Client
    end_id: int


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    if not embedded_model_available():
        pytest.skip("the embedded SmolLM2 (its tokenizer) is not installed")
    from model_server.loader.gguf_file import read_gguf
    from model_server.loader.gguf_tokenizer import gguf_tokenizer

    folder = tmp_path_factory.mktemp("thinking-model")
    tokenizer = gguf_tokenizer(read_gguf(embedded_model_path()))
    tokenizer.add_tokens(["<think>", "</think>"])  # as Qwen3's: added, not special
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**TINY_CONFIG, "vocab_size": 49216}))
    end_id = tokenizer.convert_tokens_to_ids("</think>")
    settings = tiny_settings(Path(folder), reasoning_parser="auto")
    llm = AsyncLLM(settings.engine_config(), skip_warmup=True)
    with serve_asgi(build_app(llm, settings)) as url, httpx.Client(base_url=url, timeout=60) as h:
        _wait_ready(h)  # the app's lifespan started the engine
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        yield Served(url, client, h, end_id)


def _wait_ready(http: httpx.Client) -> None:
    deadline = time.monotonic() + 120
    while http.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the server did not get ready"
        time.sleep(0.1)


def _forced(served: Served, seed: int, **extra: Any) -> dict[str, Any]:
    """Sampling fields that make the model close its thinking soon: `</think>` biased."""
    return {
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": 40,
        "logit_bias": {str(served.end_id): 9.0},
        **extra,
    }


def _raw_output(served: Served, body: dict[str, Any], template_kwargs: dict | None = None) -> str:
    """What the model wrote for the chat `body` (no split): the same prompt tokens through
    /v1/completions, with the same seed and sampling fields."""
    tokenized = served.http.post(
        "/tokenize",
        json={"messages": body["messages"], "chat_template_kwargs": template_kwargs or {}},
    )
    assert tokenized.status_code == 200, tokenized.text
    fields = ("temperature", "seed", "max_tokens", "logit_bias")
    resp = served.http.post(
        "/v1/completions",
        json={"prompt": tokenized.json()["tokens"], **{k: body[k] for k in fields}},
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def _thinking_answer(served: Served, **extra: Any) -> tuple[int, Any]:
    """The first seed whose answer thinks something before closing the thinking."""
    for seed in range(12):
        out = served.client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, **_forced(served, seed, **extra)
        )
        message = out.choices[0].message
        answered = message.content is not None or message.tool_calls
        if getattr(message, "reasoning_content", None) and answered:
            return seed, out
    raise AssertionError("no seed gave a thinking answer")


def test_the_thinking_goes_to_reasoning_content(served: Served) -> None:
    seed, out = _thinking_answer(served)
    message = out.choices[0].message
    reasoning = message.reasoning_content
    assert message.reasoning == reasoning  # vLLM's newer name, the same text
    assert "</think>" not in reasoning
    raw = _raw_output(served, {"messages": MESSAGES, **_forced(served, seed)})
    assert raw == f"{reasoning}</think>{message.content}"


def test_a_stream_splits_the_same_way(served: Served) -> None:
    seed, whole = _thinking_answer(served)
    stream = served.client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, stream=True, **_forced(served, seed)
    )
    reasoning, content, reason, chunks = "", "", None, 0
    for chunk in stream:
        chunks += 1
        delta = chunk.choices[0].delta
        piece = getattr(delta, "reasoning_content", None)
        assert getattr(delta, "reasoning", None) == piece
        if piece:
            assert "</think>" not in piece and not content, "reasoning after the content"
            reasoning += piece
        content += delta.content or ""
        reason = chunk.choices[0].finish_reason or reason
    message = whole.choices[0].message
    assert (reasoning, content) == (message.reasoning_content, message.content)
    assert reason == whole.choices[0].finish_reason
    assert chunks > 3  # streamed piece by piece, not in one chunk


@pytest.mark.parametrize(
    "switch",
    [{"enable_thinking": False}, {"chat_template_kwargs": {"enable_thinking": False}}],
    ids=["top-level", "chat_template_kwargs"],
)
def test_enable_thinking_false_gives_no_reasoning(served: Served, switch: dict) -> None:
    body = {"messages": MESSAGES, **_forced(served, 0)}
    out = served.client.chat.completions.create(model=MODEL_NAME, **body, extra_body=switch)
    message = out.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert getattr(message, "reasoning", None) is None
    raw = _raw_output(served, body, {"enable_thinking": False})
    assert message.content == raw  # a `</think>` it writes is content too
    # The template got the switch: its prompt closes the thinking.
    prompt = served.http.post(
        "/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    ).json()["tokens"]
    assert served.end_id in prompt
    stream = served.client.chat.completions.create(
        model=MODEL_NAME, stream=True, **body, extra_body=switch
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert not any(getattr(d, "reasoning_content", None) for d in deltas)
    assert "".join(d.content or "" for d in deltas) == raw


def test_structured_output_applies_after_the_thinking(served: Served) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    seed, out = _thinking_answer(served, response_format=fmt, max_tokens=60)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert choice.message.reasoning_content  # random text: the grammar did not hold it
    stream = served.client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        stream=True,
        **_forced(served, seed, response_format=fmt, max_tokens=60),
    )
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert content == choice.message.content


def test_tool_calls_are_read_from_the_answer_after_the_thinking(served: Served) -> None:
    seed, out = _thinking_answer(
        served, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=60
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert choice.message.reasoning_content
    stream = served.client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        stream=True,
        **_forced(
            served,
            seed,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=60,
        ),
    )
    calls, reasoning = [], ""
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            calls += delta.tool_calls or []
            reasoning += getattr(delta, "reasoning_content", None) or ""
    assert reasoning == choice.message.reasoning_content
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == json.loads(call.function.arguments)


@pytest.mark.parametrize(
    ("field", "needle"),
    [
        ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"enable_thinking": "yes"}, "enable_thinking"),
        ({"chat_template_kwargs": {"enable_thinking": "false"}}, "enable_thinking"),
        (
            {"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}},
            "disagree",
        ),
    ],
)
def test_bad_values_are_400_naming_the_field(served: Served, field: dict, needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        served.client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=2, extra_body=field
        )
    assert needle in caught.value.message
    assert caught.value.status_code == 400


def test_an_unknown_parser_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["serve", "--reasoning-parser", "o1"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "--reasoning-parser" in err and "'o1'" in err and "qwen3" in err


def test_an_unknown_parser_in_the_environment_is_refused() -> None:
    from pydantic import ValidationError

    from model_server.settings import ServerSettings

    with pytest.raises(ValidationError, match="reasoning_parser 'o1' is not known"):
        ServerSettings(reasoning_parser="o1")


# ---- the OPEA microservice in front ------------------------------------------------------


@pytest.fixture(scope="module")
def usvc(served: Served) -> Iterator[dict[str, str]]:
    """Microservices over the thinking model server: OpenAI's format, OPEA's text format, and
    OPEA's text format with LLM_USVC_INCLUDE_REASONING."""
    from contextlib import ExitStack

    from microservice.app import build_app as build_usvc
    from microservice.connectors import make_connector
    from microservice.settings import MicroserviceSettings

    urls = {}
    with ExitStack() as stack:
        for name, fields in (
            ("openai", {"response_format": "openai"}),
            ("text", {"response_format": "enterprise_rag"}),
            ("text+reasoning", {"response_format": "enterprise_rag", "include_reasoning": True}),
        ):
            settings = MicroserviceSettings(model_server_endpoint=served.url, **fields)
            app = build_usvc(settings, make_connector(settings))
            urls[name] = stack.enter_context(serve_asgi(app))
        yield urls


def _usvc_body(served: Served, seed: int) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": MESSAGES, **_forced(served, seed)}


def _sse_data(text: str) -> list[str]:
    return [b[len("data: ") :] for b in text.split("\n\n") if b.startswith("data: ")]


def test_the_microservice_passes_reasoning_through_in_openai_format(
    served: Served, usvc: dict[str, str]
) -> None:
    url = f"{usvc['openai']}/v1/chat/completions"
    for seed in range(12):
        message = httpx.post(url, json=_usvc_body(served, seed), timeout=60).json()
        message = message["choices"][0]["message"]
        if message.get("reasoning_content") and message["content"]:
            break
    else:
        raise AssertionError("no seed gave a thinking answer")
    assert message["reasoning"] == message["reasoning_content"]
    streamed = httpx.post(url, json={**_usvc_body(served, seed), "stream": True}, timeout=60)
    reasoning, content = "", ""
    for data in _sse_data(streamed.text):
        if data == "[DONE]":
            continue
        delta = json.loads(data)["choices"][0]["delta"]
        assert delta.get("reasoning") == delta.get("reasoning_content")
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
    assert (reasoning, content) == (message["reasoning_content"], message["content"])

    # OPEA's text mode leaves the thinking out unless LLM_USVC_INCLUDE_REASONING.
    body = _usvc_body(served, seed)
    text = httpx.post(f"{usvc['text']}/v1/chat/completions", json=body, timeout=60).json()
    assert text["text"] == message["content"]
    full = httpx.post(f"{usvc['text+reasoning']}/v1/chat/completions", json=body, timeout=60)
    thinking = f"<think>{message['reasoning_content']}</think>"
    assert full.json()["text"] == thinking + message["content"]
    for name, expected in (("text", message["content"]), ("text+reasoning", thinking + content)):
        resp = httpx.post(
            f"{usvc[name]}/v1/chat/completions", json={**body, "stream": True}, timeout=60
        )
        pieces = [d for d in _sse_data(resp.text) if d != "[DONE]"]
        assert "".join(ast.literal_eval(p) for p in pieces) == expected, name


def test_the_microservice_switch_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    from microservice.settings import MicroserviceSettings

    assert MicroserviceSettings().include_reasoning is False
    monkeypatch.setenv("LLM_USVC_INCLUDE_REASONING", "true")
    assert MicroserviceSettings().include_reasoning is True
    monkeypatch.setenv("LLM_CONNECTOR", "langchain")
    with pytest.raises(ValidationError, match="LLM_USVC_INCLUDE_REASONING=true needs"):
        MicroserviceSettings()


def test_responses_carry_the_thinking_as_a_reasoning_item(served: Served) -> None:
    seed, chat = _thinking_answer(served)
    message = chat.choices[0].message
    fields = {"seed": seed, "logit_bias": {str(served.end_id): 9.0}}
    resp = served.client.responses.create(
        model=MODEL_NAME, input=MESSAGES, temperature=1.0, max_output_tokens=40, extra_body=fields
    )
    reasoning, answer = resp.output
    assert reasoning.type == "reasoning" and answer.type == "message"
    assert reasoning.content[0].text == message.reasoning_content
    assert resp.output_text == message.content
    events = list(
        served.client.responses.create(
            model=MODEL_NAME,
            input=MESSAGES,
            temperature=1.0,
            max_output_tokens=40,
            extra_body=fields,
            stream=True,
        )
    )
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, text) == (message.reasoning_content, message.content)
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]


def test_tokenize_takes_the_enable_thinking_shortcut(served: Served) -> None:
    def tokens(**fields: Any) -> httpx.Response:
        return served.http.post("/tokenize", json={"messages": MESSAGES, **fields})

    closed = tokens(enable_thinking=False).json()["tokens"]
    assert closed == tokens(chat_template_kwargs={"enable_thinking": False}).json()["tokens"]
    assert served.end_id in closed and served.end_id not in tokens().json()["tokens"]
    bad = tokens(enable_thinking=True, chat_template_kwargs={"enable_thinking": False})
    assert bad.status_code == 400 and "disagree" in bad.json()["error"]["message"]


def test_qwen3_on_a_model_without_think_tokens(tiny_config: Path) -> None:
    """`--reasoning-parser qwen3` over the plain tiny model (SmolLM2's template opens no
    thinking, `</think>` is several tokens): answers that do not open thinking are all content,
    and structured outputs, which would need `</think>` as one token, are a 400 saying so."""
    settings = tiny_settings(tiny_config, reasoning_parser="qwen3")
    llm = AsyncLLM(settings.engine_config(), skip_warmup=True)
    with serve_asgi(build_app(llm, settings)) as url, httpx.Client(base_url=url, timeout=60) as h:
        _wait_ready(h)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0
        )
        message = out.choices[0].message
        assert message.content and message.reasoning_content is None
        raw = client.completions.create(
            model=MODEL_NAME,
            prompt=h.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"],
            max_tokens=8,
            temperature=0,
        )
        assert message.content == raw.choices[0].text
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL_NAME,
                messages=MESSAGES,
                max_tokens=8,
                response_format={"type": "json_object"},
            )
        assert "response_format" in caught.value.message and "one token" in caught.value.message
        # With the thinking off, the grammar constrains the whole answer.
        out = client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=8,
            response_format={"type": "json_object"},
            extra_body={"enable_thinking": False},
        )
        assert out.choices[0].message.content.lstrip().startswith("{")
