"""logit_bias on the real SmolLM2 through the offline engine: in one batch with unbiased
requests (one `generate` call schedules them together), which keep their own outputs."""

from __future__ import annotations

import pytest

from model_server.engine.llm import LLM
from model_server.sampling_params import InvalidParamError, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory=64 * 1024**2, max_model_len=512)


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **kw)


def test_biased_and_unbiased_requests_in_one_batch(llm: LLM) -> None:
    prompts = [
        llm.apply_chat_template([{"role": "user", "content": text}])
        for text in ("What is the capital of France?", "Name a color.")
    ]
    alone = [llm.generate([p], greedy())[0].outputs[0].token_ids for p in prompts]
    first = alone[0][0]
    forced = llm.get_tokenizer().encode(" banana", add_special_tokens=False)[0]
    batch = llm.generate(
        [prompts[0], prompts[1], prompts[0], prompts[1]],
        [
            greedy(),
            greedy(logit_bias={forced: 100.0}),
            greedy(logit_bias={first: -100.0}),
            greedy(),
        ],
    )
    ids = [out.outputs[0].token_ids for out in batch]
    assert ids[0] == alone[0]  # unbiased rows: what they give alone
    assert ids[3] == alone[1]
    assert ids[1] == [forced] * 8  # +100 wins every step
    assert ids[2][0] != first and first not in ids[2]  # -100 bans it at every step


def test_a_token_outside_the_vocabulary_is_refused(llm: LLM) -> None:
    vocab = llm.engine.vocab_size
    with pytest.raises(InvalidParamError, match=f"token id {vocab} is out of range") as info:
        llm.generate([[1, 2, 3]], greedy(logit_bias={vocab: 1.0}))
    assert info.value.param == "logit_bias"
