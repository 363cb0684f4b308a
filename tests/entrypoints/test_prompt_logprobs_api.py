"""Prompt logprobs over HTTP: `/v1/completions` with `echo` + `logprobs` (what lm-evaluation-
harness's `local-completions` sends for every loglikelihood task) and vLLM's `prompt_logprobs`,
through a real loopback server and the real `openai` client, against transformers.

The model is a tiny random Llama written by transformers (float32) with the embedded SmolLM2
tokenizer saved beside it; the server prefills in 16-token chunks with prefix caching on, so the
prompts' logprobs come from several chunks and after a cached prefix was seen.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import transformers

from model_server.engine.async_engine import AsyncLLM
from model_server.entrypoints.openai.api_server import build_app
from model_server.loader.embedded import embedded_model_available, embedded_model_path
from tests.entrypoints.conftest import MODEL_NAME, TINY_CONFIG, tiny_settings
from tests.loopback import serve_asgi

TOL = 1e-3
PROMPT = "The quick brown fox jumps over the lazy dog because it wants to see what lies beyond."


@dataclass
class Served:
    url: str
    folder: Path
    client: openai.OpenAI
    http: httpx.Client
    hf: Any
    tokenizer: Any

    def hf_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """transformers' float32 log_softmax [P, V] of a prompt."""
        with torch.no_grad():
            return self.hf(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    if not embedded_model_available():
        pytest.skip("the embedded SmolLM2 (its tokenizer) is not installed")
    from model_server.loader.gguf_file import read_gguf
    from model_server.loader.gguf_tokenizer import gguf_tokenizer

    folder = tmp_path_factory.mktemp("prompt-logprobs") / "tiny-llama"
    torch.manual_seed(0)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    config = transformers.LlamaConfig(
        **{k: TINY_CONFIG[k] for k in keys},
        num_key_value_heads=2,
        vocab_size=TINY_CONFIG["vocab_size"],
        max_position_embeddings=512,
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(folder, safe_serialization=True)
    tokenizer = gguf_tokenizer(read_gguf(embedded_model_path()))
    tokenizer.save_pretrained(folder)
    settings = tiny_settings(folder, load_format="auto", dtype="float32", max_num_batched_tokens=16)
    llm = AsyncLLM(settings.engine_config(), skip_warmup=True)
    with serve_asgi(build_app(llm, settings)) as url, httpx.Client(base_url=url, timeout=60) as h:
        deadline = time.monotonic() + 120
        while h.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the server did not get ready"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        yield Served(url, folder, client, h, hf, tokenizer)


def _prompt_ids(served: Served, text: str) -> list[int]:
    return list(served.tokenizer(text).input_ids)


def test_echo_logprobs_with_max_tokens_zero_match_transformers(served: Served) -> None:
    """What lm-evaluation-harness asks: the prompt's own logprobs, first one null."""
    ids = _prompt_ids(served, PROMPT)
    expected = served.hf_logprobs(ids)
    # Warm the prefix cache with the same prompt: the echo request must not take the hit.
    served.client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1)
    resp = served.client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0, temperature=0
    )
    (choice,) = resp.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [served.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, len(ids)):
        row = expected[pos - 1]
        assert lp.token_logprobs[pos] == pytest.approx(row[ids[pos]].item(), abs=TOL)
        top = lp.top_logprobs[pos]
        assert lp.tokens[pos] in top and len(top) <= 3
        best = row.topk(2)
        assert max(top.values()) == pytest.approx(best.values[0].item(), abs=TOL)
    offsets = lp.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[-1] + len(lp.tokens[-1]) == len("".join(lp.tokens))
    # Streamed: one chunk with all of it.
    stream = served.client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0, stream=True
    )
    chunks = [c for chunk in stream for c in chunk.choices]
    assert "".join(c.text for c in chunks) == PROMPT
    (with_logprobs,) = [c for c in chunks if c.logprobs is not None]
    assert with_logprobs.logprobs.token_logprobs == lp.token_logprobs
    assert with_logprobs.logprobs.top_logprobs == lp.top_logprobs
    assert chunks[-1].finish_reason == "length"


