"""--speculative-config on the real server (tiny model, loopback port): vLLM's
vllm:spec_decode_* counters in /metrics; a bad config never gets a server started."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from os import environ
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from model_server.engine.async_engine import AsyncLLM
from model_server.entrypoints.openai.api_server import build_app
from tests.entrypoints.conftest import MODEL_NAME, tiny_settings
from tests.loopback import free_port, serve_asgi

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one series of /metrics' text (0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


SERVE = [sys.executable, "-m", "model_server", "serve", "--port"]
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def test_spec_decode_counters_in_metrics(tiny_config: Path) -> None:
    s = tiny_settings(tiny_config, access_log=False, speculative_config=json.dumps(SPEC))
    llm = AsyncLLM(s.engine_config(), skip_warmup=True)
    app = build_app(llm, s)
    with serve_asgi(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the model server did not get ready"
            time.sleep(0.05)
        body = {
            "model": MODEL_NAME,
            "prompt": "one two three one two three one two three one two three",
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
        }
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 24
        text = client.get("/metrics").text
    labels = {"model_name": MODEL_NAME}
    drafts = metric(text, "vllm:spec_decode_num_drafts_total", **labels)
    draft_tokens = metric(text, "vllm:spec_decode_num_draft_tokens_total", **labels)
    accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total", **labels)
    assert "vllm:spec_decode_num_accepted_tokens_per_pos" in text
    # A tiny random model repeats itself: lookups of one token find drafts, some accepted.
    assert drafts > 0
    assert drafts <= draft_tokens <= 3 * drafts
    assert 0 <= accepted <= draft_tokens
    per_pos = [
        metric(
            text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i), **labels
        )
        for i in range(3)
    ]
    assert sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)  # a later draft needs the earlier ones
    # Every generated token is one of: a step's first token, or an accepted draft.
    generated = metric(text, "vllm:generation_tokens_total", **labels)
    assert generated == 24


def test_bad_config_never_starts_a_server(tiny_config: Path) -> None:
    bad = json.dumps({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValidationError, match="method 'eagle' is not supported"):
        tiny_settings(tiny_config, speculative_config=bad)
    # The command line: exit code 2 and one line naming the key, before anything loads.
    port = free_port()
    for value in (bad, json.dumps({**SPEC, "num_speculative_tokens": -1}), "{"):
        proc = subprocess.run(
            [*SERVE, str(port), "--speculative-config", value],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert "speculative_config" in proc.stderr
    # The environment variable: the server refuses to start as well.
    env_proc = subprocess.run(
        [*SERVE, str(port)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environ, "LLM_SPECULATIVE_CONFIG": bad},
    )
    assert env_proc.returncode != 0
    assert "LLM_SPECULATIVE_CONFIG" in env_proc.stderr
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
