"""The bounds on oneDNN's per-shape caches (kernels/cpu/onednn_cache.py): the defaults they set,
the user's values they keep, and, in fresh processes (both libraries read the variables once),
that a server-like stream of ever-new matmul row counts no longer grows the resident memory
by the caches' contents."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from model_server.kernels.cpu.onednn_cache import (
    DEFAULT_CAPACITY,
    IDEEP_CACHE_ENV,
    ONEDNN_CACHE_ENV,
    bound_onednn_caches,
)

ROOT = Path(__file__).parents[2]
MIB = 1 << 20


def test_sets_both_capacities_where_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ONEDNN_CACHE_ENV, raising=False)
    monkeypatch.delenv(IDEEP_CACHE_ENV, raising=False)
    assert bound_onednn_caches() == {
        ONEDNN_CACHE_ENV: str(DEFAULT_CAPACITY),
        IDEEP_CACHE_ENV: str(DEFAULT_CAPACITY),
    }
    assert os.environ[ONEDNN_CACHE_ENV] == str(DEFAULT_CAPACITY)


def test_keeps_the_users_values_but_never_a_crashing_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ONEDNN_CACHE_ENV, "0")  # oneDNN: caching off, valid
    monkeypatch.setenv(IDEEP_CACHE_ENV, "0")  # ideep: a segfault at the first matmul
    assert bound_onednn_caches(64) == {ONEDNN_CACHE_ENV: "0", IDEEP_CACHE_ENV: "64"}
    monkeypatch.setenv(ONEDNN_CACHE_ENV, "2048")
    monkeypatch.setenv(IDEEP_CACHE_ENV, "4096")
    assert bound_onednn_caches() == {ONEDNN_CACHE_ENV: "2048", IDEEP_CACHE_ENV: "4096"}
    monkeypatch.setenv(ONEDNN_CACHE_ENV, "lots")  # not a number: ours
    assert bound_onednn_caches(32)[ONEDNN_CACHE_ENV] == "32"


# Prefill-like matmuls: bf16 (oneDNN's path on CPUs with AVX-512), SmolLM2's MLP shapes, a new
# row count each time, as a server's prefill steps have. Prints the RSS growth in bytes.
_STREAM = """
import json, sys, torch, torch.nn.functional as F
from model_server.kernels.cpu.onednn_cache import bound_onednn_caches
if sys.argv[1] == "bounded":
    bound_onednn_caches()
torch.set_num_threads(1)
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
weights = [torch.randn(n, k).bfloat16() for n, k in ((3072, 576), (576, 1536), (960, 576))]
xs = [torch.randn(512, w.shape[1]).bfloat16() for w in weights]
F.linear(xs[0][:65], weights[0])
before = rss()
for rows in range(65, 65 + 300):
    for x, w in zip(xs, weights):
        F.linear(x[:rows], w)
print(json.dumps({"growth": rss() - before, "bf16_onednn": torch.backends.mkldnn.is_available()}))
"""


def _stream_growth(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k not in (ONEDNN_CACHE_ENV, IDEEP_CACHE_ENV)}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", _STREAM, mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    )
    return int(json.loads(done.stdout.strip().splitlines()[-1])["growth"])


@pytest.mark.slow
def test_new_row_counts_no_longer_fill_memory() -> None:
    unbounded = _stream_growth("default")
    bounded = _stream_growth("bounded")
    # 900 primitives, each kept by both caches where bf16 runs through oneDNN (AVX-512 CPUs):
    # 557-603 MiB at the defaults on a 2-core Zen 4; 140-276 MiB with DEFAULT_CAPACITY (the
    # spread is not explained yet, see the soak note). Without oneDNN bf16 both stay small.
    if unbounded > 300 * MIB:
        assert bounded < 0.6 * unbounded, (bounded / MIB, unbounded / MIB)
    else:
        assert bounded < 300 * MIB, f"RSS grew {bounded / MIB:.0f} MiB with the caches bounded"