def test_echo_logprobs_then_generated_ones(served: Served) -> None:
    """echo with max_tokens > 0: the prompt's entries, then the generated ones, exactly as a
    request without echo gives them; streamed, the same objects."""
    ids = _prompt_ids(served, PROMPT)
    common = dict(model=MODEL_NAME, prompt=PROMPT, logprobs=1, max_tokens=4, temperature=0)
    plain = served.client.completions.create(**common, extra_body={"ignore_eos": True})
    echoed = served.client.completions.create(**common, echo=True, extra_body={"ignore_eos": True})
    p, e = plain.choices[0], echoed.choices[0]
    assert e.text == PROMPT + p.text
    assert e.logprobs.tokens == [served.tokenizer.decode([t]) for t in ids] + p.logprobs.tokens
    assert e.logprobs.token_logprobs[len(ids) :] == p.logprobs.token_logprobs
    prompt_end = e.logprobs.text_offset[len(ids) - 1] + len(e.logprobs.tokens[len(ids) - 1])
    assert e.logprobs.text_offset[len(ids)] == prompt_end
    stream = served.client.completions.create(
        **common, echo=True, stream=True, extra_body={"ignore_eos": True}
    )
    joined: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    text = ""
    for chunk in stream:
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                for key, values in joined.items():
                    values.extend(getattr(c.logprobs, key))
    assert text == e.text
    assert joined["tokens"] == e.logprobs.tokens
    assert joined["token_logprobs"] == e.logprobs.token_logprobs
    assert joined["text_offset"] == e.logprobs.text_offset


def test_vllm_prompt_logprobs_field(served: Served) -> None:
    ids = _prompt_ids(served, PROMPT)
    expected = served.hf_logprobs(ids)
    resp = served.http.post(
        "/v1/completions",
        json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 3},
    ).json()
    (choice,) = resp["choices"]
    assert choice["logprobs"] is None  # not asked
    plps = choice["prompt_logprobs"]
    assert len(plps) == len(ids) and plps[0] is None
    for pos in range(1, len(ids)):
        row = expected[pos - 1]
        position = plps[pos]
        own = position[str(ids[pos])]
        assert own["logprob"] == pytest.approx(row[ids[pos]].item(), abs=TOL)
        assert own["rank"] == 1 + int((row > row[ids[pos]]).sum())
        assert own["decoded_token"] == served.tokenizer.decode([ids[pos]])
        assert 3 <= len(position) <= 4
        ranks = sorted(v["rank"] for k, v in position.items() if k != str(ids[pos]))
        assert ranks == [r for r in (1, 2, 3) if r != own["rank"]]
    # Streamed: the first chunk carries it.
    events = []
    with served.http.stream(
        "POST",
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 3, "stream": True},
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    first = events[0]["choices"][0]
    assert first["prompt_logprobs"] == plps
    assert all("prompt_logprobs" not in e["choices"][0] for e in events[1:] if e["choices"])
    # Chat: beside the choices, for the templated prompt.
    chat = served.http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 0},
    ).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert chat["prompt_logprobs"][0] is None and all(
        len(p) == 1 for p in chat["prompt_logprobs"][1:]
    )


