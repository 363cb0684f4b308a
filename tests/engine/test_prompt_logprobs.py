"""Prompt logprobs (vLLM's `prompt_logprobs`) through the whole engine against transformers.

A tiny random Llama saved by transformers as a real HF folder (float32) runs prompts with
`prompt_logprobs=k`: each prompt token after the first gets its logprob under the model given the
tokens before it, its rank and the top k, equal to transformers' log_softmax of the same prompt's
logits within 1e-3, with prefix caching on and off and with a 16-token step budget (prompts of 45
tokens prefill in several chunks; positions accumulate across them). A request that asks for
prompt logprobs takes no prefix-cache hit (every position needs its logits), while a plain request
after it does. `max_tokens=0` finishes after the prefill with no token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from model_server.engine.llm import LLM
from model_server.engine.outputs import RequestOutput
from model_server.sampling_params import SamplingParams

TOL = 1e-3
VOCAB = 256
SHARED = [(13 * i + 7) % VOCAB for i in range(32)]  # two full blocks of 16 shared by the prompts
PROMPTS = [SHARED + [(5 * i + 3) % VOCAB for i in range(13)], [*SHARED, 9, 8, 7, 6, 5]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[torch.Tensor]]:
    """The saved folder and transformers' float32 log_softmax [P, V] of each prompt."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        initializer_range=0.05,
        tie_word_embeddings=False,
    )
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    folder = tmp_path_factory.mktemp("prompt_logprobs") / "llama"
    hf.save_pretrained(folder, safe_serialization=True)
    with torch.no_grad():
        expected = [hf(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in PROMPTS]
    return folder, expected


def _llm(folder: Path, prefix_caching: bool, budget: int) -> LLM:
    return LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        block_size=16,
        kv_cache_memory=4 * 1024**2,
        max_num_batched_tokens=budget,
        enable_prefix_caching=prefix_caching,
    )


def _check(out: RequestOutput, expected: torch.Tensor, k: int) -> None:
    prompt = out.prompt_token_ids
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    for pos in range(1, len(prompt)):
        entry, row = lps[pos], expected[pos - 1]
        assert entry is not None and entry.token_id == prompt[pos]
        assert abs(entry.logprob - row[prompt[pos]].item()) < TOL, pos
        assert entry.rank == 1 + int((row > row[prompt[pos]]).sum())
        top_lp = row.topk(k).values
        assert len(entry.top) == k
        got_ids = [t for t, _ in entry.top]
        # The same tokens (ties within the tolerance may swap places) with the same logprobs.
        for (t, lp), want in zip(entry.top, top_lp.tolist(), strict=True):
            assert abs(lp - want) < TOL and abs(lp - row[t].item()) < TOL
        assert set(got_ids) <= set(row.topk(k + 2).indices.tolist())


@pytest.mark.parametrize(("prefix_caching", "budget"), [(True, 16), (False, 16), (True, 512)])
def test_prompt_logprobs_match_transformers(
    model: tuple[Path, list[torch.Tensor]], prefix_caching: bool, budget: int
) -> None:
    folder, expected = model
    llm = _llm(folder, prefix_caching, budget)
    greedy = dict(temperature=0.0, ignore_eos=True)
    # Warm the prefix cache with the shared blocks.
    (plain,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, **greedy))
    assert plain.prompt_logprobs is None
    outs = llm.generate(
        PROMPTS,
        [
            SamplingParams(max_tokens=0, prompt_logprobs=3, **greedy),
            SamplingParams(max_tokens=2, prompt_logprobs=0, logprobs=1, **greedy),
        ],
    )
    _check(outs[0], expected[0], 3)
    _check(outs[1], expected[1], 0)
    # max_tokens=0: finished after the prefill, no token.
    assert outs[0].finished and outs[0].outputs[0].token_ids == []
    assert outs[0].outputs[0].finish_reason == "length"
    # The generated tokens are unaffected: greedy, the first one is the prompt's argmax.
    sample = outs[1].outputs[0]
    assert len(sample.token_ids) == 2 and sample.token_ids[0] == int(expected[1][-1].argmax())
    assert sample.logprobs is not None and len(sample.logprobs) == 2
    # No prefix-cache hit for prompt logprobs; a plain request still gets one.
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens == 0
    (again,) = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=1, **greedy))
    assert again.num_cached_tokens == (32 if prefix_caching else 0)


def test_prompt_logprobs_with_n_samples_and_one_token_prompt(
    model: tuple[Path, list[torch.Tensor]],
) -> None:
    folder, expected = model
    llm = _llm(folder, True, 16)
    params = SamplingParams(n=2, max_tokens=3, prompt_logprobs=1, temperature=1.0, seed=1)
    (out,) = llm.generate([PROMPTS[0]], params)
    assert len(out.outputs) == 2 and all(len(o.token_ids) == 3 for o in out.outputs)
    _check(out, expected[0], 1)
    (single,) = llm.generate([[5]], SamplingParams(max_tokens=0, prompt_logprobs=2))
    assert single.prompt_logprobs == [None] and single.outputs[0].token_ids == []


def test_max_tokens_zero_needs_prompt_logprobs() -> None:
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)
    SamplingParams(max_tokens=0, prompt_logprobs=0)
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs") as info:
            SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]
        assert info.value.param == "prompt_logprobs"  # type: ignore[attr-defined]
