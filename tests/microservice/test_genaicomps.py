"""GenAIComps as a caller, in-process: token fields, dialects and answer formats, RAG prompts,
model-name substitution, the new settings. (The real orchestrator: test_opea_megaservice.py.)"""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from microservice import formats
from microservice.errors import ServiceError, UpstreamHTTPError
from microservice.protocol import parse_chat_request
from microservice.rag import DEFAULT_RAG_PROMPT, default_prompt, rag_messages
from microservice.settings import MicroserviceSettings
from microservice.upstream import ModelServer
from tests.microservice.conftest import run
from tests.microservice.fakes import (
    CONNECTORS,
    MODEL,
    FakeModelServer,
    completion_body,
    make_client,
)

USER = [{"role": "user", "content": "Hi"}]
# What GenAIComps' orchestrator merges into every LLM request (LLMParams' fields).
LLM_PARAMS: dict[str, Any] = {
    "id": "0f3c",
    "model": None,
    "max_tokens": 1024,
    "max_new_tokens": 1024,
    "top_k": 10,
    "top_p": 0.95,
    "typical_p": 0.95,
    "temperature": 0.01,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.03,
    "stream": False,
    "language": "auto",
    "index_name": None,
    "chat_template": None,
}


def parse(body: dict[str, Any]) -> Any:
    return parse_chat_request(json.dumps(body).encode())


# ------------------------------------------------------------------------ token fields


@pytest.mark.parametrize(
    ("limits", "sent", "default"),
    [
        ({"max_tokens": 32, "max_new_tokens": 1024}, 32, None),
        ({"max_tokens": 1024, "max_new_tokens": 32}, 32, None),
        ({"max_tokens": 40, "max_completion_tokens": 1024}, 40, None),
        ({"max_tokens": 7, "max_new_tokens": 7}, 7, None),
        # Both at LLMParams' default: nobody chose them, so "at most 1024" (context-capped).
        ({"max_tokens": 1024, "max_new_tokens": 1024}, None, 1024),
        ({"max_tokens": 1024}, 1024, None),  # one field: the client's choice, sent as is
    ],
)
def test_the_limit_changed_from_opeas_default_wins(
    limits: dict[str, int], sent: int | None, default: int | None
) -> None:
    req = parse({"messages": USER, **limits})
    assert req.sampling_params().get("max_tokens") == sent
    assert req.default_max_tokens == default


def test_two_changed_limits_are_a_clear_422() -> None:
    with pytest.raises(ServiceError) as info:
        parse({"messages": USER, "max_tokens": 32, "max_new_tokens": 64})
    assert info.value.status_code == 422
    assert "disagree" in info.value.message and "1024" in info.value.message


# ---------------------------------------------------------------- dialects and formats


@pytest.mark.parametrize(
    ("body", "dialect"),
    [
        ({"messages": {"system": "s", "user": "u"}}, "enterprise_rag"),
        ({"messages": {"user": "u"}, **LLM_PARAMS}, "enterprise_rag"),
        ({"query": "q", "streaming": False}, "enterprise_rag"),
        ({"messages": USER}, "openai"),
        ({"messages": USER, "stream": True, "max_tokens": 9}, "openai"),
        ({"messages": USER, **LLM_PARAMS}, "genaicomps"),
        ({"query": "q", "stream": True}, "genaicomps"),
        ({"messages": USER, "documents": ["d"]}, "genaicomps"),
    ],
)
def test_dialect_is_told_by_the_fields(body: dict[str, Any], dialect: str) -> None:
    assert parse(body).dialect == dialect


@pytest.mark.parametrize(
    ("setting", "openai_streaming", "body", "stream", "expected"),
    [
        ("auto", False, {"messages": USER, **LLM_PARAMS}, False, "openai"),
        ("auto", False, {"messages": USER}, False, "enterprise_rag"),
        ("auto", True, {"messages": USER}, True, "openai"),  # the older switch, streams only
        ("auto", True, {"messages": USER}, False, "enterprise_rag"),
        ("enterprise_rag", False, {"messages": USER, **LLM_PARAMS}, True, "enterprise_rag"),
        ("openai", False, {"messages": {"user": "u"}}, False, "openai"),
        ("downstream", False, {"messages": USER, **LLM_PARAMS}, True, "downstream"),
    ],
)
def test_format_follows_the_setting_then_the_request(
    setting: str, openai_streaming: bool, body: dict[str, Any], stream: bool, expected: str
) -> None:
    settings = MicroserviceSettings(
        response_format=setting, openai_format_streaming=openai_streaming
    )
    assert formats.choose(settings, parse(body), stream) == expected


