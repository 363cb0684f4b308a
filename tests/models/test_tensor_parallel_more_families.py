"""Tensor parallelism of the families of test_parity_more_families.py: TP=2 gives TP=1's greedy
tokens in fp32, through the whole engine (a spawned rank-1 worker, the HF folder loader):
StarCoder2's column/row-split non-gated MLP with biases and its window, GLM's (-hf) permuted
q/k rows, DBRX's fused expert matrices split per rank, and the remote-code layouts (InternLM2's
grouped `wqkv`, ChatGLM's `query_key_value`) split after their renames. And the engine on the
"cpu" attention backend (with the native decoder step for the Llama-shaped InternLM2 and
Baichuan) gives the reference model's greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_server.engine.llm import LLM
from model_server.sampling_params import SamplingParams
from tests.models.test_parity_more_families import HF_CONFIGS, REMOTE, _perturbed, _write_remote
from tests.models.test_tensor_parallel import ENGINE_ARGS, PROMPTS

pytestmark = pytest.mark.slow

TP_NAMES = ["starcoder2", "glm", "dbrx", "internlm2", "chatglm3_multi_query"]


def _save(name: str, root: Path) -> Path:
    folder = root / name
    folder.mkdir()
    if name in REMOTE:
        _write_remote(REMOTE[name], folder)
    else:
        _perturbed(HF_CONFIGS[name]()).save_pretrained(folder, safe_serialization=True)
    return folder


def _generate(folder: Path, tp: int) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    with LLM(str(folder), tensor_parallel_size=tp, attention_backend="torch", **ENGINE_ARGS) as llm:
        outputs = llm.generate(PROMPTS, params)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outputs]


@pytest.mark.parametrize("name", TP_NAMES)
def test_tp2_greedy_tokens_equal_tp1(name: str, tmp_path: Path) -> None:
    folder = _save(name, tmp_path)
    single = _generate(folder, tp=1)
    sharded = _generate(folder, tp=2)
    for (tokens_1, logprobs_1), (tokens_2, logprobs_2) in zip(single, sharded, strict=True):
        assert len(tokens_1) == 12
        assert tokens_2 == tokens_1
        torch.testing.assert_close(logprobs_2, logprobs_1, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["starcoder2", "dbrx", *REMOTE])
def test_engine_on_the_cpu_backend_gives_hf_greedy_tokens(name: str, tmp_path: Path) -> None:
    """The whole engine from the folder (the HF loader's config translation for the remote
    layouts), the "cpu" attention backend and the CPU platform's kernels and native decoder
    step where the layers allow it: the reference model's greedy tokens."""
    folder = tmp_path / name
    folder.mkdir()
    if name in REMOTE:
        hf = _write_remote(REMOTE[name], folder)
    else:
        hf = _perturbed(HF_CONFIGS[name]())
        hf.save_pretrained(folder, safe_serialization=True)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(folder), attention_backend="cpu", **ENGINE_ARGS) as llm:
        outputs = llm.generate(PROMPTS, params)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        with torch.inference_mode():
            expected = hf.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0
            )
        assert output.outputs[0].token_ids == expected[0, len(prompt) :].tolist()
