"""`bench throughput`: offline generation speed on a nano-vllm-style random workload.

N requests with random prompt token ids and random input/output lengths (fixed seed,
ignore_eos), all submitted at once; prints output tokens/s. With `--baseline transformers` the
same requests also run through HF transformers `generate` in padded batches in the same process
(on the engine's device, in its dtype, after the engine is released), and the last line is
`ratio: X.XXx` (Wick / transformers).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from model_server.benchmarks.hf_baseline import (
    BaselineTarget,
    HFGenerator,
    baseline_target,
    default_baseline_batch_size,
    free_device_memory,
)
from model_server.config import EngineConfig


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=32, help="Number of requests.")
    parser.add_argument("--min-input-len", type=int, default=32, help="Shortest prompt (tokens).")
    parser.add_argument("--max-input-len", type=int, default=256, help="Longest prompt (tokens).")
    parser.add_argument("--min-output-len", type=int, default=32, help="Shortest output.")
    parser.add_argument("--max-output-len", type=int, default=256, help="Longest output.")
    parser.add_argument(
        "--input-len",
        type=int,
        default=None,
        help="Every prompt this many tokens (vLLM's flag; sets --min/--max-input-len).",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="Every output this many tokens (vLLM's flag; sets --min/--max-output-len).",
    )
    parser.add_argument(
        "--demo",
        default=None,
        help="vLLM-GCU's demo prompt set: accepted and ignored (prompts are random token ids).",
    )
    parser.add_argument(
        "--workload",
        choices=["default", "nano-vllm"],
        default="default",
        help="nano-vllm: its bench's 256 requests with 100-1024 input and output tokens "
        "(overrides the length and count flags).",
    )
    parser.add_argument("--workload-seed", type=int, default=0, help="Seed of the workload.")
    parser.add_argument(
        "--baseline",
        choices=["none", "transformers"],
        default="none",
        help="Also run the workload through HF transformers generate and print the ratio.",
    )
    parser.add_argument(
        "--baseline-batch-size",
        type=int,
        default=None,
        help="Padded batch size of the transformers baseline; unset: 16 on CPU, 64 on CUDA (and "
        "other accelerators), which needs wide batches to be busy.",
    )


def _lengths(fixed: int | None, low: int, high: int) -> tuple[int, int]:
    """vLLM's fixed `--input-len`/`--output-len` where given, else the range."""
    if fixed is None:
        return low, high
    if fixed < 1:
        raise ValueError(f"--input-len and --output-len must be at least 1, got {fixed}")
    return fixed, fixed


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    if args.workload == "nano-vllm":
        num, lo_in, hi_in, lo_out, hi_out = 256, 100, 1024, 100, 1024
    else:
        num = args.num_prompts
        lo_in, hi_in = _lengths(args.input_len, args.min_input_len, args.max_input_len)
        lo_out, hi_out = _lengths(args.output_len, args.min_output_len, args.max_output_len)
    rng = random.Random(args.workload_seed)
    # Like nano-vllm's bench: token ids drawn from the low 10k of the vocabulary.
    top = min(10_000, vocab_size)
    prompts = [[rng.randrange(top) for _ in range(rng.randint(lo_in, hi_in))] for _ in range(num)]
    output_lens = [rng.randint(lo_out, hi_out) for _ in range(num)]
    return Workload(prompts, output_lens)


def build_llm(config: EngineConfig):
    from model_server.engine.llm import LLM

    return LLM.from_config(config)


def run_wick(llm, workload: Workload) -> float:
    from model_server.sampling_params import SamplingParams

    sync = llm.engine.core.model_runner.platform.synchronize
    # Warm up allocators and kernels outside the timed region.
    llm.generate([workload.prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens
    ]
    sync()
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params)
    sync()
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != workload.num_output_tokens:
        raise RuntimeError(
            f"wick produced {produced} tokens, expected {workload.num_output_tokens}"
        )
    return elapsed


def run_transformers(target: BaselineTarget, workload: Workload, batch_size: int) -> float:
    """The same requests through HF `generate` with left-padded batches of `batch_size`, on the
    engine's device in its dtype.

    Each batch runs until its longest requested output; only requested tokens are counted.
    """
    hf = HFGenerator(target)
    hf.generate([workload.prompts[0][:16]], 4)  # warm-up
    batches = [
        (workload.prompts[i : i + batch_size], max(workload.output_lens[i : i + batch_size]))
        for i in range(0, len(workload.prompts), batch_size)
    ]
    return hf.timed(batches)


def run_throughput_benchmark(args: argparse.Namespace, config: EngineConfig) -> int:
    llm = build_llm(config)
    workload = make_workload(args, llm.engine.core.model_runner.vocab_size)
    print(
        f"workload: {len(workload.prompts)} requests, {workload.num_input_tokens} input tokens, "
        f"{workload.num_output_tokens} output tokens",
        flush=True,
    )
    elapsed = run_wick(llm, workload)
    wick_tps = workload.num_output_tokens / elapsed
    total_tps = (workload.num_output_tokens + workload.num_input_tokens) / elapsed
    print(
        f"wick: {elapsed:.2f} s, {wick_tps:.1f} output tok/s, {total_tps:.1f} total tok/s",
        flush=True,
    )
    if args.baseline == "transformers":
        target = baseline_target(llm)
        batch_size = args.baseline_batch_size or default_baseline_batch_size(target.platform)
        llm.shutdown()
        del llm
        free_device_memory(target.platform)
        hf_elapsed = run_transformers(target, workload, batch_size)
        hf_tps = workload.num_output_tokens / hf_elapsed
        print(
            f"transformers (batch {batch_size}): {hf_elapsed:.2f} s, {hf_tps:.1f} output tok/s",
            flush=True,
        )
        print(f"ratio: {wick_tps / hf_tps:.2f}x", flush=True)
    return 0
