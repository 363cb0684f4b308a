"""vLLM's request fields from issue 32 through the real HTTP stack and engine (the tiny model):
logit_bias, the beam search and best_of refusals, return_tokens_as_token_ids and
stream_options.continuous_usage_stats; each bad value a 400 naming its field."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.entrypoints.conftest import MODEL_NAME, AppClient

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = [17, 42, 314, 1000, 7]  # token ids: no tokenizer quirks in the way
MESSAGES = [{"role": "user", "content": "Hello there"}]
TOKEN_ID = re.compile(r"^token_id:(\d+)$")


def completion(api: AppClient, **body: Any) -> dict[str, Any]:
    payload = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **body}
    resp = api.post(COMPLETIONS, json=payload)
    assert resp.status_code == 200, resp.text
    return resp.json()


def chat(api: AppClient, **body: Any) -> dict[str, Any]:
    payload = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    resp = api.post(CHAT, json={**payload, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def token_ids(labels: list[str]) -> list[int]:
    ids = []
    for label in labels:
        match = TOKEN_ID.match(label)
        assert match, label
        ids.append(int(match.group(1)))
    return ids


def completion_ids(api: AppClient, **body: Any) -> list[int]:
    out = completion(api, logprobs=0, return_tokens_as_token_ids=True, ignore_eos=True, **body)
    return token_ids(out["choices"][0]["logprobs"]["tokens"])


def chat_ids(api: AppClient, **body: Any) -> list[int]:
    out = chat(api, logprobs=True, return_tokens_as_token_ids=True, ignore_eos=True, **body)
    return token_ids([t["token"] for t in out["choices"][0]["logprobs"]["content"]])


def bad_request(api: AppClient, url: str, **body: Any) -> dict[str, Any]:
    base = {"model": MODEL_NAME, "max_tokens": 2}
    base |= {"prompt": PROMPT} if url == COMPLETIONS else {"messages": MESSAGES}
    resp = api.post(url, json={**base, **body})
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


# ---------------------------------------------------------------------------- logit_bias


@pytest.mark.parametrize("ids_of", [completion_ids, chat_ids])
def test_plus_100_forces_the_token_minus_100_bans_the_greedy_one(api: AppClient, ids_of) -> None:
    greedy = ids_of(api)
    chosen = 4242 if greedy[0] != 4242 else 4243
    assert ids_of(api, logit_bias={str(chosen): 100}) == [chosen] * 4
    banned = ids_of(api, logit_bias={str(greedy[0]): -100})
    assert banned[0] != greedy[0] and greedy[0] not in banned
    assert ids_of(api, logit_bias={str(chosen): 0.0}) == greedy  # a zero bias changes nothing


def test_streamed_completion_with_a_bias(api: AppClient) -> None:
    events = api.sse(
        COMPLETIONS,
        {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3, "temperature": 0.8,
         "seed": 1, "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True,
         "logit_bias": {"99": 100}},
    )  # fmt: skip
    labels = [t for e in events[:-1] for c in e["choices"] if c["logprobs"]
              for t in c["logprobs"]["tokens"]]  # fmt: skip
    assert labels == ["token_id:99"] * 3


@pytest.mark.parametrize("url", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(
    ("bias", "says"),
    [
        ({"5": 100.5}, "logit_bias values must be in [-100, 100], got 100.5 for token 5"),
        ({"5": -101}, "got -101.0 for token 5"),
        ({"five": 1}, "keys must be token ids"),
        ({"-3": 1}, "keys must be token ids"),
        ({"49152": 1}, "logit_bias: token id 49152 is out of range for the vocabulary (0-49151)"),
        ({"5": "much"}, "logit_bias"),
    ],
)
def test_bad_logit_bias_is_400_naming_it(api: AppClient, url: str, bias: dict, says: str) -> None:
    error = bad_request(api, url, logit_bias=bias)
    assert error["param"] == "logit_bias"
    assert says in error["message"]


# ------------------------------------------------------------ beam search and best_of


@pytest.mark.parametrize(
    ("field", "value"),
    [("use_beam_search", True), ("length_penalty", 0.6), ("early_stopping", True),
     ("early_stopping", "never")],
)  # fmt: skip
def test_beam_search_fields_are_400_not_ignored(api: AppClient, field: str, value: Any) -> None:
    error = bad_request(api, COMPLETIONS, **{field: value})
    assert error["param"] == field
    assert f"beam search is not supported: {field} must be unset" in error["message"]


def test_beam_search_defaults_and_best_of_equal_to_n_are_accepted(api: AppClient) -> None:
    out = completion(
        api, use_beam_search=False, length_penalty=1.0, early_stopping=False, best_of=2, n=2
    )
    assert len(out["choices"]) == 2


def test_best_of_above_n_is_400_naming_it(api: AppClient) -> None:
    error = bad_request(api, COMPLETIONS, best_of=3, n=1)
    assert error["param"] == "best_of"
    assert "best_of is not supported" in error["message"]


# ----------------------------------------------------------- return_tokens_as_token_ids


def test_token_ids_name_every_token_and_alternative(api: AppClient) -> None:
    plain = chat(api, logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]["content"]
    as_ids = chat(api, logprobs=True, top_logprobs=3, return_tokens_as_token_ids=True)
    content = as_ids["choices"][0]["logprobs"]["content"]
    assert len(content) == len(plain)
    for entry, text in zip(content, plain, strict=True):
        assert TOKEN_ID.match(entry["token"])
        assert entry["bytes"] == list(entry["token"].encode())
        assert entry["logprob"] == text["logprob"]  # the same tokens, named differently
        assert [TOKEN_ID.match(alt["token"]) is not None for alt in entry["top_logprobs"]] == [
            True
        ] * 3
    out = completion(api, logprobs=2, return_tokens_as_token_ids=True)
    lp = out["choices"][0]["logprobs"]
    assert all(TOKEN_ID.match(t) for top in lp["top_logprobs"] for t in top)
    # Offsets still count characters of the tokens' text, not of their `token_id:` names.
    plain_lp = completion(api, logprobs=2)["choices"][0]["logprobs"]
    assert lp["text_offset"] == plain_lp["text_offset"]
    assert lp["token_logprobs"] == plain_lp["token_logprobs"]


@pytest.mark.parametrize("url", [CHAT, COMPLETIONS])
def test_bad_return_tokens_as_token_ids_is_400_naming_it(api: AppClient, url: str) -> None:
    error = bad_request(api, url, return_tokens_as_token_ids="sometimes")
    assert error["param"] == "return_tokens_as_token_ids"


# ------------------------------------------------------------------ continuous usage


@pytest.mark.parametrize("url", [CHAT, COMPLETIONS])
def test_continuous_usage_stats_put_usage_in_every_chunk(api: AppClient, url: str) -> None:
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 5, "temperature": 0,
                            "ignore_eos": True,
                            "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}  # fmt: skip
    body |= {"prompt": PROMPT} if url == COMPLETIONS else {"messages": MESSAGES}
    events = api.sse(url, body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    with_choices = [e for e in chunks if e["choices"]]
    assert with_choices and all(e["usage"] is not None for e in with_choices)
    counts = [e["usage"]["completion_tokens"] for e in with_choices]
    assert counts == sorted(counts) and counts[-1] == 5
    prompt = {e["usage"]["prompt_tokens"] for e in chunks}
    assert len(prompt) == 1 and prompt != {0}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    # Without it, only the final chunk has usage; without include_usage, none has (vLLM).
    body["stream_options"] = {"include_usage": True}
    plain = api.sse(url, body)[:-1]
    assert [e.get("usage") is not None for e in plain] == [False] * (len(plain) - 1) + [True]
    body["stream_options"] = {"continuous_usage_stats": True}
    assert all(e.get("usage") is None for e in api.sse(url, body)[:-1])


def test_bad_continuous_usage_stats_is_400_naming_it(api: AppClient) -> None:
    error = bad_request(api, CHAT, stream=True, stream_options={"continuous_usage_stats": "always"})
    assert error["param"] == "stream_options"
    assert "stream_options.continuous_usage_stats" in error["message"]
