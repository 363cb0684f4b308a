"""Tensor parallelism of the mixture-of-experts families on CPU (gloo): TP=2 generates the same
greedy tokens as TP=1, with logprobs equal to fp32 rounding.

The tiny checkpoints of test_parity_moe run through the whole engine, once in one process and
once over two ranks (rank 1 a spawned worker): every expert's intermediate dim is split in
half (each rank holds half of every expert, partial outputs all-reduced), the shared experts and
dense MLPs as row/column-parallel pairs, attention by KV-head group, and DeepSeek's latent
attention by heads with the latent cache replicated on both ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from model_server.distributed.partition import TensorParallelSplitError
from model_server.engine.llm import LLM
from model_server.models import check_tensor_parallel
from tests.models.test_parity_moe import MOE_CONFIGS, save_tiny
from tests.models.test_tensor_parallel import ENGINE_ARGS, _generate

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_tp2_greedy_tokens_equal_tp1(name: str, tmp_path: Path) -> None:
    save_tiny(name, tmp_path)
    single = _generate(tmp_path, tp=1)
    sharded = _generate(tmp_path, tp=2)
    for (tokens_1, logprobs_1, prompt_1), (tokens_2, logprobs_2, prompt_2) in zip(
        single, sharded, strict=True
    ):
        assert len(tokens_1) == 12
        assert tokens_2 == tokens_1
        assert logprobs_2 == pytest.approx(logprobs_1, abs=1e-4)
        assert prompt_2 == pytest.approx(prompt_1, abs=1e-4)


def test_experts_that_do_not_split_are_a_startup_error(tmp_path: Path) -> None:
    config = MOE_CONFIGS["qwen3_moe"]()
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.moe_intermediate_size = 30
    with pytest.raises(TensorParallelSplitError, match=r"moe_intermediate_size \(30\)"):
        check_tensor_parallel(config, 4)
    save_tiny("deepseek_v3", tmp_path)  # 4 heads
    with pytest.raises(TensorParallelSplitError, match=r"num_attention_heads \(4\)"):
        LLM(str(tmp_path), tensor_parallel_size=3, **ENGINE_ARGS)
