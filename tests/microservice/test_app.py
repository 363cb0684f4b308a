"""The app in-process (ASGI) over a scripted model server, for both connectors: payload
translation, both streaming formats, error mapping, health_check, metrics, API keys."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest

from tests.microservice.conftest import run
from tests.microservice.fakes import (
    CONNECTORS,
    MODEL,
    BrokenStream,
    FakeModelServer,
    make_client,
    prompt_tokens,
    sse_body,
)
from tests.promtool import promtool_check_metrics

SEED_SYSTEM = "### You are a helpful assistant. ### Search results:  \n\n"
OPEA = {
    "messages": {"system": SEED_SYSTEM, "user": "### Question: Who are you? \n\n"},
    "max_new_tokens": 17,
    "top_p": 0.95,
    "temperature": 0.01,
    "streaming": False,
}

pytestmark = pytest.mark.parametrize("connector", CONNECTORS)


def call(
    connector: str,
    fake: FakeModelServer,
    *requests: tuple[str, str, Any],
    **settings: Any,
) -> list[httpx.Response]:
    """Send (method, path, json-or-bytes) requests to one app; return the responses."""

    async def go() -> list[httpx.Response]:
        async with make_client(connector, fake, **settings) as client:
            out = []
            for method, path, body in requests:
                if isinstance(body, bytes):
                    out.append(await client.request(method, path, content=body))
                else:
                    out.append(await client.request(method, path, json=body))
            return out

    return run(go())


def chat(connector: str, fake: FakeModelServer, body: Any, **settings: Any) -> httpx.Response:
    return call(connector, fake, ("POST", "/v1/chat/completions", body), **settings)[0]


def events(response: httpx.Response) -> list[str]:
    lines = response.text.split("\n\n")
    assert lines[-1] == "", "every event ends with a blank line"
    return [line.removeprefix("data: ") for line in lines[:-1]]


# ------------------------------------------------------------------------- translation


def test_opea_payload_reaches_the_model_server_translated(connector: str) -> None:
    fake = FakeModelServer()
    response = chat(connector, fake, {**OPEA, "top_k": 5, "repetition_penalty": 1.2, "seed": 3})
    assert response.status_code == 200
    assert fake.count("/v1/models") == 1  # the model name was discovered
    assert fake.bodies() == [
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": SEED_SYSTEM},
                {"role": "user", "content": "### Question: Who are you? \n\n"},
            ],
            "max_tokens": 17,
            "temperature": 0.01,
            "top_p": 0.95,
            "top_k": 5,
            "repetition_penalty": 1.2,
            "seed": 3,
            "stream": False,
        }
    ]


def test_openai_list_request_is_sent_as_given(connector: str) -> None:
    fake = FakeModelServer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    body = {"model": "chosen", "messages": messages, "max_tokens": 4, "stop": "x", "stream": True}
    response = chat(connector, fake, body)
    assert response.status_code == 200
    sent = fake.bodies()[0]
    assert sent["model"] == "chosen" and sent["messages"] == messages
    assert sent["max_tokens"] == 4 and sent["stream"] is True
    assert sent["stop"] in ("x", ["x"])  # langchain's stop is always a list
    assert set(sent) == {"model", "messages", "max_tokens", "stop", "stream"}
    assert fake.count("/v1/models") == 0


def test_configured_model_name_wins(connector: str) -> None:
    fake = FakeModelServer()
    chat(connector, fake, {**OPEA, "model": "asked"}, model_name="configured")
    assert fake.bodies()[0]["model"] == "configured"


def test_unsupported_field_is_warned_once_per_process(
    connector: str, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeModelServer()
    with caplog.at_level(logging.WARNING, logger="microservice"):
        responses = call(connector, fake, *[("POST", "/v1/chat/completions", OPEA)] * 3)
    assert [r.status_code for r in responses] == [200] * 3
    warnings = [r.getMessage() for r in caplog.records if "not supported" in r.getMessage()]
    assert len(warnings) == 1 and "typical_p" in warnings[0]
    assert all("typical_p" not in body for body in fake.bodies())


# ---------------------------------------------------------------------------- answers


def test_non_streaming_answer_is_opeas_generated_doc(connector: str) -> None:
    response = chat(connector, FakeModelServer(pieces=["I am ", "Wick."]), OPEA)
    body = response.json()
    assert response.headers["content-type"] == "application/json"
    assert list(body) == ["id", "text", "prompt", "streaming", "output_guardrail_params", "data"]
    assert body["text"] == "I am Wick." and body["prompt"] == OPEA["messages"]["user"]
    assert body["streaming"] is False and body["data"] is None
    assert body["output_guardrail_params"] is None and body["id"]


def test_opea_streaming_is_repr_lines_then_done(connector: str) -> None:
    pieces = ["Deep", " learning's", ' "neural"\n', "nets"]
    response = chat(connector, FakeModelServer(pieces=pieces), {**OPEA, "streaming": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text == "".join(f"data: {p!r}\n\n" for p in pieces) + "data: [DONE]\n\n"


def test_openai_format_streaming(connector: str) -> None:
    fake = FakeModelServer(pieces=["Hel", "lo"])
    response = chat(connector, fake, {**OPEA, "streaming": True}, openai_format_streaming=True)
    lines = events(response)
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert {c["model"] for c in chunks} == {MODEL} and len({c["id"] for c in chunks}) == 1
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == "Hello"
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"


def test_disable_streaming_forces_one_json_body(connector: str) -> None:
    fake = FakeModelServer()
    response = chat(connector, fake, {**OPEA, "streaming": True}, disable_streaming=True)
    assert response.json()["text"] == "Hello" and response.json()["streaming"] is False
    assert fake.bodies()[0]["stream"] is False


# ------------------------------------------------------------------ OPEA's token limit

DEFAULTED = {"messages": OPEA["messages"], "streaming": False}  # no max_new_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_opea_default_limit_fits_a_small_context(connector: str, stream: bool) -> None:
    # max_new_tokens' default of 1024 was sent as is: with --max-model-len below 1024 + the
    # prompt every OPEA request that left it out was a 400 about a limit the client never set.
    fake = FakeModelServer(max_model_len=100)
    response = chat(connector, fake, {**DEFAULTED, "streaming": stream})
    assert response.status_code == 200, response.text
    (sent,) = fake.bodies()
    assert sent["max_tokens"] == 100 - prompt_tokens(sent["messages"])
    assert fake.bodies("/tokenize") == [{"model": MODEL, "messages": sent["messages"]}]


def test_opea_default_limit_stays_1024_when_the_context_has_room(connector: str) -> None:
    fake = FakeModelServer(max_model_len=8192)
    assert chat(connector, fake, DEFAULTED).status_code == 200
    assert fake.bodies()[0]["max_tokens"] == 1024


def test_opea_default_limit_without_tokenize_upstream_is_1024(connector: str) -> None:
    fake = FakeModelServer()  # /tokenize is a 404 there: asked once, then not again
    responses = call(connector, fake, *[("POST", "/v1/chat/completions", DEFAULTED)] * 2)
    assert [r.status_code for r in responses] == [200, 200]
    assert [body["max_tokens"] for body in fake.bodies()] == [1024, 1024]
    assert fake.count("/tokenize") == 1


def test_prompt_that_fills_the_context_gets_the_model_servers_message(connector: str) -> None:
    fake = FakeModelServer(max_model_len=10)
    response = chat(connector, fake, DEFAULTED)
    assert response.status_code == 400
    assert "leaves no room" in response.json()["error"]["message"]
    assert "max_tokens" not in fake.bodies()[0]  # no limit the client never chose


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", ["max_new_tokens", "max_tokens"])
def test_explicit_limit_too_large_is_the_model_servers_400(
    connector: str, stream: bool, name: str
) -> None:
    fake = FakeModelServer(max_model_len=100)
    response = chat(connector, fake, {**DEFAULTED, name: 1000, "streaming": stream})
    assert response.status_code == 400  # passed through, not a 502
    error = response.json()["error"]
    assert "maximum context length is 100 tokens" in error["message"]
    assert error["type"] == "invalid_request_error"
    assert fake.bodies()[0]["max_tokens"] == 1000 and fake.count("/tokenize") == 0


# ----------------------------------------------------------------------------- errors


def _refuse(request: httpx.Request, _: Any) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def _slow(request: httpx.Request, _: Any) -> httpx.Response:
    raise httpx.ReadTimeout("timed out", request=request)


def _too_long(request: httpx.Request, _: Any) -> httpx.Response:
    message = "This model's maximum context length is 2048 tokens."
    return httpx.Response(400, json={"error": {"message": message, "type": "BadRequest"}})


def _crash(request: httpx.Request, _: Any) -> httpx.Response:
    return httpx.Response(500, json={"error": {"message": "engine dead"}})


def _warming(request: httpx.Request, _: Any) -> httpx.Response:
    return httpx.Response(503, json={"error": {"message": "warming up"}})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("reply", "status", "kind", "words"),
    [
        (_refuse, 503, "connect", "unreachable"),
        (_slow, 504, "timeout", "did not answer in time"),
        (_too_long, 400, "http_4xx", "maximum context length"),
        (_crash, 502, "http_5xx", "engine dead"),
        (_warming, 503, "http_5xx", "warming up"),
    ],
)
def test_upstream_failures_map_to_statuses(
    connector: str, stream: bool, reply: Any, status: int, kind: str, words: str
) -> None:
    fake = FakeModelServer(chat=reply)
    response, metrics = call(
        connector,
        fake,
        ("POST", "/v1/chat/completions", {**OPEA, "streaming": stream}),
        ("GET", "/metrics", None),
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert words in error["message"] and response.json()["detail"] == error["message"]
    assert f'llm_microservice_upstream_errors_total{{kind="{kind}"}} 1.0' in metrics.text
    assert f'llm_microservice_requests_total{{status="{status}"}} 1.0' in metrics.text


def test_model_server_down_is_503_for_discovery_too(connector: str) -> None:
    fake = FakeModelServer()

    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    fake.handler = handler  # type: ignore[method-assign]
    response = chat(connector, fake, OPEA)
    assert response.status_code == 503 and "unreachable" in response.json()["error"]["message"]


@pytest.mark.parametrize("openai_format", [False, True])
@pytest.mark.parametrize(
    "stream",
    [
        lambda: BrokenStream(sse_body(["Hel", "lo"], done=False)),
        lambda: httpx.ByteStream(
            sse_body(["Hel", "lo"], done=False) + b'data: {"error": {"message": "boom"}}\n\n'
        ),
    ],
    ids=["connection-breaks", "error-event"],
)
def test_model_server_dying_mid_stream_ends_with_an_error_event(
    connector: str, openai_format: bool, stream: Any, request: pytest.FixtureRequest
) -> None:
    request_id = request.node.callspec.id

    def reply(request: httpx.Request, _: Any) -> httpx.Response:
        return httpx.Response(200, stream=stream())

    response = chat(
        connector,
        FakeModelServer(chat=reply),
        {**OPEA, "streaming": True},
        openai_format_streaming=openai_format,
    )
    assert response.status_code == 200  # the status line was long gone
    lines = events(response)
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert error["type"] == "server_error"
    assert ("boom" if "error" in request_id else "broke") in error["message"]
    if not openai_format:
        assert lines[0] == "'Hel'"


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b"not json", 400, "not valid JSON"),
        (b"\xff\xfe\x00", 400, "UTF-8"),
        (json.dumps({"messages": {"system": "s"}}).encode(), 422, "messages.user"),
        (json.dumps({**OPEA, "max_new_tokens": 0}).encode(), 422, "max_new_tokens"),
        (json.dumps({**OPEA, "top_k": "ten"}).encode(), 422, "top_k"),
        (json.dumps({**OPEA, "top_k": -2}).encode(), 422, "top_k: must be -1 or 0 (disabled)"),
        (json.dumps({**OPEA, "seed": 2**64}).encode(), 422, "seed: must be a 64-bit"),
        (json.dumps({**OPEA, "seed": -(2**63) - 1}).encode(), 422, "seed: must be a 64-bit"),
        (b'{"messages": {"user": "caf\xe9"}}', 400, "not valid UTF-8"),
        (json.dumps({**OPEA, "temperature": float("nan")}).encode(), 400, "NaN"),
    ],
)
def test_bad_input_is_4xx_naming_the_problem(
    connector: str, body: bytes, status: int, words: str
) -> None:
    fake = FakeModelServer()
    response = chat(connector, fake, body)
    assert response.status_code == status
    assert words in response.json()["error"]["message"]
    assert fake.requests == []  # rejected before reaching the model server


def test_unknown_route_is_json_404(connector: str) -> None:
    response = call(connector, FakeModelServer(), ("GET", "/nope", None))[0]
    assert response.status_code == 404 and response.json()["error"]["message"]


# ------------------------------------------------------------------------------ health


def test_health_check_reflects_the_model_server(connector: str) -> None:
    ready, warming = FakeModelServer(), FakeModelServer(health_status=503)
    ok = call(connector, ready, ("GET", "/v1/health_check", None))[0]
    assert ok.status_code == 200
    body = ok.json()
    assert body["Service Title"] and body["Service Description"]
    assert body["model_server"]["status"] == "ready" and body["connector"] == connector
    not_ready = call(connector, warming, ("GET", "/v1/health_check", None))[0]
    assert not_ready.status_code == 503
    assert not_ready.json()["model_server"]["phase"] == "loading"


def test_health_check_is_not_ready_when_the_model_server_refuses_our_key(connector: str) -> None:
    keyed = FakeModelServer(api_key="s3cret")
    wrong = call(connector, keyed, ("GET", "/v1/health_check", None), api_key="wrong")[0]
    assert wrong.status_code == 503
    state = wrong.json()["model_server"]
    assert state["status"] == "unauthorized" and state["http_status"] == 401
    assert "LLM_API_KEY" in state["detail"]
    right = call(connector, keyed, ("GET", "/v1/health_check", None), api_key="s3cret")[0]
    assert right.status_code == 200 and right.json()["model_server"]["status"] == "ready"


def test_health_check_is_cached(connector: str) -> None:
    fake = FakeModelServer()
    call(connector, fake, *[("GET", "/v1/health_check", None)] * 5, health_cache_seconds=60)
    assert fake.count("/health") == 1
    fake = FakeModelServer()
    call(connector, fake, *[("GET", "/v1/health_check", None)] * 3, health_cache_seconds=0)
    assert fake.count("/health") == 3


# ---------------------------------------------------------------------- metrics, auth


def test_metrics_count_requests_and_pass_promtool(connector: str) -> None:
    fake = FakeModelServer()
    *_, metrics = call(
        connector,
        fake,
        ("POST", "/v1/chat/completions", OPEA),
        ("POST", "/v1/chat/completions", {**OPEA, "streaming": True}),
        ("POST", "/v1/chat/completions", b"{"),
        ("GET", "/metrics", None),
    )
    text = metrics.text
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'llm_microservice_requests_total{status="200"} 2.0' in text
    assert 'llm_microservice_requests_total{status="400"} 1.0' in text
    assert "llm_microservice_request_latency_seconds_count 3.0" in text
    assert "llm_microservice_time_to_first_token_seconds_count 1.0" in text
    assert "llm_microservice_requests_in_flight 0.0" in text
    assert 'llm_microservice_upstream_errors_total{kind="connect"} 0.0' in text
    assert promtool_check_metrics(metrics.content) == []


def test_service_api_key(connector: str) -> None:
    fake = FakeModelServer()
    settings = {"usvc_api_key": "own-key"}

    async def go() -> list[httpx.Response]:
        async with make_client(connector, fake, **settings) as client:
            path = "/v1/chat/completions"
            return [
                await client.post(path, json=OPEA),
                await client.post(path, json=OPEA, headers={"Authorization": "Bearer nope"}),
                await client.post(path, json=OPEA, headers={"Authorization": "Bearer own-key"}),
                await client.get("/v1/health_check"),
                await client.get("/metrics"),
            ]

    statuses = [r.status_code for r in run(go())]
    assert statuses == [401, 401, 200, 200, 200]


def test_llm_api_key_goes_upstream_as_bearer(connector: str) -> None:
    fake = FakeModelServer()

    async def go() -> None:
        async with make_client(connector, fake, api_key="upstream-key") as client:
            await client.post("/v1/chat/completions", json=OPEA)
            await client.post("/v1/chat/completions", json={**OPEA, "streaming": True})

    run(go())
    assert [r.headers.get("authorization") for r in fake.requests] == ["Bearer upstream-key"] * 3
