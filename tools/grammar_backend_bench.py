"""xgrammar against llguidance on this machine, with the embedded SmolLM2's tokenizer: the
one-time vocabulary preprocessing, the compile time of a few JSON schemas, and the per-step
bitmask fill time along a valid answer (the work the engine does per constrained row and step).

    python -m tools.grammar_backend_bench [--schemas N] [--repeats R]

Prints one line per engine and schema and a summary per engine (medians). Both packages must be
installed (`pip install xgrammar llguidance`); an engine that is missing is reported and skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from importlib import metadata
from typing import Any

import torch

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "person": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0, "maximum": 130},
            },
            "required": ["name", "age"],
        },
        {"name": "Ada Lovelace", "age": 36},
    ),
    "order": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "qty": {"type": "integer", "minimum": 1},
                            "price": {"type": "number", "minimum": 0},
                        },
                        "required": ["sku", "qty", "price"],
                    },
                },
                "status": {"enum": ["new", "paid", "shipped"]},
            },
            "required": ["id", "items", "status"],
        },
        {
            "id": "ABC-1234",
            "items": [
                {"sku": "x-1", "qty": 2, "price": 9.5},
                {"sku": "y-2", "qty": 1, "price": 120},
            ],
            "status": "paid",
        },
    ),
    "tool_call": (
        {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "name": {"enum": ["get_weather"]},
                            "parameters": {
                                "type": "object",
                                "properties": {
                                    "city": {"type": "string"},
                                    "unit": {"enum": ["celsius", "fahrenheit"]},
                                },
                                "required": ["city", "unit"],
                            },
                        },
                        "required": ["name", "parameters"],
                    },
                    {
                        "type": "object",
                        "properties": {
                            "name": {"enum": ["get_time"]},
                            "parameters": {
                                "type": "object",
                                "properties": {"tz": {"type": "string"}},
                                "required": ["tz"],
                            },
                        },
                        "required": ["name", "parameters"],
                    },
                ]
            },
        },
        [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}],
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "a": {
                    "type": "object",
                    "properties": {
                        "b": {
                            "type": "object",
                            "properties": {"c": {"type": "array", "items": {"type": "number"}}},
                            "required": ["c"],
                        }
                    },
                    "required": ["b"],
                }
            },
            "required": ["a"],
        },
        {"a": {"b": {"c": [1.5, 2, -3.25, 4e3]}}},
    ),
}


def _ms(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return 1000 * (time.perf_counter() - start), value


class _XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.version = metadata.version("xgrammar")
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=[tokenizer.eos_token_id]
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def walk(self, compiled: Any, tokens: list[int]) -> list[float]:
        matcher = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        times = []
        for t in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            times.append(1000 * (time.perf_counter() - start))
            if not matcher.accept_token(t):
                raise RuntimeError(f"xgrammar rejected token {t}")
        return times


class _LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.version = metadata.version("llguidance")
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema,
            defaults={"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "},
        )
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return grammar

    def walk(self, compiled: Any, tokens: list[int]) -> list[float]:
        matcher = self.llg.LLMatcher(self.tokenizer, compiled)
        bitmask = self.llg.torch.allocate_token_bitmask(1, self.vocab_size)
        times = []
        for t in tokens:
            start = time.perf_counter()
            self.llg.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(1000 * (time.perf_counter() - start))
            if not matcher.consume_token(t):
                raise RuntimeError(f"llguidance rejected token {t}: {matcher.get_error()}")
        return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="Walks per schema (median).")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from model_server.loader.embedded import embedded_model_path
    from model_server.loader.gguf_loader import load_gguf

    source = load_gguf(embedded_model_path(), dummy=True)
    tokenizer = source.tokenizer
    vocab_size = int(source.hf_config.vocab_size)
    for engine_class in (_XGrammar, _LLGuidance):
        try:
            setup_ms, engine = _ms(lambda cls=engine_class: cls(tokenizer, vocab_size))
        except ImportError as exc:
            print(f"{engine_class.name}: not installed ({exc})")
            continue
        print(f"{engine.name} {engine.version}: vocabulary preprocessing {setup_ms:.1f} ms")
        compiles, fills = [], []
        for name, (schema, answer) in SCHEMAS.items():
            compile_ms, compiled = _ms(lambda s=schema, e=engine: e.compile(s))
            text = json.dumps(answer)  # both engines write ", " and ": " by default
            tokens = [*tokenizer(text, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
            walks = [engine.walk(compiled, tokens) for _ in range(args.repeats)]
            per_step = statistics.median(statistics.mean(w) for w in walks)
            worst = statistics.median(max(w) for w in walks)
            compiles.append(compile_ms)
            fills.append(per_step)
            print(
                f"  {name:10s} compile {compile_ms:8.2f} ms; fill {per_step * 1000:7.1f} us/step "
                f"(worst step {worst * 1000:7.1f} us) over {len(tokens)} tokens"
            )
        print(
            f"  summary: compile median {statistics.median(compiles):.2f} ms, fill median "
            f"{statistics.median(fills) * 1000:.1f} us/step"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