@pytest.mark.parametrize(
    ("url", "body", "param"),
    [
        ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": 1.5}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": "all"}, "prompt_logprobs"),
        ("/v1/completions", {"echo": True, "logprobs": 21}, None),
        ("/v1/completions", {"max_tokens": 0}, None),
        ("/v1/chat/completions", {"prompt_logprobs": -2}, "prompt_logprobs"),
        ("/v1/chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ],
)
def test_bad_prompt_logprobs_are_400_naming_the_field(
    served: Served, url: str, body: dict[str, Any], param: str | None
) -> None:
    base = (
        {"prompt": "x"} if "chat" not in url else {"messages": [{"role": "user", "content": "x"}]}
    )
    resp = served.http.post(url, json={**base, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    if param is not None:
        assert error["param"] == param and "prompt_logprobs" in error["message"]
    else:
        assert next(iter(k for k in body if k != "echo")) in error["message"]


# ------------------------------------------------------------------- lm-evaluation-harness

MC_DOCS = [
    {"question": "The sky on a clear day is", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "five", "a fish", "ten"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin"], "answer": 0},
]
MC_TASK = """\
task: wick_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def _hf_loglikelihood(served: Served, context: str, continuation: str) -> float:
    """What lm-evaluation-harness scores, with transformers: the continuation's tokens given the
    context, encoded as the harness does (trailing spaces of the context move to the
    continuation; the whole is encoded once and split at the context's length)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole = served.tokenizer(context + continuation, add_special_tokens=False).input_ids
    ctxlen = len(served.tokenizer(context, add_special_tokens=False).input_ids)
    lps = served.hf_logprobs(whole)
    return sum(lps[pos - 1, whole[pos]].item() for pos in range(ctxlen, len(whole)))


def _run_lm_eval(
    tmp_path: Path, model: str, model_args: list[str], task: str, task_yaml: str, *extra: str
) -> Path:
    """`lm_eval run --model MODEL` on the local task `task` (its YAML), offline, against the
    served model; returns the output folder (samples logged). lm-eval is a test dependency
    (pyproject's test extras): a missing one fails, it is never skipped."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{task}.yaml").write_text(task_yaml)
    out_dir = tmp_path / "out"
    args = ",".join([f"model={MODEL_NAME}", *model_args, "num_concurrent=1", "max_retries=1"])
    env = {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"),
        "OPENAI_API_KEY": "unused",
    }
    lm_eval = Path(sys.executable).with_name("lm_eval")
    result = subprocess.run(
        [str(lm_eval), "run", "--model", model, "--model_args", args, *extra, "--tasks", task,
         "--include_path", str(tasks), "--output_path", str(out_dir), "--log_samples"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return out_dir


@pytest.mark.slow
def test_lm_eval_local_completions_matches_transformers(served: Served, tmp_path: Path) -> None:
    """`lm_eval --model local-completions` against the server on a multiple-choice task defined
    in a local YAML + JSONL (no hub): every choice's loglikelihood equals transformers'."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in MC_DOCS))
    out_dir = _run_lm_eval(
        tmp_path,
        "local-completions",
        [
            f"base_url={served.url}/v1/completions",
            f"tokenizer={served.folder}",
            "tokenizer_backend=huggingface",
        ],
        "wick_tiny_mc",
        MC_TASK.format(data=data),
    )
    (samples_file,) = out_dir.rglob("samples_wick_tiny_mc_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == len(MC_DOCS)
    checked = 0
    for sample in samples:
        doc = sample["doc"]
        assert len(sample["arguments"]) == len(doc["choices"])
        arguments = [sample["arguments"][f"gen_args_{i}"] for i in range(len(doc["choices"]))]
        for args, resp in zip(arguments, sample["resps"], strict=True):
            context, continuation = args["arg_0"], args["arg_1"]
            got = float(resp[0][0])
            assert got == pytest.approx(_hf_loglikelihood(served, context, continuation), abs=TOL)
            checked += 1
    assert checked == sum(len(d["choices"]) for d in MC_DOCS)


GEN_TASK = """\
task: wick_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
"""


@pytest.mark.slow
def test_lm_eval_local_chat_completions_generates_what_the_chat_api_does(
    served: Served, tmp_path: Path
) -> None:
    """`lm_eval --model local-chat-completions --apply_chat_template` on a `generate_until` task:
    each answer the harness records is what the chat API answers greedily to the same message
    with the same limit and stop (the random model's words, so equality, not accuracy)."""
    docs = [{"question": d["question"], "answer": d["choices"][0]} for d in MC_DOCS]
    data = tmp_path / "gen.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    out_dir = _run_lm_eval(
        tmp_path,
        "local-chat-completions",
        [f"base_url={served.url}/v1/chat/completions"],
        "wick_tiny_gen",
        GEN_TASK.format(data=data),
        "--apply_chat_template",
    )
    (samples_file,) = out_dir.rglob("samples_wick_tiny_gen_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == len(docs)
    for sample in samples:
        answer = served.client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": sample["doc"]["question"]}],
            max_tokens=12,
            temperature=0.0,
            stop=["\n\n"],
        )
        assert sample["resps"][0][0] == answer.choices[0].message.content
