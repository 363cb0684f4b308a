"""`bench throughput`: offline generation speed on a nano-vllm-style random workload.

N requests with random prompt token ids and random input/output lengths (fixed seed,
ignore_eos), all submitted at once; prints output tokens/s. With `--baseline transformers` the
same requests also run through HF transformers `generate` in padded batches in the same process,
and the last line is `ratio: X.XXx` (Wick / transformers).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

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
        default=16,
        help="Padded batch size of the transformers baseline.",
    )


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    if args.workload == "nano-vllm":
        num, lo_in, hi_in, lo_out, hi_out = 256, 100, 1024, 100, 1024
    else:
        num = args.num_prompts
        lo_in, hi_in = args.min_input_len, args.max_input_len
        lo_out, hi_out = args.min_output_len, args.max_output_len
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

    # Warm up allocators and kernels outside the timed region.
    llm.generate([workload.prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens
    ]
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != workload.num_output_tokens:
        raise RuntimeError(
            f"wick produced {produced} tokens, expected {workload.num_output_tokens}"
        )
    return elapsed


def run_transformers(llm, workload: Workload, batch_size: int) -> float:
    """The same requests through HF `generate` with left-padded batches of `batch_size`.

    Each batch runs until its longest requested output; only requested tokens are counted.
    """
    import torch
    import transformers

    source = llm.engine.core.source
    runner = llm.engine.core.model_runner
    model = transformers.AutoModelForCausalLM.from_config(source.hf_config, dtype=runner.dtype)
    if source.weights is not None:
        state = dict(source.weights())
        missing, _ = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("lm_head.weight")]
        if missing:
            raise RuntimeError(f"transformers baseline is missing weights: {missing[:4]}")
        if getattr(source.hf_config, "tie_word_embeddings", False):
            model.tie_weights()
    model.eval()
    pad_id = 0

    def generate(batch: list[list[int]], max_new: int) -> None:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad_id,
        )

    with torch.inference_mode():
        generate([workload.prompts[0][:16]], 4)
        start = time.perf_counter()
        for i in range(0, len(workload.prompts), batch_size):
            generate(
                workload.prompts[i : i + batch_size], max(workload.output_lens[i : i + batch_size])
            )
        return time.perf_counter() - start


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
        hf_elapsed = run_transformers(llm, workload, args.baseline_batch_size)
        hf_tps = workload.num_output_tokens / hf_elapsed
        print(
            f"transformers (batch {args.baseline_batch_size}): {hf_elapsed:.2f} s, "
            f"{hf_tps:.1f} output tok/s",
            flush=True,
        )
        print(f"ratio: {wick_tps / hf_tps:.2f}x", flush=True)
    return 0
