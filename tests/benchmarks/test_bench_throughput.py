"""The transformers baseline shared by `bench throughput` and `bench latency` (device placement,
dtype, weights, the engine's release), and the bench commands' imports on a bare GPU image."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch
import transformers

from model_server.benchmarks.hf_baseline import (
    BaselineTarget,
    HFGenerator,
    baseline_target,
    build_hf_model,
    default_baseline_batch_size,
    free_device_memory,
)
from model_server.engine.llm import LLM
from model_server.loader.source import ModelSource
from model_server.platforms.cpu import CpuPlatform
from model_server.platforms.cuda import CudaPlatform

ROOT = Path(__file__).resolve().parents[2]
TINY = {  # also the tiny model of test_bench_latency
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def _config() -> transformers.LlamaConfig:
    config = transformers.LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    config.architectures = TINY["architectures"]
    return config


class _CountingPlatform(CpuPlatform):
    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    def synchronize(self) -> None:
        self.syncs += 1


def _target(device: str, dtype: torch.dtype, weights=None, platform=None) -> BaselineTarget:
    source = ModelSource(_config(), None, "tiny", weights, 0, format="dummy")
    return BaselineTarget(source, torch.device(device), dtype, platform or CpuPlatform())


def test_baseline_model_and_inputs_are_placed_on_the_engines_device() -> None:
    # The meta device stands in for a GPU: anything built on the CPU instead would show.
    target = _target("meta", torch.bfloat16)
    model = build_hf_model(target)
    assert {p.device for p in model.parameters()} == {torch.device("meta")}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert target.source.hf_config.dtype != torch.bfloat16  # the engine's config is untouched
    hf = HFGenerator.__new__(HFGenerator)
    hf.target = target
    ids, mask = hf.inputs([[5, 6, 7], [8]])
    assert ids.device == mask.device == torch.device("meta")
    assert ids.shape == mask.shape == (2, 3)


def test_baseline_loads_the_sources_weights_and_times_with_syncs() -> None:
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(_config())
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    platform = _CountingPlatform()
    target = _target("cpu", torch.float32, lambda: iter(state.items()), platform)
    hf = HFGenerator(target)
    for name, tensor in hf.model.state_dict().items():
        torch.testing.assert_close(tensor, state[name])
    seconds = hf.timed([([[1, 2, 3], [4, 5]], 3)])
    assert seconds > 0 and platform.syncs == 2

    partial = {k: v for k, v in state.items() if "layers.1." not in k}
    target = _target("cpu", torch.float32, lambda: iter(partial.items()))
    with pytest.raises(RuntimeError, match="missing weights"):
        build_hf_model(target)


def test_default_baseline_batch_size_per_device() -> None:
    assert default_baseline_batch_size(CpuPlatform()) == 16
    assert default_baseline_batch_size(CudaPlatform()) == 64  # constructing it needs no GPU


def test_the_engine_is_released_before_the_baseline(tmp_path: Path) -> None:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    llm = LLM(str(path), load_format="dummy", dtype="float32", kv_cache_memory=8 << 20)
    model = weakref.ref(llm.engine.core.model_runner.model)
    target = baseline_target(llm)
    assert target.device == torch.device("cpu") and target.dtype == torch.float32
    llm.shutdown()
    del llm
    free_device_memory(target.platform)
    gc.collect()
    assert model() is None  # nothing else keeps the engine's weights alive


# -- on a bare GPU image: no pydantic, pydantic-settings, gguf, fastapi, uvicorn ---------------

_HIDDEN_RUN = """
import importlib.machinery, sys
HIDDEN = {"pydantic", "pydantic_settings", "gguf", "fastapi", "uvicorn", "starlette", "rich",
          "accelerate", "httpx", "prometheus_client", "openai", "langchain_core"}

class Hide(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            return None  # as if not installed
        return super().find_spec(name, path, target)

sys.meta_path[:] = [Hide if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
from model_server.entrypoints.cli import main

for argv in ARGVS:
    try:
        main(argv)
    except SystemExit as exc:
        assert exc.code == 0, (argv, exc.code)
assert not HIDDEN & {m.split(".")[0] for m in sys.modules}
"""


def test_bench_commands_run_without_the_server_dependencies(tmp_path: Path) -> None:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    model = ["--load-format", "dummy", "--model", str(path), "--baseline", "transformers"]
    model += ["--num-threads", "1"]  # see test_bench_latency_cli_on_cpu
    io = ["--max-input-len", "40", "--max-output-len", "40"]
    argvs = [
        ["bench", "throughput", "--num-prompts", "3", *io, *model],
        ["bench", "latency", "--input-len", "8", "--output-len", "4", "--num-iters", "1", *model],
    ]
    code = f"ARGVS = {argvs!r}\n" + textwrap.dedent(_HIDDEN_RUN)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "transformers (batch 16): " in proc.stdout  # the CPU default batch
    assert "ratio: " in proc.stdout
    assert "measured-copy bound" in proc.stdout
    assert "ratio: decode " in proc.stdout
