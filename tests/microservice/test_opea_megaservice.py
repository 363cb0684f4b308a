"""Wick's microservice as the LLM node of GenAIComps' real megaservice (opea-comps, in a venv of
its own: see opea/env.py): `ServiceOrchestrator.schedule(...)` and a ChatQnA-style gateway built
from comps' classes, streaming and not, in front of a fake OpenAI upstream that records what
reaches the model server. The real-model cases are in tests/e2e/test_microservice.py."""

from __future__ import annotations

import ast
import json
import logging
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.responses import JSONResponse
from starlette.types import Message, Receive, Scope, Send

from microservice.app import build_app
from microservice.connectors import make_connector
from microservice.rag import default_prompt
from microservice.settings import MicroserviceSettings
from tests.fake_openai_server import FakeOpenAI, serve
from tests.loopback import serve_asgi
from tests.microservice.opea.env import Megaservice, start_megaservice

SERVED = "served-model"
QUESTION = "What is the code word?"
DOCS = ["Doc A: the code word is marmalade.", "Doc B: cats sleep a lot."]
GATEWAY_MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
# Every sampling field LLMParams has, none at its default.
SAMPLING = {
    "top_k": 5,
    "top_p": 0.9,
    "typical_p": 0.5,
    "temperature": 0.3,
    "frequency_penalty": 0.1,
    "presence_penalty": 0.2,
    "repetition_penalty": 1.1,
    "language": "en",
}
CONNECTORS = ("generic", "langchain")


@dataclass
class ModelServerFake(FakeOpenAI):
    """FakeOpenAI that, like Wick's model server, answers 404 model_not_found to a chat naming
    a model other than its own; `rejected` lists those names."""

    rejected: list[str] = field(default_factory=list)

    def app(self) -> Any:
        inner = super().app()

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
                await inner(scope, receive, send)
                return
            body, more = b"", True
            while more:
                message = await receive()
                body += message.get("body", b"")
                more = message.get("more_body", False)
            model = json.loads(body).get("model")
            if model not in (None, self.model):
                self.rejected.append(model)
                error = {
                    "message": f"The model `{model}` does not exist.",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": "model_not_found",
                }
                await JSONResponse({"error": error}, 404)(scope, receive, send)
                return

            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if replayed:  # later calls wait for the disconnect, as Starlette expects
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            await inner(scope, replay, send)

        return app


@dataclass
class Stack:
    fake: ModelServerFake
    mega: Megaservice

    def sent(self) -> list[dict[str, Any]]:
        """The chat requests the model server answered (not the rejected ones)."""
        bodies = [b for b in self.fake.requests if "messages" in b]
        return [b for b in bodies if b.get("model") in (None, SERVED)]


def wick_app(upstream: str, **settings: Any) -> Any:
    s = MicroserviceSettings(model_server_endpoint=upstream, **settings)
    return build_app(s, make_connector(s))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """fake model server <- Wick's microservice (one app per setting) <- the megaservice."""
    fake = ModelServerFake(model=SERVED)
    variants: dict[str, dict[str, Any]] = {
        "generic": {"connector": "generic"},
        "langchain": {"connector": "langchain"},
        "downstream": {"response_format": "downstream"},
        "strict": {"strict_model_name": True},
    }
    with serve(fake) as upstream, ExitStack() as servers:
        urls = {
            name: servers.enter_context(serve_asgi(wick_app(upstream, **settings)))
            for name, settings in variants.items()
        }
        graphs = {
            "chat": {"llm": urls["generic"], "adapters": True},
            "chat_langchain": {"llm": urls["langchain"], "adapters": True},
            "rag": {"llm": urls["generic"], "adapters": True, "reranker": True},
            "rag_langchain": {"llm": urls["langchain"], "adapters": True, "reranker": True},
            "downstream": {"llm": urls["downstream"], "downstream": True},
            "plain": {"llm": urls["generic"]},
            "strict": {"llm": urls["strict"]},
        }
        mega = start_megaservice(tmp_path_factory.mktemp("opea"), graphs)
        try:
            yield Stack(fake, mega)
        finally:
            mega.stop()


