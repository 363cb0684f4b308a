"""`bench structured`: what grammar-constrained decoding costs per engine step.

For each batch size (default 1 and 32) the same decode workload runs twice through the real
engine: every request free, then every request constrained by a JSON schema that cannot finish
within `--output-len` tokens (so every step masks every row). The two parts of masking are timed
where they run: filling the bitmask (the grammar engine, on the host, per constrained row) and
applying it (the sampler, on the constrained rows only). Output lines:

    structured outputs: xgrammar 0.2.8; cpu float32; 32 output tokens, median of 2 runs
    compile: 4 schemas, first 512.3 ms (with the vocabulary's preprocessing), then 8.1 ms median
    batch 1, free:        step 14.81 ms; masking 0.000 ms (0.00% of the step)
    batch 1, constrained: step 15.02 ms; masking 0.061 ms (fill 0.031 + apply 0.030) = 0.41%
    batch 32, free: ...
    batch 32, constrained: ...

A free batch's masking is one pass over its requests (no grammar: no bitmask, nothing applied).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from model_server.config import EngineConfig
from model_server.sampling_params import SamplingParams
from model_server.structured_output.params import StructuredOutputsParams

# Never complete within a benchmark's output: every step masks.
LONG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 200,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0},
                    "label": {"enum": ["alpha", "beta", "gamma"]},
                    "note": {"type": "string", "maxLength": 12},
                },
                "required": ["id", "label", "note"],
            },
        }
    },
    "required": ["records"],
}
# Compiled once each for the compile figure.
COMPILE_SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 5},
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "number", "minimum": 0, "maximum": 1}},
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    LONG_SCHEMA,
]


def add_structured_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 32], help="Batch sizes to time."
    )
    parser.add_argument("--input-len", type=int, default=32, help="Prompt tokens per sequence.")
    parser.add_argument("--output-len", type=int, default=32, help="Decode steps timed per run.")
    parser.add_argument("--num-iters", type=int, default=2, help="Runs per case (median).")
    parser.add_argument("--workload-seed", type=int, default=0, help="Seed of the prompt ids.")


@dataclass(slots=True)
class _Timer:
    seconds: float = 0.0
    calls: int = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed


@dataclass(slots=True)
class CaseResult:
    step_ms: list[float] = field(default_factory=list)
    fill_ms: list[float] = field(default_factory=list)
    apply_ms: list[float] = field(default_factory=list)

    def line(self, label: str) -> str:
        step = statistics.median(self.step_ms)
        fill = statistics.median(self.fill_ms)
        apply = statistics.median(self.apply_ms)
        mask = fill + apply
        return (
            f"{label}: step {step:.2f} ms; masking {mask:.3f} ms (fill {fill:.3f} + apply "
            f"{apply:.3f}) = {100 * mask / step:.2f}% of the step"
        )


@contextmanager
def _timed_masking() -> Iterator[tuple[_Timer, _Timer]]:
    """Time the two masking calls where the engine makes them (the runner's bitmask fill and
    the sampler's apply), restoring both afterwards."""
    from model_server.engine.execution import model_runner
    from model_server.layers import sampler

    fill, apply = _Timer(), _Timer()
    orig_fill, orig_apply = model_runner.fill_grammar_bitmask, sampler.apply_grammar_bitmask
    model_runner.fill_grammar_bitmask = fill.wrap(orig_fill)
    sampler.apply_grammar_bitmask = apply.wrap(orig_apply)
    try:
        yield fill, apply
    finally:
        model_runner.fill_grammar_bitmask = orig_fill
        sampler.apply_grammar_bitmask = orig_apply


def _run_case(engine: Any, prompts: list[list[int]], params: SamplingParams) -> tuple[float, ...]:
    """(ms per decode step, ms filling and ms applying masks per decode step): the prefill
    step is run and excluded first."""
    ids = {f"bench-{time.monotonic_ns()}-{i}" for i in range(len(prompts))}
    for request_id, prompt in zip(sorted(ids), prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    started: set[str] = set()
    while started != ids:  # the prefills, up to each row's first token
        started |= {out.request_id for out in engine.step()}
    with _timed_masking() as (fill, apply):
        steps = 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        elapsed = time.perf_counter() - start
    steps = max(steps, 1)
    return 1000 * elapsed / steps, 1000 * fill.seconds / steps, 1000 * apply.seconds / steps


def run_structured_benchmark(args: argparse.Namespace, config: EngineConfig) -> int:
    from model_server.engine.llm_engine import LLMEngine

    if args.output_len < 2:
        raise ValueError("--output-len must be at least 2")
    max_batch = max(args.batch_sizes)
    if max_batch > config.max_num_seqs:
        raise ValueError(f"--batch-sizes up to {max_batch} need --max-num-seqs >= {max_batch}")
    engine = LLMEngine(config)
    manager = engine.structured_output
    compile_ms = []
    for schema in COMPILE_SCHEMAS:
        start = time.perf_counter()
        manager.compile(StructuredOutputsParams(json=schema))
        compile_ms.append(1000 * (time.perf_counter() - start))
    backend = manager.backend.name
    try:
        version = metadata.version(backend)
    except metadata.PackageNotFoundError:
        version = "?"
    runner = engine.core.model_runner
    print(
        f"structured outputs: {backend} {version}; {runner.device.type} "
        f"{str(runner.dtype).removeprefix('torch.')}; {args.output_len} output tokens, median "
        f"of {args.num_iters} runs"
    )
    rest = statistics.median(compile_ms[1:]) if len(compile_ms) > 1 else compile_ms[0]
    print(
        f"compile: {len(compile_ms)} schemas, first {compile_ms[0]:.1f} ms (with the "
        f"vocabulary's preprocessing), then {rest:.1f} ms median"
    )
    rng = random.Random(args.workload_seed)
    vocab = min(engine.vocab_size, 10_000)
    free = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=args.output_len,
        temperature=0,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA),
    )
    for batch in args.batch_sizes:
        for label, params in (("free", free), ("constrained", constrained)):
            result = CaseResult()
            for _ in range(args.num_iters):
                prompts = [
                    [rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(batch)
                ]
                step, fill, apply = _run_case(engine, prompts, params)
                result.step_ms.append(step)
                result.fill_ms.append(fill)
                result.apply_ms.append(apply)
            print(result.line(f"batch {batch}, {label}"), flush=True)
    engine.shutdown()
    return 0