def test_response_format_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert MicroserviceSettings().response_format == "auto"
    assert not MicroserviceSettings().strict_model_name
    monkeypatch.setenv("LLM_RESPONSE_FORMAT", "Enterprise-RAG")
    monkeypatch.setenv("LLM_STRICT_MODEL_NAME", "true")
    s = MicroserviceSettings()
    assert s.response_format == "enterprise_rag" and s.strict_model_name
    with pytest.raises(ValidationError, match="response_format"):
        MicroserviceSettings(response_format="xml")
    with pytest.raises(ValidationError, match="set only one of them"):
        MicroserviceSettings(response_format="downstream", openai_format_streaming=True)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_genaicomps_body_gets_openai_chat_completion(connector: str) -> None:
    async def go() -> httpx.Response:
        async with make_client(connector, FakeModelServer(pieces=["I am", " Wick."])) as client:
            return await client.post("/v1/chat/completions", json={"messages": USER, **LLM_PARAMS})

    body = run(go()).json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "I am Wick."}
    assert choice["finish_reason"] == "stop"
    assert body["usage"] == completion_body("")["usage"]  # the model server's counts


@pytest.mark.parametrize("connector", CONNECTORS)
@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("downstream", "data: b'it's'\n\ndata: b'x'\n\ndata: [DONE]\n\n"),
        ("enterprise_rag", "data: \"it's\"\n\ndata: 'x'\n\ndata: [DONE]\n\n"),
    ],
)
def test_streaming_line_formats(connector: str, setting: str, expected: str) -> None:
    # downstream: the text raw between `data: b'` and `'`, which GenAIComps' orchestrator cuts
    # off; enterprise_rag: the repr of the piece.
    fake = FakeModelServer(pieces=["it's", "x"])

    async def go() -> httpx.Response:
        async with make_client(connector, fake, response_format=setting) as client:
            body = {"messages": USER, **LLM_PARAMS, "stream": True}
            return await client.post("/v1/chat/completions", json=body)

    assert run(go()).text == expected


# ---------------------------------------------------------------------------- RAG


def test_documents_as_dicts_and_strings_keep_their_order() -> None:
    req = parse({"query": "Q?", "documents": [{"title": "t", "text": "two"}, "one"]})
    assert req.prompt_messages() == [{"role": "user", "content": default_prompt("Q?", "two\none")}]
    assert "### Search results: two\none" in req.prompt_messages()[0]["content"]
    assert req.prompt() == "Q?"  # GeneratedDoc echoes the question, not the template


def test_default_prompt_is_genaicomps_wording() -> None:
    prompt = default_prompt("Q?", "ctx")
    assert prompt.startswith("### You are a helpful, respectful and honest assistant")
    assert prompt.endswith("### Search results: ctx \n\n### Question: Q? \n\n### Answer:")
    assert "搜索结果：北京是中国的首都" in default_prompt("首都？", "北京是中国的首都")
    assert DEFAULT_RAG_PROMPT.count("{") == 2


def test_template_with_only_context_is_a_system_message() -> None:
    messages = [{"role": "user", "content": "Q?"}]
    assert rag_messages(messages, ["d1", "d2"], "Use: {context}") == [
        {"role": "system", "content": "Use: d1\nd2"},
        {"role": "user", "content": "Q?"},
    ]


def test_system_message_with_context_placeholder_is_filled() -> None:
    messages = [
        {"role": "system", "content": "Notes: {context}. Braces {ok}."},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]
    out = rag_messages(messages, ["d"], None)
    assert out[0]["content"] == "Notes: d. Braces {ok}." and out[1:] == messages[1:]


def test_template_replaces_the_last_question_only() -> None:
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]
    out = rag_messages(messages, ["d"], "{{literal}} {context} | {question}")
    assert out == [*messages[:2], {"role": "user", "content": "{literal} d | Q2"}]


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"chat_template": "{context} {history}"}, ["chat_template", "{history}"]),
        ({"chat_template": "no placeholders"}, ["chat_template", "{context}"]),
        ({"chat_template": "{question"}, ["chat_template", "not a valid template"]),
        ({"chat_template": "{0}"}, ["chat_template", "{0}"]),
        ({"documents": [{"title": "no text"}]}, ["documents.0"]),
        ({"documents": "one string"}, ["documents"]),
    ],
)
def test_bad_rag_input_is_a_clear_422(extra: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ServiceError) as info:
        parse({"query": "Q?", **extra})
    assert info.value.status_code == 422
    for word in words:
        assert word in info.value.message, info.value.message


