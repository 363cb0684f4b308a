"""`tools/bench_models.py` writes folders that Wick and transformers both load.

Every shape, cut to one layer and scaled down 16x (`--scale-down`, for tests only), in fp32: Wick's
offline engine generates greedy tokens from text (the folder's own tokenizer) and they equal
transformers' greedy tokens on the same folder, whose config class is the shape's real one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from model_server.engine.llm import LLM
from model_server.sampling_params import SamplingParams
from tools import bench_models

ARGS = ["--layers", "1", "--scale-down", "16", "--experts", "4", "--dtype", "float32"]
CLASSES = {
    "llama-3.2-1b": ("LlamaForCausalLM", "LlamaConfig"),
    "qwen3-0.6b": ("Qwen3ForCausalLM", "Qwen3Config"),
    "gemma-3-1b": ("Gemma3ForCausalLM", "Gemma3TextConfig"),
    "phi-3-mini": ("Phi3ForCausalLM", "Phi3Config"),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
    "deepseek-v2-lite": ("DeepseekV2ForCausalLM", "DeepseekV2Config"),
}
TOKENS = 6


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench_models")
    assert bench_models.main(["--out", str(path), *ARGS]) == 0
    return path


def test_every_shape_is_named() -> None:
    assert set(CLASSES) == set(bench_models.SHAPES)


@pytest.mark.parametrize("name", list(CLASSES))
def test_wick_and_transformers_load_the_folder(
    name: str, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = out / name
    architecture, config_class = CLASSES[name]
    config = transformers.AutoConfig.from_pretrained(folder)
    assert type(config).__name__ == config_class
    assert config.architectures == [architecture]
    assert config.num_hidden_layers == 1
    assert config.vocab_size == len(transformers.AutoTokenizer.from_pretrained(folder)) == 49152

    monkeypatch.setenv("WICK_CPU_LINEAR_TUNING", "0")  # fixed kernels: no startup timing
    llm = LLM(str(folder), dtype="float32", max_model_len=64, kv_cache_memory=4 * 1024**2)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    output = llm.generate(["The capital of France is"], params)[0]
    wick = list(output.outputs[0].token_ids)
    assert len(wick) == TOKENS

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(hf).__name__ == architecture
    prompt = torch.tensor([list(output.prompt_token_ids)])
    with torch.no_grad():
        ids = hf.generate(prompt, max_new_tokens=TOKENS, do_sample=False, min_new_tokens=TOKENS)
    assert wick == ids[0, prompt.shape[1] :].tolist()


def test_a_complete_folder_is_kept(out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = out / "qwen3-0.6b" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    capsys.readouterr()
    assert bench_models.main(["--out", str(out), "--only", "qwen3-0.6b", *ARGS]) == 0
    assert "complete, kept" in capsys.readouterr().out
    assert weights.stat().st_mtime_ns == before

    # Other options (or --force) write it again; no partial folder is left behind.
    argv = ["--out", str(out), "--only", "qwen3-0.6b", *ARGS, "--seed", "1"]
    assert bench_models.main(argv) == 0
    line = capsys.readouterr().out
    assert "written" in line and "B params" in line and "GB in bf16" in line
    assert json.loads((out / "qwen3-0.6b" / "bench_model.json").read_text())["seed"] == 1
    assert not list(out.glob(".*.partial"))


def test_the_help_says_the_vocabulary_is_not_the_real_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        bench_models.main(["--help"])
    assert "vocab_size" in capsys.readouterr().out
