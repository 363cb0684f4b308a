"""The OpenAI API in-process (ASGI) over a tiny random-weight model: shapes, counts, errors.

The text is gibberish (random weights) but deterministic for greedy requests, which is all the
protocol checks need. The real model is driven over real sockets in tests/e2e.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from microservice.app import build_app as build_microservice
from microservice.connectors.base import Connector
from microservice.connectors.generic import GenericConnector
from microservice.connectors.langchain import LangchainConnector
from microservice.settings import MicroserviceSettings
from microservice.upstream import ModelServer
from model_server.engine.async_engine import AsyncLLM
from model_server.loader.embedded import embedded_model_path
from tests.entrypoints.conftest import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    AppClient,
    start_app,
    tiny_settings,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something."},
]
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


def assert_error(resp: Any, status: int, needle: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle in error["message"], error["message"]
    return error


# ----------------------------------------------------------------------------- basics


def test_health_version_models(api: AppClient) -> None:
    assert api.get("/health").json() == {"status": "ok", "phase": "ready"}
    assert api.get("/version").json()["version"]
    models = api.get("/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == MODEL_NAME and card["object"] == "model"
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert card["quantization"] is None  # float weights
    assert card["kv_cache_dtype"] in ("float32", "bfloat16")  # auto: the model's dtype


def test_models_root_is_the_model_path(api: AppClient, tiny_config: Path) -> None:
    # As vLLM: `root` is the --model the server loaded.
    assert api.get("/v1/models").json()["data"][0]["root"] == str(tiny_config)


def test_models_root_of_the_embedded_default_model(tiny_config: Path) -> None:
    # With no --model, `root` was null. The card is answered whatever the engine's phase, so
    # an engine that never loads keeps this test free of a model load.
    settings = tiny_settings(tiny_config, model=None, load_format="auto")

    def no_engine(config: Any) -> Any:
        raise RuntimeError("not loaded in this test")

    client = start_app(settings, AsyncLLM(settings.engine_config(), engine_factory=no_engine))
    try:
        (card,) = client.get("/v1/models").json()["data"]
        assert card["root"] == embedded_model_path() and card["id"] == MODEL_NAME
    finally:
        client.close()


def test_tokenize_detokenize_round_trip(api: AppClient) -> None:
    tok = api.post("/tokenize", json={"prompt": "Hello world, hello Wick!"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
    text = api.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text == "Hello world, hello Wick!"


def test_detokenize_rejects_ids_outside_the_vocab(api: AppClient) -> None:
    assert_error(api.post("/detokenize", json={"tokens": [1, 10**6]}), 400, "out of range")


# ------------------------------------------------------------------------ completions


def test_completion_text_prompt_usage_and_length(api: AppClient) -> None:
    body = api.post(COMPLETIONS, json={"prompt": "Once upon a time", **GREEDY}).json()
    assert body["object"] == "text_completion" and body["model"] == MODEL_NAME
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    prompt_tokens = api.post("/tokenize", json={"prompt": "Once upon a time"}).json()["count"]
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 6,
        "total_tokens": prompt_tokens + 6,
    }


def test_completion_prompt_batches_and_n(api: AppClient) -> None:
    body = api.post(
        COMPLETIONS,
        json={"prompt": ["one", "two three"], "n": 2, "temperature": 1.0, "seed": 1,
              "max_tokens": 3, "ignore_eos": True},
    ).json()  # fmt: skip
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 12


def test_completion_token_id_prompts(api: AppClient) -> None:
    ids = api.post("/tokenize", json={"prompt": "The sky is"}).json()["tokens"]
    by_text = api.post(COMPLETIONS, json={"prompt": "The sky is", **GREEDY}).json()
    by_ids = api.post(COMPLETIONS, json={"prompt": ids, **GREEDY}).json()
    batch = api.post(COMPLETIONS, json={"prompt": [ids, ids[:2]], **GREEDY}).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert batch["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert batch["usage"]["prompt_tokens"] == len(ids) + 2


def test_client_request_id_is_kept(api: AppClient) -> None:
    resp = api.post(COMPLETIONS, json={"prompt": "x", **GREEDY}, headers={"X-Request-Id": "abc"})
    assert resp.json()["id"] == "cmpl-abc"
    resp = api.post(CHAT, json={"messages": MESSAGES, "request_id": "r1", **GREEDY})
    assert resp.json()["id"] == "chatcmpl-r1"


def test_completion_echo(api: AppClient) -> None:
    plain = api.post(COMPLETIONS, json={"prompt": "Echo me", **GREEDY}).json()
    echoed = api.post(COMPLETIONS, json={"prompt": "Echo me", "echo": True, **GREEDY}).json()
    assert echoed["choices"][0]["text"] == "Echo me" + plain["choices"][0]["text"]


def test_completion_logprobs_shape(api: AppClient) -> None:
    body = api.post(COMPLETIONS, json={"prompt": "a b c", "logprobs": 2, **GREEDY}).json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert "".join(lp["tokens"]) == body["choices"][0]["text"]
    for token, logprob, top in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
    ):
        assert logprob <= 0 and 2 <= len(top) <= 3 and token in top
        # greedy: the sampled token is the likeliest one
        assert logprob == pytest.approx(max(top.values()), abs=1e-4)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_completion_streaming_matches_non_streaming(api: AppClient) -> None:
    request = {"prompt": "Stream this", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    full = api.post(COMPLETIONS, json=request).json()
    events = api.sse(COMPLETIONS, {**request, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    text = "".join(c["text"] for chunk in chunks for c in chunk["choices"])
    assert text == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]


# ------------------------------------------------------------------------------- chat


def test_chat_shape_and_exact_usage(api: AppClient) -> None:
    body = api.post(CHAT, json={"messages": MESSAGES, **GREEDY}).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    # The prompt count includes every token the chat template adds.
    count = api.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert count > 10
    assert body["usage"] == {"prompt_tokens": count, "completion_tokens": 6,
                             "total_tokens": count + 6}  # fmt: skip


def test_chat_content_parts_equal_plain_content(api: AppClient) -> None:
    text_parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]
    parts = [{"role": "user", "content": text_parts}]
    plain = [{"role": "user", "content": "Say\nhi"}]
    a = api.post(CHAT, json={"messages": parts, **GREEDY}).json()
    b = api.post(CHAT, json={"messages": plain, **GREEDY}).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"] == b["usage"]


def test_chat_streaming_matches_non_streaming(api: AppClient) -> None:
    request = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    full = api.post(CHAT, json=request).json()
    events = api.sse(CHAT, {**request, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    first, *chunks, usage_chunk = events[:-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)
    assert text == full["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert usage_chunk["usage"] == full["usage"]


def test_chat_stream_without_usage_has_no_usage_chunk(api: AppClient) -> None:
    events = api.sse(CHAT, {"messages": MESSAGES, **GREEDY})
    assert all(event.get("usage") is None for event in events[:-1])
    assert all(event["choices"] for event in events[:-1])


def test_chat_n2_streaming(api: AppClient) -> None:
    request = {"messages": MESSAGES, "n": 2, "max_tokens": 4, "ignore_eos": True, "seed": 5}
    events = api.sse(CHAT, request)[:-1]
    finishes = {
        c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]
    }
    assert finishes == {0: "length", 1: "length"}


def test_chat_logprobs_shape(api: AppClient) -> None:
    body = api.post(
        CHAT, json={"messages": MESSAGES, "logprobs": True, "top_logprobs": 3, **GREEDY}
    ).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 6
    assert "".join(t["token"] for t in content) == body["choices"][0]["message"]["content"]
    for entry in content:
        assert len(entry["top_logprobs"]) == 3 and entry["bytes"] == list(entry["token"].encode())
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-4)


def test_chat_continue_final_message(api: AppClient) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "Well"}]
    body = api.post(
        CHAT,
        json={"messages": messages, "continue_final_message": True,
              "add_generation_prompt": False, **GREEDY},
    )  # fmt: skip
    assert body.status_code == 200, body.text


# -------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("url", "body", "status", "needle"),
    [
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        (CHAT, {"messages": "hello"}, 400, "messages"),
        (CHAT, {}, 400, "messages: Field required"),
        (CHAT, {"messages": MESSAGES, "max_tokens": -3}, 400, "max_tokens must be at least 1"),
        (CHAT, {"messages": MESSAGES, "max_tokens": 10**9}, 400, "maximum context length"),
        (CHAT, {"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
        (CHAT, {"messages": MESSAGES, "top_p": 0}, 400, "top_p"),
        (CHAT, {"messages": MESSAGES, "top_p": 1.01}, 400, "top_p"),
        (CHAT, {"messages": MESSAGES, "n": 0}, 400, "n must be at least 1"),
        (CHAT, {"messages": MESSAGES, "model": "gpt-9"}, 404, "`gpt-9` does not exist"),
        (CHAT, {"messages": MESSAGES, "n": "two"}, 400, "n:"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            400,
            "image_url",
        ),
        (COMPLETIONS, {"prompt": "x" * 5000}, 400, "maximum context length is 256"),
        (COMPLETIONS, {"prompt": [1, 2, 10**7]}, 400, "out of range for the vocabulary"),
        (COMPLETIONS, {"prompt": [-1]}, 400, "out of range"),
        (COMPLETIONS, {"prompt": ""}, 400, "empty"),
        (COMPLETIONS, {"prompt": 12}, 400, "prompt: must be"),
        (COMPLETIONS, {"prompt": "x", "model": "nope"}, 404, "does not exist"),
        (COMPLETIONS, {"prompt": "x", "stop": [1]}, 400, "stop"),
        # vLLM's rule: top_k -1 or 0 is off, below -1 an error (was silently "off").
        (CHAT, {"messages": MESSAGES, "top_k": -2}, 400, "top_k must be -1 or 0 (disabled) or"),
        (COMPLETIONS, {"prompt": "x", "top_k": -50}, 400, "top_k must be -1 or 0 (disabled)"),
        # Seeds are 64-bit signed integers, as in vLLM (were accepted whatever their size).
        (CHAT, {"messages": MESSAGES, "seed": 2**63}, 400, "seed must be a 64-bit signed"),
        (COMPLETIONS, {"prompt": "x", "seed": -(2**63) - 1}, 400, "seed must be a 64-bit"),
        (COMPLETIONS, {"prompt": "x", "seed": 10**30}, 400, "seed must be a 64-bit"),
        ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "does not exist"),
    ],
)
def test_bad_requests_answer_4xx_in_openai_format(
    api: AppClient, url: str, body: dict, status: int, needle: str
) -> None:
    error = assert_error(api.post(url, json=body), status, needle)
    assert error["type"] == "invalid_request_error"
    if status == 404:
        assert error["code"] == "model_not_found"


@pytest.mark.parametrize(
    "kwargs",
    [{"messages": []}, {"add_generation_prompt": False}, {"tokenize": True}, {"tokenizer": 1}],
)
@pytest.mark.parametrize("url", [CHAT, "/tokenize"])
def test_chat_template_kwargs_cannot_override_server_arguments(
    api: AppClient, url: str, kwargs: dict
) -> None:
    # Were TypeErrors ("got multiple values for argument ...") answered as 500s.
    body = {"messages": MESSAGES, "chat_template_kwargs": kwargs, **GREEDY}
    error = assert_error(api.post(url, json=body), 400, "chat_template_kwargs must not set")
    assert error["param"] == "chat_template_kwargs"
    assert next(iter(kwargs)) in error["message"]


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"1e999"])
@pytest.mark.parametrize("field", [b"temperature", b"repetition_penalty"])
def test_non_finite_sampling_values_are_400(api: AppClient, field: bytes, value: bytes) -> None:
    # Python's json reads NaN/Infinity; they used to reach the sampler (200 with garbage).
    body = b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "%s": %s}' % (
        field,
        value,
    )
    resp = api.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert_error(resp, 400, f"{field.decode()} must be a finite number")


SAMPLED = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True}


def test_top_k_minus_one_and_zero_both_mean_off(api: AppClient) -> None:
    texts = {
        top_k: api.post(
            COMPLETIONS, json={"prompt": "Once", "top_k": top_k, "seed": 11, **SAMPLED}
        ).json()["choices"][0]["text"]
        for top_k in (-1, 0, None)
    }
    assert texts[-1] == texts[0] == texts[None]


@pytest.mark.parametrize("seed", [0, -1, 12345, -(2**63), 2**63 - 1])
@pytest.mark.parametrize("url", [CHAT, COMPLETIONS])
def test_every_64_bit_seed_gives_reproducible_samples(api: AppClient, url: str, seed: int) -> None:
    body = {"messages": MESSAGES} if url == CHAT else {"prompt": "Once upon"}
    responses = [api.post(url, json={**body, "seed": seed, "n": 2, **SAMPLED}) for _ in range(2)]
    assert [r.status_code for r in responses] == [200, 200], responses[0].text
    first, again = (
        [c["text"] if url == COMPLETIONS else c["message"]["content"] for c in r.json()["choices"]]
        for r in responses
    )
    assert first == again


def test_developer_role_is_rendered_as_system(api: AppClient) -> None:
    developer = [{"role": "developer", "content": "You are terse."}, MESSAGES[1]]
    as_system = api.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert api.post("/tokenize", json={"messages": developer}).json()["tokens"] == as_system
    resp = api.post(CHAT, json={"messages": developer, **GREEDY})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == len(as_system)


def test_streaming_bad_request_is_a_4xx_not_a_broken_stream(api: AppClient) -> None:
    resp = api.post(COMPLETIONS, json={"prompt": "x" * 5000, "stream": True})
    assert_error(resp, 400, "maximum context length")


def test_malformed_json_and_wrong_content_type(api: AppClient) -> None:
    resp = api.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert_error(resp, 400, "not valid JSON")
    resp = api.post(CHAT, content=b"messages=hi", headers={"content-type": "text/plain"})
    assert_error(resp, 400, "must be JSON")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'{"prompt": "caf\xe9"}', "not valid UTF-8 (byte 15)"),
        (b'\xff\xfe{"prompt": "x"}', "not valid UTF-8 (byte 0)"),  # guessed as UTF-16 first
        (b"[" * 100_000, "not valid JSON: it is nested too deeply"),
    ],
)
@pytest.mark.parametrize("url", [CHAT, COMPLETIONS, "/tokenize", "/detokenize"])
def test_undecodable_bodies_are_400_saying_why(
    api: AppClient, url: str, body: bytes, needle: str
) -> None:
    # These were FastAPI's bare "There was an error parsing the body".
    resp = api.post(url, content=body, headers={"content-type": "application/json"})
    error = assert_error(resp, 400, needle)
    assert error["type"] == "invalid_request_error"


def test_unknown_route_and_method_use_the_error_format(api: AppClient) -> None:
    assert_error(api.get("/v1/nothing"), 404, "Not Found")
    assert_error(api.get(CHAT), 405, "Method Not Allowed")


def test_the_server_keeps_serving_after_bad_input(api: AppClient) -> None:
    for _ in range(3):
        api.post(COMPLETIONS, json={"prompt": [10**7]})
    ok = api.post(COMPLETIONS, json={"prompt": "still fine", **GREEDY})
    assert ok.status_code == 200


# ------------------------------------------------------------- the microservice in front

OPEA_CHAT = {
    "messages": {"system": "You are terse.", "user": "Say something."},
    "temperature": 0,
    "streaming": False,
}


class _RecordingTransport(httpx.ASGITransport):
    def __init__(self, app: Any) -> None:
        super().__init__(app=app)
        self.sent: list[tuple[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append((request.url.path, json.loads(request.content or b"null")))
        return await super().handle_async_request(request)


def _through_microservice(
    api: AppClient, connector: str, bodies: list[dict]
) -> tuple[list[httpx.Response], list[tuple[str, Any]]]:
    """POST `bodies` to the microservice's chat route, with this model server (in-process,
    on its event loop) as its upstream; the responses and what reached the model server."""
    upstream = _RecordingTransport(api.app)

    async def go() -> list[httpx.Response]:
        model_server = ModelServer("http://wick", transport=upstream)
        conn: Connector = (
            LangchainConnector(model_server)
            if connector == "langchain"
            else GenericConnector(model_server)
        )
        app = build_microservice(MicroserviceSettings(connector=connector), conn)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://usvc") as client:
            responses = [await client.post(CHAT, json=body, timeout=60) for body in bodies]
        await conn.aclose()
        return responses

    return api.call(go()), upstream.sent


@pytest.fixture()
def no_llm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("LLM_"):
            monkeypatch.delenv(name)


@pytest.mark.usefixtures("no_llm_env")
@pytest.mark.parametrize("connector", ["generic", "langchain"])
def test_opea_default_limit_fits_this_servers_context(api: AppClient, connector: str) -> None:
    # OPEA's default max_new_tokens (1024) exceeds this server's 256-token context: every OPEA
    # request that left it out was a 400. The microservice now sends what the prompt leaves.
    responses, sent = _through_microservice(api, connector, [OPEA_CHAT])
    assert responses[0].status_code == 200, responses[0].text
    assert responses[0].json()["text"]
    tokenize = next(body for path, body in sent if path == "/tokenize")
    chat = next(body for path, body in sent if path == CHAT)
    count = api.post("/tokenize", json=tokenize).json()["count"]
    assert chat["max_tokens"] == MAX_MODEL_LEN - count


@pytest.mark.usefixtures("no_llm_env")
@pytest.mark.parametrize("streaming", [False, True])
def test_explicit_limit_too_large_passes_through_as_400(api: AppClient, streaming: bool) -> None:
    body = {**OPEA_CHAT, "max_new_tokens": 1000, "streaming": streaming}
    responses, sent = _through_microservice(api, "generic", [body])
    error = responses[0].json()["error"]
    assert responses[0].status_code == 400, responses[0].text
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert [path for path, _ in sent] == ["/v1/models", CHAT]  # no /tokenize: nothing to cap


# -------------------------------------------------------------------- auth & phases


def test_api_key_guards_everything_but_probes(tiny_config: Path) -> None:
    client = start_app(tiny_settings(tiny_config, api_key="s3cret"))
    try:
        error = assert_error(client.post(COMPLETIONS, json={"prompt": "x"}), 401, "API key")
        assert error["type"] == "authentication_error"
        assert client.get("/v1/models").status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert client.post("/tokenize", json={"prompt": "x"}, headers=wrong).status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        resp = client.post(COMPLETIONS, json={"prompt": "x", **GREEDY}, headers=good)
        assert resp.status_code == 200
        for open_path in ("/health", "/version", "/metrics"):
            assert client.get(open_path).status_code == 200, open_path
    finally:
        client.close()


def test_health_is_503_with_the_phase_until_loaded(tiny_config: Path) -> None:
    settings = tiny_settings(tiny_config)
    release = threading.Event()

    def slow_factory(config: Any) -> Any:
        release.wait(30)
        raise RuntimeError("test engine never loads")

    engine = AsyncLLM(settings.engine_config(), engine_factory=slow_factory)
    client = start_app(settings, engine)
    try:
        resp = client.get("/health")
        assert resp.status_code == 503 and resp.json()["phase"] == "loading"
        assert_error(client.post(COMPLETIONS, json={"prompt": "x"}), 503, "not ready")
        assert_error(client.post("/tokenize", json={"prompt": "x"}), 503, "not ready")
        release.set()
        client.call(engine.wait_until_failed(), timeout=10)
        resp = client.get("/health")
        assert resp.status_code == 503 and resp.json()["phase"] == "error"
        assert "never loads" in resp.json()["message"]
        assert_error(client.post(COMPLETIONS, json={"prompt": "x"}), 500, "engine failed")
    finally:
        release.set()
        client.close()