def test_prompt_fields_are_used_not_warned_about() -> None:
    req = parse({"messages": USER, **LLM_PARAMS, "documents": ["d"], "chat_template": "{question}"})
    assert req.ignored_fields() == ["typical_p", "id", "index_name", "language"]
    assert not {"documents", "chat_template"} & set(req.sampling_params())


@pytest.mark.parametrize("connector", CONNECTORS)
def test_rag_reaches_the_model_server_with_either_connector(connector: str) -> None:
    fake = FakeModelServer()
    body = {
        "messages": {"system": "Be brief.", "user": "Q?"},
        "documents": ["d"],
        "streaming": False,
    }

    async def go() -> httpx.Response:
        async with make_client(connector, fake) as client:
            return await client.post("/v1/chat/completions", json=body)

    assert run(go()).json()["text"] == "Hello"  # Enterprise-RAG body: GeneratedDoc still
    assert fake.bodies()[0]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": default_prompt("Q?", "d")},
    ]


# ------------------------------------------------------------------------ model names


def only_model(fake_chat: FakeModelServer) -> Any:
    def chat(request: httpx.Request, payload: dict[str, Any]) -> httpx.Response:
        if payload["model"] != MODEL:
            error = {"message": f"The model `{payload['model']}` does not exist.", "code": 404}
            return httpx.Response(404, json={"error": {**error, "type": "NotFoundError"}})
        return httpx.Response(200, json=completion_body("ok"))

    return chat


@pytest.mark.parametrize("connector", CONNECTORS)
def test_unknown_model_is_served_by_the_only_one_warned_once(
    connector: str, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeModelServer()
    fake.chat = only_model(fake)  # vLLM's 404 wording: no code, the message names the model
    body = {"messages": USER, "model": "gpt-4", "stream": False}

    async def go() -> list[httpx.Response]:
        async with make_client(connector, fake) as client:
            return [await client.post("/v1/chat/completions", json=body) for _ in range(3)]

    with caplog.at_level(logging.WARNING, logger="microservice"):
        responses = run(go())
    assert [r.json()["text"] for r in responses] == ["ok"] * 3
    assert [b["model"] for b in fake.bodies()] == ["gpt-4", MODEL, MODEL, MODEL]
    assert fake.count("/v1/models") == 1
    warned = [r.getMessage() for r in caplog.records if "'gpt-4'" in r.getMessage()]
    assert len(warned) == 1 and "LLM_STRICT_MODEL_NAME" in warned[0]


@pytest.mark.parametrize("connector", CONNECTORS)
def test_strict_model_name_answers_the_404(connector: str) -> None:
    fake = FakeModelServer()
    fake.chat = only_model(fake)

    async def go() -> httpx.Response:
        async with make_client(connector, fake, strict_model_name=True) as client:
            body = {"messages": USER, "model": "gpt-4", "stream": True}
            return await client.post("/v1/chat/completions", json=body)

    response = run(go())
    assert response.status_code == 404 and "gpt-4" in response.json()["error"]["message"]
    assert fake.count("/v1/models") == 0


def test_tokenize_404_for_the_model_raises_and_keeps_tokenize_on() -> None:
    answers = iter(
        [
            httpx.Response(404, json={"error": {"message": "x", "code": "model_not_found"}}),
            httpx.Response(200, json={"count": 5, "max_model_len": 100}),
        ]
    )
    transport = httpx.MockTransport(lambda request: next(answers))
    ms = ModelServer("http://ms:1", transport=transport)

    async def go() -> int | None:
        with pytest.raises(UpstreamHTTPError):
            await ms.completion_room("wrong", USER, {})
        return await ms.completion_room("right", USER, {})

    assert run(go()) == 95


def test_substitute_needs_exactly_one_other_model() -> None:
    def models(*ids: str) -> ModelServer:
        body = {"data": [{"id": i} for i in ids]}
        transport = httpx.MockTransport(lambda request: httpx.Response(200, json=body))
        return ModelServer("http://ms:1", transport=transport)

    async def go() -> list[str | None]:
        return [
            await models("a").substitute("b"),
            await models("a", "c").substitute("b"),
            await models("b").substitute("b"),
        ]

    assert run(go()) == ["a", None, None]
