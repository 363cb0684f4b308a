"""The LLM microservice as users run it (`python -m microservice`, real sockets) in front of the
real model server with the embedded SmolLM2, for both connectors: the seed README's curl
payloads verbatim, OpenAI requests and chunk streaming, parameters reaching the model server,
health_check through the model server's life (down, warming, ready, killed), disconnects, metrics;
and GenAIComps' real orchestrator and gateway in front of it (opea-comps, a venv of its own).
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import ServerProcess, free_port, launch, metric
from tests.promtool import promtool_check_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CONNECTORS = ("generic", "langchain")
ROOT = Path(__file__).parents[2]

# The seed README's two curl payloads (opea-vllm-model-server-README.md), byte for byte.
SEED_NON_STREAMING = """{
                "messages": {
                    "system": "### You are a helpful, respectful, and honest assistant to help the user with questions. Please refer to the search results obtained from the local knowledge base. Refer also to the conversation history if you think it is relevant to the current question. Ignore all information that you think is not relevant to the question. If you dont know the answer to a question, please dont share false information. ### Search results:  \\n\\n",
                    "user": "### Question: Who are you? \\n\\n"
                    },
                "max_new_tokens":17,
                "top_p":0.95,
                "temperature":0.01,
                "streaming":false
            }"""  # noqa: E501
SEED_STREAMING = """{
                "messages": {
                    "system": "### You are a helpful, respectful, and honest assistant to help the user with questions. Please refer to the search results obtained from the local knowledge base. Refer also to the conversation history if you think it is relevant to the current question. Ignore all information that you think is not relevant to the question. If you dont know the answer to a question, please dont share false information. ### Search results:  \\n\\n",
                    "user": "### Question: What is Deep Learning? \\n\\n"
                    },
                "max_new_tokens":32,
                "top_p":0.95,
                "temperature":0.01,
                "streaming":true
            }"""  # noqa: E501
JSON_HEADERS = {"Content-Type": "application/json"}
QUESTION = "What is the capital of France?"
GREEDY = {
    "messages": {
        "system": "You are a helpful assistant.",
        "user": QUESTION,
    },
    "max_new_tokens": 8,
    "temperature": 0,
    "streaming": False,
}
LONG = {
    "messages": {"system": "", "user": "Write a very long story about a dragon."},
    "max_new_tokens": 1500,
    "ignore_eos": True,
}


# --------------------------------------------------------------------- the microservice


@dataclass
class Microservice(ServerProcess):
    """`ServerProcess` (url, log, stop) for the microservice, which is up before it is ready."""

    connector: str

    def wait_up(self, timeout: float = 60) -> None:
        """Until it answers (any status: the model server may well be down)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"microservice exited with {self.proc.returncode}:\n{self.log()}"
                )
            try:
                httpx.get(f"{self.url}/v1/health_check", timeout=5)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise TimeoutError(f"microservice not up after {timeout}s:\n{self.log()}")


def start_microservice(log_dir: Path, endpoint: str, connector: str, **env: str) -> Microservice:
    """`python -m microservice` on a free loopback port; settings through the environment (as
    compose and helm pass them), listening address and port through flags."""
    port = free_port()
    log_path = log_dir / f"microservice-{connector}-{port}.log"
    cmd = [sys.executable, "-m", "microservice", "--host", "127.0.0.1", "--port", str(port)]
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("LLM_", "VLLM_"))}
    environ |= {"LLM_MODEL_SERVER_ENDPOINT": endpoint, "LLM_CONNECTOR": connector, **env}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environ, cwd=ROOT)
    return Microservice(proc, port, log_path, connector)


def stop_all(services: list[Microservice]) -> None:
    codes = {f"{s.connector}:{s.port}": s.stop() for s in services}
    failed = {name: code for name, code in codes.items() if code != 0}
    assert not failed, f"microservices did not exit 0 on SIGTERM: {failed}"


