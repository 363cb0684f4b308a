"""The real SmolLM2 GGUF: greedy tokens equal HF transformers' (which loads the GGUF itself)."""

from __future__ import annotations

import os

import pytest
import torch

from model_server.engine.llm import LLM
from model_server.loader import embedded_model_path
from model_server.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain what a neural network is to a ten year old.",
    "Give me three tips for staying focused while studying.",
    "What are the main differences between Python lists and tuples?",
]


@pytest.fixture(scope="module")
def hf_model():
    import transformers

    path = embedded_model_path()
    # transformers dequantizes the GGUF itself (and un-permutes Q/K on its own): an independent
    # check of our loader as well as of the engine.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory=128 * 1024**2)


def test_greedy_tokens_match_transformers(hf_model, llm: LLM) -> None:
    eos = llm.get_tokenizer().eos_token_id
    params = SamplingParams(max_tokens=32, temperature=0.0)
    prompts = [llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            out = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        expected = out[0, len(prompt) :].tolist()
        if eos in expected:
            expected = expected[: expected.index(eos) + 1]
        assert got == expected


def test_prefill_logits_close_to_transformers(hf_model, llm: LLM) -> None:
    prompt = llm.apply_chat_template([{"role": "user", "content": CHATS[0]}])
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0, -1].float()
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    out = llm.generate([prompt], params)[0].outputs[0]
    top = out.logprobs[0].top
    expected_top = torch.log_softmax(expected, -1).topk(5)
    assert [t for t, _ in top] == expected_top.indices.tolist()
    torch.testing.assert_close(
        torch.tensor([lp for _, lp in top]), expected_top.values, atol=2e-3, rtol=0
    )


@pytest.mark.parametrize(
    ("prefix_caching", "budget"), [(True, 512), (False, 512), (True, 16)], ids=str
)
def test_prompt_logprobs_match_transformers(hf_model, prefix_caching: bool, budget: int) -> None:
    """Every prompt token's logprob and top-2 (the embedded model, fp32) as transformers gives
    them: with the prefix cache on (a second request over the same prefix recomputes it),
    off, and with 16-token chunks."""
    llm = LLM(
        dtype="float32",
        kv_cache_memory=128 * 1024**2,
        enable_prefix_caching=prefix_caching,
        max_num_batched_tokens=budget,
    )
    try:
        prompts = [llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS[:2]]
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
        llm.generate(prompts[:1], params)  # fills the prefix cache where it is on
        outs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            lps = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        got = out.prompt_logprobs
        assert got[0] is None and len(got) == len(prompt)
        for pos in range(1, len(prompt)):
            entry = got[pos]
            assert entry.logprob == pytest.approx(lps[pos - 1, prompt[pos]].item(), abs=1e-3)
            top = lps[pos - 1].topk(2)
            assert [t for t, _ in entry.top] == top.indices.tolist()
