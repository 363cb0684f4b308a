"""Grammar-constrained decoding in the offline engine on the real SmolLM2 (fp32): constrained
outputs validate; a grammar changes nothing for the unconstrained requests beside it; preemption
(recompute) leaves a constrained request's output as it was; n > 1 siblings each keep their own
matcher; a grammar that cannot finish in max_tokens ends with `length`; a complete grammar ends
the request even with ignore_eos."""

from __future__ import annotations

import json

import jsonschema
import pytest

from model_server.engine.llm import LLM
from model_server.sampling_params import SamplingParams
from model_server.structured_output.params import StructuredOutputError, StructuredOutputsParams

pytestmark = pytest.mark.slow

KV_CACHE = 128 * 1024**2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["name", "tags", "score"],
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory=KV_CACHE, max_model_len=1024, dtype="float32")


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    questions = [
        "Describe a cat as JSON.",
        "Tell me about Paris.",
        "List three fruits.",
        "What is 2 + 2?",
        "Write a haiku about rain.",
        "Name a color.",
    ]
    return [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]


def json_params(**kw) -> SamplingParams:
    return SamplingParams(
        max_tokens=96, structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw
    )


def test_constrained_output_validates_greedy_sampled_and_n(llm: LLM, prompts) -> None:
    outs = llm.generate(prompts[:2], json_params(temperature=0))
    outs += llm.generate(prompts[:2], json_params(temperature=1.0, seed=5, n=3))
    for out in outs:
        for sample in out.outputs:
            assert sample.finish_reason == "stop", sample.text
            jsonschema.validate(json.loads(sample.text), SCHEMA)


def test_free_requests_are_unchanged_by_constrained_neighbours(llm: LLM, prompts) -> None:
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = llm.generate(prompts[2:], free)
    mixed = llm.generate(
        prompts[:2] + prompts[2:], [json_params(temperature=0)] * 2 + [free] * len(prompts[2:])
    )
    assert [o.outputs[0].token_ids for o in mixed[2:]] == [o.outputs[0].token_ids for o in alone]


def test_preemption_rebuilds_nothing_and_changes_nothing(llm: LLM, prompts) -> None:
    params = json_params(temperature=0)
    reference = llm.generate(prompts, params)
    bytes_per_block = llm.engine.core.model_runner.bytes_per_block()
    small = LLM(
        kv_cache_memory=20 * bytes_per_block,
        max_model_len=1024,
        dtype="float32",
        enable_prefix_caching=False,
    )
    got = small.generate(prompts, params)
    assert small.engine.core.scheduler.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in reference]


def test_unfinishable_grammar_ends_with_length(llm: LLM, prompts) -> None:
    params = SamplingParams(
        max_tokens=6, temperature=0, structured_outputs=StructuredOutputsParams(regex="x{40}")
    )
    (out,) = llm.generate(prompts[:1], params)
    sample = out.outputs[0]
    assert sample.finish_reason == "length" and len(sample.token_ids) == 6
    assert set(sample.text) == {"x"} and len(sample.text) < 40


def test_complete_grammar_stops_even_with_ignore_eos(llm: LLM, prompts) -> None:
    params = SamplingParams(
        max_tokens=40,
        temperature=0,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]),
    )
    (out,) = llm.generate(prompts[:1], params)
    assert out.outputs[0].text in ("alpha", "beta")
    assert out.outputs[0].finish_reason == "stop"


def test_uncompilable_grammar_is_refused_before_queueing(llm: LLM, prompts) -> None:
    bad = SamplingParams(
        structured_outputs=StructuredOutputsParams(grammar="root ::= (", param="g")
    )
    with pytest.raises(StructuredOutputError, match="cannot be compiled") as info:
        llm.generate(prompts[:1], bad)
    assert info.value.param == "g"
    assert not llm.engine.has_unfinished_requests()


def test_compiles_are_cached_per_constraint(llm: LLM, prompts) -> None:
    manager = llm.engine.structured_output
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    before = manager.num_compiles
    for _ in range(3):
        params = SamplingParams(
            max_tokens=16, temperature=0, structured_outputs=StructuredOutputsParams(json=schema)
        )
        llm.generate(prompts[:1], params)
    assert manager.num_compiles == before + 1
