"""The compile cache and matchers on the real SmolLM2 tokenizer with the real grammar engine:
one compile per constraint (also under concurrent requests), failures not cached, bitmask rows
only for constrained requests, matchers rebuilt from the output tokens when their count differs."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from model_server.layers.sampling.grammar_mask import unpack_bitmask
from model_server.loader.embedded import embedded_model_available, embedded_model_path
from model_server.structured_output.bitmask import fill_grammar_bitmask
from model_server.structured_output.manager import RequestGrammar, StructuredOutputManager
from model_server.structured_output.params import StructuredOutputError, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    if not embedded_model_available():
        pytest.skip("the embedded SmolLM2 is not installed")
    from model_server.loader.gguf_loader import load_gguf

    return load_gguf(embedded_model_path(), dummy=True).tokenizer


@pytest.fixture(scope="module")
def manager(tokenizer: Any) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer, 49152, tokenizer.eos_token_id)


def tokens(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def test_one_compile_per_constraint_even_concurrently(manager: StructuredOutputManager) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    before = manager.num_compiles
    results: list[Any] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                manager.compile(StructuredOutputsParams(json=json.dumps(schema)))
            )
        )
        for _ in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert manager.num_compiles == before + 1
    assert all(r is results[0] for r in results)


def test_failures_name_the_field_and_are_not_cached(manager: StructuredOutputManager) -> None:
    bad = StructuredOutputsParams(grammar="root ::= (", param="guided_grammar")
    for _ in range(2):
        with pytest.raises(StructuredOutputError, match=r"^guided_grammar: the grammar cannot"):
            manager.compile(bad)
    assert bad.key not in manager._cache


def test_cache_drops_the_least_recently_used(tokenizer: Any) -> None:
    small = StructuredOutputManager(tokenizer, 49152, tokenizer.eos_token_id, cache_size=2)
    a, b, c = (StructuredOutputsParams(choice=[x]) for x in "abc")
    small.compile(a)
    small.compile(b)
    small.compile(a)  # a is now the most recent
    small.compile(c)
    assert list(small._cache) == [a.key, c.key]


def test_matcher_follows_a_valid_answer_and_terminates(
    manager: StructuredOutputManager, tokenizer: Any
) -> None:
    grammar = manager.new_grammar(StructuredOutputsParams(json=SCHEMA))
    answer = tokens(tokenizer, '{"ok": true}')  # xgrammar's JSON separators: ", " and ": "
    bitmask = torch.empty((1, 49152 // 32), dtype=torch.int32)
    for t in answer:
        grammar.fill_bitmask(bitmask, 0)
        assert unpack_bitmask(bitmask, 49152)[0, t]
        assert grammar.accept_token(t)
    grammar.fill_bitmask(bitmask, 0)
    allowed = unpack_bitmask(bitmask, 49152)[0]
    assert torch.nonzero(allowed).flatten().tolist() == [tokenizer.eos_token_id]
    assert not grammar.is_terminated and grammar.accept_token(tokenizer.eos_token_id)
    assert grammar.is_terminated


@dataclass
class _Req:
    grammar: RequestGrammar | None
    output_token_ids: list[int] = field(default_factory=list)


def test_bitmask_rows_only_for_constrained_requests_and_rebuilt_state(
    manager: StructuredOutputManager, tokenizer: Any
) -> None:
    assert fill_grammar_bitmask([_Req(None), _Req(None)], 49152) is None
    prefix = tokens(tokenizer, '{"ok":')
    fresh = manager.new_grammar(StructuredOutputsParams(json=SCHEMA))
    # A matcher that has seen nothing, for a request that already has output tokens (as if its
    # state were lost): the fill replays the tokens first.
    reqs = [_Req(None), _Req(fresh, list(prefix)), _Req(None)]
    rows, bitmask = fill_grammar_bitmask(reqs, 49152)
    assert rows == [1] and bitmask.shape == (3, 49152 // 32)
    assert fresh.num_accepted == len(prefix)
    allowed = unpack_bitmask(bitmask, 49152)[1]
    assert allowed[tokens(tokenizer, " true")[0]] and not allowed[tokens(tokenizer, '"')[0]]
