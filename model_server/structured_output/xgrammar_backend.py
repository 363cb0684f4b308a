"""xgrammar as the grammar engine: JSON schemas, regexes, choices and EBNF grammars compiled
against the tokenizer's vocabulary (preprocessed once), matchers that fill bitmasks in C++."""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from model_server.structured_output.backend import GrammarBackend, GrammarMatcher
from model_server.structured_output.params import StructuredOutputError, StructuredOutputsParams

# Compile threads per grammar (xgrammar parallelizes the per-token preprocessing).
_COMPILE_THREADS = 2


class XGrammarMatcher(GrammarMatcher):
    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def reset(self) -> None:
        self._matcher.reset()


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        import xgrammar

        self._xgr = xgrammar
        stop = [eos_token_id] if eos_token_id is not None else None
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop
        )
        # Our own cache (manager.py) keys compiled grammars; xgrammar's would hold them twice.
        self._compiler = xgrammar.GrammarCompiler(
            info, max_threads=_COMPILE_THREADS, cache_enabled=False
        )

    def compile(self, params: StructuredOutputsParams) -> Any:
        c = self._compiler
        try:
            if params.json is not None:
                # Compact JSON: a tiny model that may put whitespace anywhere would otherwise
                # loop on spaces and newlines until max_tokens.
                return c.compile_json_schema(
                    json.dumps(params.json), any_whitespace=False, strict_mode=True
                )
            if params.json_object:
                return c.compile_json_schema(
                    json.dumps({"type": "object"}), any_whitespace=False, strict_mode=False
                )
            if params.regex is not None:
                re.compile(params.regex)  # Python's message for a plainly broken pattern
                return c.compile_regex(params.regex)
            if params.choice is not None:
                return c.compile_regex("|".join(re.escape(choice) for choice in params.choice))
            assert params.grammar is not None
            return c.compile_grammar(params.grammar)
        except (re.error, RuntimeError, ValueError, TypeError) as exc:
            what = params.key[0].replace("_", " ")
            where = f"{params.param}: " if params.param else ""
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StructuredOutputError(
                f"{where}the {what} cannot be compiled: {message}", params.param
            ) from None

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))
