"""Greedy SmolLM2 runs on the native CPU attention (kernels/cpu/paged_attention.c) against the
fp32 reference on the portable backend: fp32 exactly; bf16 (on each ISA path this CPU runs) up
to the first near-tie, with logprobs within the bf16 tolerance of test_invariants.py.

The kernel tests against the PyTorch reference once passed while the avx512_bf16 build (Q.K on
vdpbf16ps, now off) made the model answer gibberish: the greedy answer to a factual question is
checked on every path too."""

from __future__ import annotations

import pytest

from model_server.engine.llm import LLM
from model_server.engine.outputs import CompletionOutput
from model_server.kernels.cpu import isa as isa_mod
from model_server.kernels.cpu import native
from model_server.sampling_params import SamplingParams
from tests.engine.test_invariants import assert_same_greedy

pytestmark = pytest.mark.slow

KV_CACHE = 128 * 1024**2
NUM_PROMPTS = 6
MAX_TOKENS = 16
RUNNABLE = [i.name for i in isa_mod.supported_isas(isa_mod.cpu_flags())]


def _run(dtype: str, backend: str, prompts) -> list[CompletionOutput]:
    llm = LLM(kv_cache_memory=KV_CACHE, dtype=dtype, attention_backend=backend)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    # All prompts in one batch: prefills batched into a step, then decodes at batch NUM_PROMPTS.
    return [out.outputs[0] for out in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def prompts(chat_prompts) -> list[list[int]]:
    llm = LLM(kv_cache_memory=KV_CACHE, dtype="float32", attention_backend="torch")
    return [llm.apply_chat_template(c) for c in chat_prompts[:NUM_PROMPTS]]


@pytest.fixture(scope="module")
def reference(prompts) -> list[CompletionOutput]:
    return _run("float32", "torch", prompts)


def test_fp32_native_equals_reference(prompts, reference) -> None:
    assert_same_greedy("float32", reference, _run("float32", "cpu", prompts))


@pytest.mark.parametrize("isa", RUNNABLE[:1] + [i for i in RUNNABLE[1:] if i == "avx2"])
def test_bf16_native_close_to_fp32_reference(prompts, reference, isa, monkeypatch) -> None:
    monkeypatch.setenv(isa_mod.CPU_ISA_ENV, isa)
    isa_mod._choose.cache_clear()
    native.clear_cache()
    try:
        assert native.load_kernels() is not None and native.load_kernels().isa == isa
        assert_same_greedy("bfloat16", reference, _run("bfloat16", "cpu", prompts))
        llm = LLM(kv_cache_memory=KV_CACHE, dtype="bfloat16", attention_backend="cpu")
        question = [{"role": "user", "content": "What is the capital of France?"}]
        answer = llm.chat(question, SamplingParams(max_tokens=12, temperature=0))
        assert "Paris" in answer[0].outputs[0].text
    finally:
        isa_mod._choose.cache_clear()
        native.clear_cache()