@pytest.fixture(scope="module")
def services(
    server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[tuple[str, bool], Microservice]]:
    """Per connector, one microservice streaming OPEA's format and one streaming OpenAI's,
    all in front of the session's model server."""
    log_dir = tmp_path_factory.mktemp("microservice")
    started = {
        (connector, openai_format): start_microservice(
            log_dir,
            server.url,
            connector,
            LLM_OPENAI_FORMAT_STREAMING=str(openai_format).lower(),
        )
        for connector in CONNECTORS
        for openai_format in (False, True)
    }
    try:
        for service in started.values():
            service.wait_up()
        yield started
    finally:
        stop_all(list(started.values()))


@pytest.fixture(params=CONNECTORS)
def usvc(request: pytest.FixtureRequest, services: dict) -> Microservice:
    return services[(request.param, False)]


@pytest.fixture(params=CONNECTORS)
def usvc_openai(request: pytest.FixtureRequest, services: dict) -> Microservice:
    return services[(request.param, True)]


def post(service: Microservice, body: Any, timeout: float = 120) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(
        f"{service.url}/v1/chat/completions", content=content, headers=JSON_HEADERS, timeout=timeout
    )


def stream_events(service: Microservice, body: Any, timeout: float = 120) -> list[str]:
    """The `data:` payloads of a streamed answer, read to the end."""
    content = body if isinstance(body, str) else json.dumps(body)
    url = f"{service.url}/v1/chat/completions"
    with httpx.stream("POST", url, content=content, headers=JSON_HEADERS, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def opea_text(events: list[str]) -> str:
    """What an OPEA client does: each line but the last is the repr of a text piece."""
    assert events and events[-1] == "[DONE]", events[-3:]
    return "".join(ast.literal_eval(e) for e in events[:-1])


# ------------------------------------------------------------------------ seed payloads


def test_seed_curl_non_streaming(usvc: Microservice, server: ServerProcess) -> None:
    generated = metric(server.url, "vllm:generation_tokens_total")
    response = post(usvc, SEED_NON_STREAMING)
    assert response.status_code == 200, response.text
    body = response.json()
    assert list(body) == ["id", "text", "prompt", "streaming", "output_guardrail_params", "data"]
    assert body["text"].strip() and body["prompt"] == "### Question: Who are you? \n\n"
    assert (body["streaming"], body["output_guardrail_params"], body["data"]) == (False, None, None)
    # max_new_tokens reached the model server as max_tokens.
    assert 0 < metric(server.url, "vllm:generation_tokens_total") - generated <= 17


def test_seed_curl_streaming(usvc: Microservice, server: ServerProcess) -> None:
    generated = metric(server.url, "vllm:generation_tokens_total")
    events = stream_events(usvc, SEED_STREAMING)
    assert all(e.startswith(("'", '"')) for e in events[:-1]), events[:5]
    assert opea_text(events).strip()
    assert 0 < len(events) - 1 <= 32  # pieces: at most one per token
    assert 0 < metric(server.url, "vllm:generation_tokens_total") - generated <= 32


# ----------------------------------------------------------------------- OpenAI shapes


def test_openai_list_messages(usvc: Microservice, model_name: str) -> None:
    body = {
        "model": model_name,
        "messages": [
            {"role": "system", "content": "Answer with one word."},
            {"role": "user", "content": QUESTION},
        ],
        "max_tokens": 8,
        "temperature": 0,
    }
    response = post(usvc, body)  # OpenAI's default: not streamed
    assert response.status_code == 200, response.text
    assert "Paris" in response.json()["text"]
    assert response.json()["prompt"] == QUESTION
    assert "Paris" in opea_text(stream_events(usvc, {**body, "stream": True}))


@pytest.fixture(scope="module")
def greedy_texts(services: dict) -> dict[str, str]:
    """Each connector's non-streamed answer to GREEDY (temperature 0)."""
    texts = {}
    for connector in CONNECTORS:
        response = post(services[(connector, False)], GREEDY)
        assert response.status_code == 200, response.text
        texts[connector] = response.json()["text"]
    return texts


def test_connectors_give_the_same_greedy_text(services: dict, greedy_texts: dict) -> None:
    texts = greedy_texts
    assert texts["generic"] == texts["langchain"] and texts["generic"].strip(), texts
    streamed = {c: opea_text(stream_events(services[(c, False)], {**GREEDY, "streaming": True}))
                for c in CONNECTORS}  # fmt: skip
    assert streamed == texts


def test_openai_chunk_streaming_with_the_openai_client(
    usvc_openai: Microservice, greedy_texts: dict, model_name: str
) -> None:
    client = openai.OpenAI(base_url=f"{usvc_openai.url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=model_name,
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=GREEDY["max_new_tokens"],
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    # The same greedy answer as OPEA's format gives (same messages, same limits).
    assert text == greedy_texts[usvc_openai.connector]


def test_parameters_reach_the_model_server(usvc: Microservice, server: ServerProcess) -> None:
    base = {
        "messages": [{"role": "user", "content": "Count from one to twenty in words."}],
        "temperature": 0,
        "ignore_eos": True,
    }
    generated = metric(server.url, "vllm:generation_tokens_total")
    full = post(usvc, {**base, "max_tokens": 10}).json()["text"]
    # ignore_eos and max_tokens both arrived: exactly 10 tokens were generated.
    assert metric(server.url, "vllm:generation_tokens_total") - generated == 10
    # The reference for the cut: the same request again, so that it reads the prompt from the
    # prefix cache like the requests below (in bf16, a full prefill and a cached one may round
    # differently, and the tuned matmuls differ by row count, so a near-tie can flip).
    full = post(usvc, {**base, "max_tokens": 10}).json()["text"]
    stop = full[len(full) // 2 :][:3]
    assert stop.strip(), full
    cut = post(usvc, {**base, "max_tokens": 10, "stop": [stop]}).json()["text"]
    assert cut == full[: full.index(stop)], (full, stop)
    short = post(usvc, {**base, "max_new_tokens": 3}).json()["text"]
    assert full.startswith(short) and len(short) < len(full)


# ------------------------------------------------------------------ health, disconnects


def test_health_check_ready(usvc: Microservice) -> None:
    response = httpx.get(f"{usvc.url}/v1/health_check", timeout=10)
    assert response.status_code == 200
    body = response.json()
    assert body["Service Title"] and body["Service Description"]
    assert body["model_server"]["status"] == "ready" and body["model_server"]["phase"] == "ready"


def wait_idle(server: ServerProcess, timeout: float = 10) -> float:
    """Seconds until the model server runs no request."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if metric(server.url, "vllm:num_requests_running") == 0:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError("the model server still runs the abandoned request")


def test_client_disconnect_aborts_the_model_server_request(
    usvc: Microservice, server: ServerProcess
) -> None:
    wait_idle(server)
    url = f"{usvc.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=LONG, timeout=60) as response:
        assert response.status_code == 200
        # Keep the iterator referenced: dropping it would close the connection early.
        lines = response.iter_lines()
        pieces: list[str] = []
        for line in lines:
            if line.startswith("data: "):
                pieces.append(line)
            if len(pieces) >= 3:
                break
        assert metric(server.url, "vllm:num_requests_running") == 1
    # 1500 tokens would take a minute: closing must abort it at once.
    assert wait_idle(server) < 5
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting
        httpx.post(url, json={**LONG, "streaming": False}, timeout=1.5)
    assert wait_idle(server) < 5


def test_metrics_are_exposed_and_pass_promtool(usvc: Microservice) -> None:
    post(usvc, {**GREEDY, "max_new_tokens": 1})
    response = httpx.get(f"{usvc.url}/metrics", timeout=10)
    assert response.status_code == 200
    text = response.text
    for name in (
        "llm_microservice_requests_total",
        "llm_microservice_request_latency_seconds_bucket",
        "llm_microservice_time_to_first_token_seconds_bucket",
        "llm_microservice_requests_in_flight",
        "llm_microservice_upstream_errors_total",
    ):
        assert name in text
    assert float(text.split('llm_microservice_requests_total{status="200"} ')[1].split()[0]) >= 1
    assert promtool_check_metrics(response.content) == []


# ----------------------------------------------------- the model server's whole life


# Long enough for a 2-token streamed answer on a busy CPU, far too short for LONG unstreamed.
READ_TIMEOUT_S = 5.0


def test_model_server_down_warming_ready_killed(tmp_path: Path) -> None:
    """Both connectors, pointed at a port where the model server is not (yet) running: quick
    503s; it starts: 503 until ready, then answers (recovery); a slow answer: 504 after the
    read timeout; it is killed mid-stream: the stream ends with an error event, then 503s."""
    port = free_port()
    env = {
        "LLM_HEALTH_CHECK_CACHE_SECONDS": "0.5",
        "LLM_MODEL_SERVER_READ_TIMEOUT": str(READ_TIMEOUT_S),
    }
    endpoint = f"http://127.0.0.1:{port}"
    usvcs = [start_microservice(tmp_path, endpoint, c, **env) for c in CONNECTORS]
    model_server = None
    try:
        for usvc in usvcs:
            usvc.wait_up()  # it starts although the model server is down
            assert_down(usvc)
        model_server = launch(tmp_path, port=port)
        model_server.wait_ready()
        for usvc in usvcs:
            wait_health(usvc, 200)
            events = stream_events(usvc, {**GREEDY, "max_new_tokens": 2, "streaming": True})
            assert opea_text(events)  # recovered, no restart needed

        with ThreadPoolExecutor(len(usvcs)) as pool:  # both at once: one wait, not two
            answers = list(pool.map(timed_long_request, usvcs))
        for response, elapsed in answers:
            assert response.status_code == 504, response.text
            assert "did not answer in time" in response.json()["error"]["message"]
            assert READ_TIMEOUT_S - 0.5 < elapsed < READ_TIMEOUT_S + 10
        wait_idle(model_server)  # the timed-out requests were closed upstream too

        streams = [open_stream(usvc) for usvc in usvcs]
        model_server.proc.send_signal(signal.SIGKILL)
        model_server.proc.wait(10)
        for response, lines in streams:
            rest = list(lines)  # must end: a hang here fails on the client's read timeout
            response.close()
            assert rest[-1] == "data: [DONE]", rest[-3:]
            error = json.loads(rest[-2].removeprefix("data: "))["error"]
            assert "model server" in error["message"], error
        for usvc in usvcs:
            wait_health(usvc, 503)
            assert_down(usvc)
    finally:
        if model_server is not None:
            model_server.stop()
        stop_all(usvcs)


def timed_long_request(usvc: Microservice) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = post(usvc, {**LONG, "streaming": False}, timeout=60)
    return response, time.monotonic() - started


def assert_down(usvc: Microservice) -> None:
    """health_check and chat requests (both modes) each answer 503 within 2 s."""
    started = time.monotonic()
    health = httpx.get(f"{usvc.url}/v1/health_check", timeout=10)
    assert time.monotonic() - started < 2
    assert health.status_code == 503
    assert health.json()["model_server"]["status"] == "unreachable"
    for streaming in (False, True):
        started = time.monotonic()
        response = post(usvc, {**GREEDY, "streaming": streaming}, timeout=10)
        assert time.monotonic() - started < 2
        assert response.status_code == 503, response.text
        assert "unreachable" in response.json()["error"]["message"]


def wait_health(usvc: Microservice, status: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while (code := httpx.get(f"{usvc.url}/v1/health_check", timeout=5).status_code) != status:
        assert time.monotonic() < deadline, f"health_check still {code}, expected {status}"
        time.sleep(0.1)


def open_stream(usvc: Microservice) -> tuple[httpx.Response, Iterator[str]]:
    """A long stream, opened and read up to its third piece."""
    client = httpx.Client(timeout=15)
    request = client.build_request(
        "POST", f"{usvc.url}/v1/chat/completions", json=LONG, headers=JSON_HEADERS
    )
    response = client.send(request, stream=True)
    assert response.status_code == 200
    lines = (line for line in response.iter_lines() if line.startswith("data: "))
    for _ in range(3):
        assert next(lines).startswith(("data: '", 'data: "'))
    return response, lines


# ---------------------------------------------- GenAIComps' real megaservice, real model

RAG_QUESTION = "What is the name of Wick's mascot?"
RAG_DOC = "Wick's mascot is a purple otter named Bramble, who lives by the river."


@pytest.fixture(scope="module")
def megaservice(services: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """GenAIComps' orchestrator and a ChatQnA-style gateway (opea-comps, its own venv) with
    the generic-connector microservice as the LLM node: tests/microservice/opea/."""
    from tests.microservice.opea.env import start_megaservice

    llm = services[("generic", False)].url
    graphs = {
        "chat": {"llm": llm, "adapters": True},
        "rag": {"llm": llm, "adapters": True, "reranker": True},
    }
    mega = start_megaservice(tmp_path_factory.mktemp("opea"), graphs)
    try:
        yield mega
    finally:
        mega.stop()


def test_opea_gateway_with_the_real_model(megaservice: Any, server: ServerProcess) -> None:
    generated = metric(server.url, "vllm:generation_tokens_total")
    body = {
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": False,
    }
    response = megaservice.chatqna(body)
    assert response.status_code == 200, response.text
    assert "Paris" in response.json()["choices"][0]["message"]["content"]
    # max_tokens 8 won over LLMParams' max_new_tokens 1024 (was a 422).
    assert 0 < metric(server.url, "vllm:generation_tokens_total") - generated <= 8
    streamed = megaservice.chatqna({**body, "stream": True})
    lines = [line for line in streamed.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    text = b"".join(ast.literal_eval(line[6:]) for line in lines[:-1]).decode()
    assert "Paris" in text


def test_opea_rag_documents_reach_the_real_model(megaservice: Any, server: ServerProcess) -> None:
    params = {"max_tokens": 16, "temperature": 0.0, "stream": False}

    def prompt_tokens(inputs: dict[str, Any]) -> tuple[float, Any]:
        before = metric(server.url, "vllm:prompt_tokens_total")
        response = megaservice.schedule("rag", inputs, params)
        assert response.status_code == 200, response.text
        return metric(server.url, "vllm:prompt_tokens_total") - before, response.json()

    without, _ = prompt_tokens({"initial_query": RAG_QUESTION, "retrieved_docs": []})
    docs = [{"text": RAG_DOC}]
    with_doc, result = prompt_tokens({"initial_query": RAG_QUESTION, "retrieved_docs": docs})
    # The document and GenAIComps' RAG prompt around it reached the model (a 135M model's
    # answer cannot be relied on to quote it; the fake-upstream tests check the prompt itself).
    assert with_doc > without + 40, (with_doc, without)
    assert result["result"]["text"].strip()


def test_opea_unknown_model_name_is_served_by_the_real_model(
    megaservice: Any, model_name: str
) -> None:
    params = {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "max_tokens": 8, "stream": False}
    inputs = {"messages": [{"role": "user", "content": QUESTION}]}
    response = megaservice.schedule("chat", inputs, {**params, "temperature": 0.0})
    assert response.status_code == 200, response.text
    assert "Paris" in response.json()["result"]["text"]
    assert model_name != params["model"]  # the model server itself would answer 404
