"""tools/lora_adapters.py: the adapters it writes for a model load and change its answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import lora_adapters

pytest.importorskip("peft")


def test_written_adapters_serve_and_change_the_answers(tmp_path: Path, capsys) -> None:
    from model_server.engine.llm import LLM
    from model_server.lora.request import LoRARequest
    from model_server.sampling_params import SamplingParams
    from tests.lora.helpers import save_base

    save_base(tmp_path / "base", "llama")
    out = tmp_path / "loras"
    argv = ["--out", str(out), "--model", str(tmp_path / "base"), "--count", "2", "--rank", "8"]
    assert lora_adapters.main([*argv, "--targets", "q_proj", "v_proj", "down_proj"]) == 0
    printed = capsys.readouterr().out
    assert f"lora1={out / 'lora1'}" in printed and "bench: lora1 lora2" in printed
    config = json.loads((out / "lora2" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["target_modules"] == ["q_proj", "v_proj", "down_proj"]
    llm = LLM(str(tmp_path / "base"), dtype="float32", enable_lora=True, max_loras=2)
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True)
        prompts = [[5, 6, 7, 8]] * 3
        loras = [None, *(LoRARequest(f"lora{i}", i, str(out / f"lora{i}")) for i in (1, 2))]
        outs = llm.generate(prompts, params, lora_request=loras)
        first = [o.outputs[0].logprobs[0].logprob for o in outs]
        assert len(set(first)) == 3  # each adapter changes the model's answer
    finally:
        llm.shutdown()


def test_bad_counts_are_refused() -> None:
    with pytest.raises(SystemExit):
        lora_adapters.main(["--out", "/tmp/x", "--rank", "0"])
