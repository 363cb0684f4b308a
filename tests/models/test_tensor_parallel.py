"""Tensor parallelism on CPU (gloo): TP=2 gives the same greedy tokens as TP=1.

Tiny random HF checkpoints (saved as real safetensors folders, like test_parity_tiny) run through
the whole engine (`LLM`), once in one process and once with `tensor_parallel_size=2` (rank 0 here,
rank 1 a spawned worker). The configs cover GQA with one KV head per rank, a single KV head
replicated on both ranks, uneven KV-head groups (3 over 2 ranks, like SmolLM2-135M's 9/3), q/k
norm (Qwen3), q/k/v bias (Qwen2), attention and MLP biases (Llama), tied and untied embeddings
and a vocabulary that does not divide evenly. Small token budget: chunked prefills and mixed
prefill/decode batches, so steps where some chunks do not sample are covered too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from model_server.distributed.partition import TensorParallelSplitError
from model_server.engine.llm import LLM
from model_server.sampling_params import SamplingParams
from tests.models.test_parity_tiny import _COMMON, CONFIGS

pytestmark = pytest.mark.slow

TP_CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "llama_gqa_bias": CONFIGS["llama_gqa_bias"],  # 4 heads / 2 KV heads: one group per rank
    "llama_tied_mqa": CONFIGS["llama_tied_mqa"],  # 1 KV head, replicated on both ranks
    "qwen2_qkv_bias": CONFIGS["qwen2_qkv_bias"],
    "qwen3_qk_norm": CONFIGS["qwen3_qk_norm"],
    # 6 heads / 3 KV heads: rank 0 holds 2 groups, rank 1 one; tied; vocab 250 is padded.
    "qwen3_tied_uneven_groups": lambda: transformers.Qwen3Config(
        **{
            **_COMMON,
            "num_attention_heads": 6,
            "num_key_value_heads": 3,
            "head_dim": 16,
            "vocab_size": 250,
            "tie_word_embeddings": True,
        }
    ),
}
# float32: TP=2 adds partial sums in another order than TP=1; the tokens and logprobs are equal
# only at fp32 precision (`auto` is bf16 on CPUs with native bf16).
ENGINE_ARGS = dict(
    dtype="float32",
    max_model_len=64,
    block_size=4,
    kv_cache_memory=2 * 1024**2,
    max_num_batched_tokens=16,
    num_threads=1,
)
PROMPTS = [[(7 * i + 3) % 200 for i in range(13)], [(11 * i + 5) % 200 for i in range(21)]]


def _save(name: str, root: Path) -> Path:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(TP_CONFIGS[name]())
    with torch.no_grad():  # non-trivial biases and norms, as in test_parity_tiny
        for pname, p in hf.named_parameters():
            if pname.endswith(".bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * (0.1 if "norm" in pname else 0.02))
    folder = root / name
    hf.save_pretrained(folder, safe_serialization=True)
    return folder


def _generate(folder: Path, tp: int) -> list[tuple[list[int], list[float], list[float]]]:
    # Prompt logprobs too: every rank runs the LM head on the prompt rows (a collective).
    params = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=2
    )
    with LLM(str(folder), tensor_parallel_size=tp, **ENGINE_ARGS) as llm:
        core = llm.engine.core
        # Rank 0 really holds a shard: half the vocabulary rows (rounded up), its heads only.
        embed = core.model_runner.model.model.embed_tokens.weight
        assert embed.shape[0] == -(-core.model_runner.vocab_size // tp)
        outputs = llm.generate(PROMPTS, params)
        workers = getattr(core.executor, "workers", [])
        assert len(workers) == tp - 1 and all(w.is_alive() for w in workers)
    assert not torch.distributed.is_initialized()  # shutdown left the process group
    assert not any(w.is_alive() for w in workers)
    return [
        (
            o.outputs[0].token_ids,
            [lp.logprob for lp in o.outputs[0].logprobs],
            [lp.logprob for lp in o.prompt_logprobs[1:]],
        )
        for o in outputs
    ]


@pytest.mark.parametrize("name", list(TP_CONFIGS))
def test_tp2_greedy_tokens_equal_tp1(name: str, tmp_path: Path) -> None:
    folder = _save(name, tmp_path)
    single = _generate(folder, tp=1)
    sharded = _generate(folder, tp=2)
    for (tokens_1, logprobs_1, prompt_1), (tokens_2, logprobs_2, prompt_2) in zip(
        single, sharded, strict=True
    ):
        assert len(tokens_1) == 12
        assert tokens_2 == tokens_1
        # Sums reduced across ranks round differently, nothing more.
        torch.testing.assert_close(logprobs_2, logprobs_1, atol=1e-4, rtol=1e-4)
        assert len(prompt_1) == len(prompt_2) > 0
        torch.testing.assert_close(prompt_2, prompt_1, atol=1e-4, rtol=1e-4)


def test_uneven_split_is_a_startup_error_before_any_worker_starts(tmp_path: Path) -> None:
    folder = _save("qwen3_tied_uneven_groups", tmp_path)  # 3 KV heads
    with pytest.raises(TensorParallelSplitError, match="3 KV heads cannot be spread over"):
        LLM(str(folder), tensor_parallel_size=4, **ENGINE_ARGS)
