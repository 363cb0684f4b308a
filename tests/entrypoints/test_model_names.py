"""Model names and candle-vllm's `stop` objects, in-process over the tiny model.

`--served-model-name` aliases (the first reported, all accepted, each listed in /v1/models),
`--accept-any-model-name` (any name answered; off: vLLM's 404) and `stop` as candle-vllm's
`{"Single": s}` / `{"Multiple": [...]}` (any other object: 400 naming the accepted shapes).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.entrypoints.conftest import AppClient, start_app, tiny_settings
from tests.entrypoints.test_openai_api import CHAT, COMPLETIONS, MESSAGES, assert_error

PRIMARY, ALIAS = "tiny-primary", "llama7b-alias"
# No ignore_eos: a stop string must end the text where it first appears.
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def aliased(tiny_config: Path) -> Iterator[AppClient]:
    # The flag's list, as argparse hands `--served-model-name tiny-primary llama7b-alias` over.
    client = start_app(tiny_settings(tiny_config, served_model_name=[PRIMARY, ALIAS]))
    yield client
    client.close()


@pytest.fixture(scope="module")
def any_name(tiny_config: Path) -> Iterator[AppClient]:
    client = start_app(tiny_settings(tiny_config, accept_any_model_name=True))
    yield client
    client.close()


def test_models_lists_every_alias_the_reported_one_first(aliased: AppClient) -> None:
    cards = aliased.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [PRIMARY, ALIAS]
    assert len({c["root"] for c in cards}) == 1  # one model under two names


@pytest.mark.parametrize("name", [PRIMARY, ALIAS, None, ""])
def test_any_alias_is_served_and_responses_report_the_first(
    aliased: AppClient, name: str | None
) -> None:
    body = {"messages": MESSAGES, **GREEDY, **({} if name is None else {"model": name})}
    resp = aliased.post(CHAT, json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == PRIMARY
    chunks = aliased.sse(COMPLETIONS, {"prompt": "x", "model": ALIAS, **GREEDY})
    assert {c["model"] for c in chunks if isinstance(c, dict)} == {PRIMARY}


def test_unknown_name_is_a_404_naming_the_served_names(aliased: AppClient) -> None:
    error = assert_error(
        aliased.post(CHAT, json={"messages": MESSAGES, "model": "llama7b"}), 404, "`llama7b`"
    )
    assert error["code"] == "model_not_found"
    assert PRIMARY in error["message"] and ALIAS in error["message"]
    assert "--accept-any-model-name" in error["message"]


@pytest.mark.parametrize("name", ["llama7b", "llama", "mistral7b", "gpt-4o"])
def test_accept_any_model_name_answers_any_name(any_name: AppClient, name: str) -> None:
    resp = any_name.post(CHAT, json={"messages": MESSAGES, "model": name, **GREEDY})
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "tiny-test"  # the served name, not the one asked for
    resp = any_name.post("/tokenize", json={"prompt": "x", "model": name})
    assert resp.status_code == 200, resp.text


# ----------------------------------------------------------------------------- stop


def _stop_word(api: AppClient) -> tuple[str, str]:
    """The greedy text without a stop, and a word from its middle to stop at."""
    text = api.post(COMPLETIONS, json={"prompt": "Once upon a time", **GREEDY}).json()
    text = text["choices"][0]["text"]
    middle = text[len(text) // 3 : len(text) // 3 + 3]
    assert middle.strip(), text  # random weights, but a deterministic text to cut
    return text, middle


@pytest.mark.parametrize(
    "shape",
    [
        lambda s: s,
        lambda s: [s],
        lambda s: {"Single": s},
        lambda s: {"Multiple": [s, "never-in-the-text"]},
    ],
    ids=["openai-string", "openai-list", "candle-single", "candle-multiple"],
)
def test_candle_stop_objects_stop_like_openai_stop(api: AppClient, shape) -> None:
    text, word = _stop_word(api)
    body = {"prompt": "Once upon a time", "stop": shape(word), **GREEDY}
    choice = api.post(COMPLETIONS, json=body).json()["choices"][0]
    assert choice["text"] == text[: text.index(word)]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", word)
    chat = api.post(CHAT, json={"messages": MESSAGES, "stop": shape(word), **GREEDY})
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize(
    "stop",
    [
        {"single": "</s>"},  # serde's variant names are case-sensitive
        {"Single": ["</s>"]},
        {"Multiple": "</s>"},
        {"Multiple": ["</s>", 3]},
        {"Single": "a", "Multiple": ["b"]},
        {},
    ],
)
def test_unknown_stop_object_is_a_400_naming_the_shapes(api: AppClient, stop: dict) -> None:
    for url, body in ((CHAT, {"messages": MESSAGES}), (COMPLETIONS, {"prompt": "x"})):
        error = assert_error(api.post(url, json={**body, "stop": stop}), 400, "stop: must be")
        assert error["param"] == "stop"
        assert '{"Single": "<string>"}' in error["message"], error["message"]
        assert '{"Multiple": ["<string>", ...]}' in error["message"], error["message"]


def test_stop_of_a_wrong_type_names_every_shape(api: AppClient) -> None:
    error = assert_error(api.post(COMPLETIONS, json={"prompt": "x", "stop": 3}), 400, "stop")
    assert '{"Single"' in error["message"], error["message"]