@pytest.fixture
def fresh(stack: Stack) -> Stack:
    stack.fake.requests.clear()
    stack.fake.rejected.clear()
    stack.mega.received()
    return stack


def fake_answer(user: str) -> str:
    """What the fake model server answers (tests/fake_openai_server.py): word by word."""
    return " ".join(f"you said: {user}".split())


def streamed_text(response: httpx.Response) -> str:
    """The text of the `data: b'...'` stream the megaservice answers (ChatQnA's UI format)."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    pieces = [ast.literal_eval(line.removeprefix("data: ")) for line in lines[:-1]]
    return b"".join(pieces).decode("utf-8")


# ------------------------------------------------------------------- the ChatQnA gateway


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [32, 1024])
def test_gateway_answers_with_the_users_token_limit(
    fresh: Stack, stream: bool, max_tokens: int
) -> None:
    # The gateway sets LLMParams.max_tokens; max_new_tokens stays at 1024: was a 422 (an
    # empty 200 stream, or the gateway's 500) whenever max_tokens was not 1024.
    body = {
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    response = fresh.mega.chatqna(body)
    if stream:
        text = streamed_text(response)
    else:
        assert response.status_code == 200, response.text
        text = response.json()["choices"][0]["message"]["content"]
    assert text == fake_answer("Hello there")
    (sent,) = fresh.sent()
    assert sent["max_tokens"] == max_tokens and sent["stream"] is stream
    assert "max_new_tokens" not in sent


def test_gateway_rag_answer_uses_the_documents(fresh: Stack) -> None:
    body = {
        "messages": [{"role": "user", "content": QUESTION}],
        "documents": DOCS,
        "max_tokens": 64,
        "stream": False,
    }
    response = fresh.mega.chatqna(body)
    assert response.status_code == 200, response.text
    answer = response.json()["choices"][0]["message"]["content"]
    assert "marmalade" in answer  # the fake echoes the prompt: the document reached it
    (sent,) = fresh.sent()
    prompt = default_prompt(QUESTION, "\n".join(DOCS[::-1]))  # the reranker's order
    assert sent["messages"] == [{"role": "user", "content": prompt}]


# --------------------------------------------------------------------- schedule(...)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("connector", CONNECTORS)
def test_message_list_with_every_sampling_parameter(
    fresh: Stack, connector: str, stream: bool
) -> None:
    graph = "chat" if connector == "generic" else "chat_langchain"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    params = {**SAMPLING, "max_tokens": 32, "stream": stream}
    response = fresh.mega.schedule(graph, {"messages": messages}, params)
    if stream:
        text = streamed_text(response)
    else:
        assert response.status_code == 200, response.text
        text = response.json()["result"]["text"]  # ChatQnA's adapter read `choices`
    assert text == fake_answer("Bye")
    (sent,) = fresh.sent()
    assert sent["messages"] == messages and sent["max_tokens"] == 32
    for name in ("top_k", "top_p", "temperature", "frequency_penalty", "presence_penalty"):
        assert sent[name] == SAMPLING[name], name
    assert sent["repetition_penalty"] == SAMPLING["repetition_penalty"]
    assert not {"typical_p", "language", "id", "max_new_tokens", "index_name"} & set(sent)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("connector", CONNECTORS)
def test_reranked_documents_reach_the_prompt_in_order(
    fresh: Stack, connector: str, stream: bool
) -> None:
    graph = "rag" if connector == "generic" else "rag_langchain"
    inputs = {"initial_query": QUESTION, "retrieved_docs": [{"text": d} for d in DOCS]}
    response = fresh.mega.schedule(graph, inputs, {"max_tokens": 64, "stream": stream})
    prompt = default_prompt(QUESTION, "\n".join(DOCS[::-1]))
    text = streamed_text(response) if stream else response.json()["result"]["text"]
    assert text == fake_answer(prompt)  # the answer is made from the prompt with the document
    (sent,) = fresh.sent()
    assert sent["messages"] == [{"role": "user", "content": prompt}]
    assert prompt.index("Doc B") < prompt.index("Doc A") < prompt.index(QUESTION)


def test_chat_template_with_context_and_question(fresh: Stack) -> None:
    inputs = {"initial_query": QUESTION, "retrieved_docs": [{"text": d} for d in DOCS]}
    template = "Answer from these notes only.\nNotes:\n{context}\nQuestion: {question}"
    params = {"max_tokens": 64, "stream": False, "chat_template": template}
    response = fresh.mega.schedule("rag", inputs, params)
    assert response.status_code == 200, response.text
    (sent,) = fresh.sent()
    expected = template.format(context="\n".join(DOCS[::-1]), question=QUESTION)
    assert sent["messages"] == [{"role": "user", "content": expected}]


def test_bad_chat_template_is_a_clear_422(fresh: Stack) -> None:
    inputs = {"query": QUESTION, "documents": DOCS}
    params = {"stream": False, "chat_template": "{context} {history}"}
    response = fresh.mega.schedule("plain", inputs, params)
    error = response.json()["result"]["error"]  # the plain orchestrator passes the body on
    assert "chat_template" in error["message"] and "{history}" in error["message"]
    assert fresh.sent() == []


def test_plain_orchestrator_gets_openai_json(fresh: Stack) -> None:
    response = fresh.mega.schedule("plain", {"query": "Hi"}, {"stream": False, "max_tokens": 8})
    result = response.json()["result"]
    assert result["object"] == "chat.completion"
    assert result["choices"][0]["message"] == {"role": "assistant", "content": fake_answer("Hi")}
    assert result["model"] == SERVED and result["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("stream", [False, True])
def test_downstream_node_receives_the_clean_text(fresh: Stack, stream: bool) -> None:
    user = 'It\'s "quoted" — café? Yes. Done'
    response = fresh.mega.schedule(
        "downstream", {"messages": [{"role": "user", "content": user}]}, {"stream": stream}
    )
    received = fresh.mega.received()
    assert "".join(received) == fake_answer(user), received
    if stream:
        # Cut at sentence ends by the orchestrator, then re-streamed from the node's answers.
        assert len([r for r in received if r]) > 1
        assert streamed_text(response) == fake_answer(user)
    else:
        assert response.json()["result"]["text"] == fake_answer(user)


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_name_is_served_by_the_one_model(
    fresh: Stack, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    params = {"model": GATEWAY_MODEL, "stream": stream, "max_tokens": 16}
    inputs = {"messages": [{"role": "user", "content": "Hi"}]}
    with caplog.at_level(logging.WARNING, logger="microservice"):
        first = fresh.mega.schedule("chat", inputs, params)
        second = fresh.mega.schedule("chat", inputs, params)
    for response in (first, second):
        text = streamed_text(response) if stream else response.json()["result"]["text"]
        assert text == fake_answer("Hi")
    assert [b["model"] for b in fresh.sent()] == [SERVED, SERVED]
    # Asked once (remembered after the first 404), warned at most once: the parametrized twin
    # of this test may have been first.
    assert fresh.fake.rejected in ([GATEWAY_MODEL], [])
    warnings = [r.getMessage() for r in caplog.records if GATEWAY_MODEL in r.getMessage()]
    assert len(warnings) == len(fresh.fake.rejected)


def test_strict_model_name_keeps_vllms_404(fresh: Stack) -> None:
    params = {"model": GATEWAY_MODEL, "stream": False}
    response = fresh.mega.schedule("strict", {"query": "Hi"}, params)
    error = response.json()["result"]["error"]
    assert error["code"] == "model_not_found" and GATEWAY_MODEL in error["message"]
    assert fresh.fake.rejected == [GATEWAY_MODEL] and fresh.sent() == []


def test_conflicting_token_limits_are_a_clear_422(fresh: Stack) -> None:
    params = {"stream": False, "max_tokens": 32, "max_new_tokens": 64}
    response = fresh.mega.schedule("plain", {"query": "Hi"}, params)
    error = response.json()["result"]["error"]
    assert "token limits disagree" in error["message"] and fresh.sent() == []
