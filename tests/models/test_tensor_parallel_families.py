"""Tensor parallelism of the families beyond Llama: TP=2 gives TP=1's greedy tokens in fp32.

Same procedure as test_tensor_parallel.py (whole engine, a spawned rank-1 worker, chunked
prefills and mixed batches) on the tiny configs of test_parity_families.py: Gemma 2 and Gemma 3
with their sliding-window KV cache group (the step message carries both block tables), Phi-3's
fused checkpoint tensors split per rank, Phi-2's and StableLM's biases and LayerNorms, GLM-4's
permuted q/k rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from model_server.engine.llm import LLM
from model_server.sampling_params import SamplingParams
from tests.models.test_parity_families import CONFIGS
from tests.models.test_tensor_parallel import ENGINE_ARGS, PROMPTS

pytestmark = pytest.mark.slow

TP_NAMES = ["gemma2", "gemma3", "phi3_longrope_window", "phi2", "stablelm_qkv_bias", "glm4"]


def _save(name: str, root: Path) -> Path:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]())
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith(".bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * (0.1 if "norm" in pname else 0.02))
    folder = root / name
    hf.save_pretrained(folder, safe_serialization=True)
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


def test_gemma_head_split_refused_clearly(tmp_path: Path) -> None:
    """4 query heads do not divide over 3 ranks: a startup error naming the flag."""
    folder = _save("gemma2", tmp_path)
    with pytest.raises(ValueError, match="tensor-parallel-size 3"):
        LLM(str(folder), tensor_parallel_size=3, **ENGINE_ARGS)
