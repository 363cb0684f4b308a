"""`bench latency`: the latency of one batch, like vLLM's benchmark_latency, and how close its
decode steps get to the device's memory-bandwidth bound.

Each iteration generates, for `--batch-size` random prompts of `--input-len` token ids (fresh
prompts every run, so the prefix cache never helps), once with max_tokens=1 (the prefill) and once
with max_tokens=`--output-len` (greedy, ignore_eos). A decode step then takes
(full - prefill) / (output_len - 1); figures are medians over `--num-iters` iterations after
`--num-iters-warmup` unrecorded ones. Output lines:

    latency: batch 1, input 128, output 256, median of 3 iterations after 1 warmup
    device: cuda (NVIDIA H100 80GB HBM3), bfloat16
    wick prefill: <ms> ms (<tok/s> prompt tok/s)
    wick decode: <ms> ms/token, <tok/s> tok/s per sequence, <tok/s> tok/s at batch 1 (full run ...)
    step bytes: 15.04 GB per decode step (weights 15.01 GB + KV cache 0.03355 GB at mean ...)
    bandwidth: spec 3350 GB/s, measured copy <GB/s> GB/s, measured read <GB/s> GB/s (<method>)
    decode: <tok/s> tok/s at batch 1 = <pct>% of the 222.7 tok/s bound (3350 GB/s spec, 15.04 GB
        per step); <pct>% of the <tok/s> tok/s measured-copy bound (<GB/s> GB/s copy); <pct>% of
        the <tok/s> tok/s measured-read bound (<GB/s> GB/s read)

The copy counts bytes read plus bytes written; the read (benchmarks/bandwidth.py's
measure_read_bandwidth: on CPUs the native read kernel on the engine's threads, several streams
each; best of its trials, like the copy) is the roof of a step that reads its weights and writes
next to nothing, so the read-bound percentage is the one to hold against a goal.

and on CPUs the compute bound (benchmarks/compute.py), the faster of torch.mm and oneDNN with a
prepacked weight on the model's linear shapes at the batch's row count in the run's dtype:

    compute: best GEMM bfloat16 at 16 rows on the model's shapes <GFLOP/s> GFLOP/s; decode step
        <GFLOP> GFLOP at <GFLOP/s> GFLOP/s = <pct>% of it (<tok/s> tok/s compute bound)

and with `--baseline transformers` the same batch through HF `generate` (`transformers prefill`,
`transformers decode`, then `ratio: decode X.XXx, prefill Y.YYx (wick / transformers)`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from model_server.benchmarks.bandwidth import (
    GB,
    StepBytes,
    bound_tokens_per_s,
    decode_step_bytes,
    measure_copy_bandwidth,
    measure_read_bandwidth,
    peak_bandwidth_gbs,
)
from model_server.benchmarks.compute import (
    format_compute_bound,
    measure_gemm_rate,
)
from model_server.benchmarks.hf_baseline import (
    BaselineTarget,
    HFGenerator,
    baseline_target,
    free_device_memory,
)
from model_server.config import EngineConfig

# A run: (prompts, max_tokens) -> seconds, device work included.
TimedRun = Callable[[list[list[int]], int], float]


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=1, help="Sequences in the batch.")
    parser.add_argument("--input-len", type=int, default=128, help="Prompt tokens per sequence.")
    parser.add_argument(
        "--output-len", type=int, default=256, help="Generated tokens per sequence (at least 2)."
    )
    parser.add_argument("--num-iters", type=int, default=3, help="Measured iterations.")
    parser.add_argument(
        "--num-iters-warmup", type=int, default=1, help="Unmeasured iterations first."
    )
    parser.add_argument("--workload-seed", type=int, default=0, help="Seed of the prompt ids.")
    parser.add_argument(
        "--peak-bandwidth-gbs",
        type=float,
        default=None,
        help="The device's peak memory bandwidth in GB/s for the bound; unset: a table of NVIDIA "
        "GPUs by name on CUDA (H100, H200, A100, L40S, L4, RTX 4090/4070), none elsewhere. The "
        "bounds from a measured device copy and a measured read are printed either way.",
    )
    parser.add_argument(
        "--baseline",
        choices=["none", "transformers"],
        default="none",
        help="Also run the batch through HF transformers generate (same device and dtype) and "
        "print the ratio.",
    )


@dataclass(slots=True)
class LatencyResult:
    """Seconds per iteration: `prefill[i]` (max_tokens=1) and `full[i]` (max_tokens=output_len)."""

    prefill: list[float]
    full: list[float]
    output_len: int

    @property
    def prefill_s(self) -> float:
        return statistics.median(self.prefill)

    @property
    def full_s(self) -> float:
        return statistics.median(self.full)

    @property
    def decode_s_per_token(self) -> float:
        """Median over iterations of one decode step's time (the whole batch advances a token)."""
        steps = self.output_len - 1
        pairs = zip(self.full, self.prefill, strict=True)
        return statistics.median((full - prefill) / steps for full, prefill in pairs)


class PromptSource:
    """Seeded random prompts; each call draws new ones. Like `bench throughput`, token ids come
    from the low 10k of the vocabulary."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        self.rng = random.Random(seed)
        self.top = min(10_000, vocab_size)

    def draw(self, batch_size: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(self.top) for _ in range(length)] for _ in range(batch_size)]


def check_latency_args(args: argparse.Namespace) -> None:
    if args.batch_size < 1 or args.input_len < 1:
        raise ValueError("--batch-size and --input-len must be at least 1")
    if args.output_len < 2:
        raise ValueError(f"--output-len must be at least 2 (a decode step), got {args.output_len}")
    if args.num_iters < 1 or args.num_iters_warmup < 0:
        raise ValueError("--num-iters must be at least 1 and --num-iters-warmup at least 0")
    if args.peak_bandwidth_gbs is not None and args.peak_bandwidth_gbs <= 0:
        raise ValueError("--peak-bandwidth-gbs must be positive")


def measure_latency(
    run: TimedRun, prompts: PromptSource, args: argparse.Namespace
) -> LatencyResult:
    """Warmup iterations, then `num_iters` measured (prefill, full) pairs."""
    result = LatencyResult([], [], args.output_len)
    for i in range(args.num_iters_warmup + args.num_iters):
        prefill = run(prompts.draw(args.batch_size, args.input_len), 1)
        full = run(prompts.draw(args.batch_size, args.input_len), args.output_len)
        if i >= args.num_iters_warmup:
            result.prefill.append(prefill)
            result.full.append(full)
    return result


def wick_run(llm) -> TimedRun:
    from model_server.sampling_params import SamplingParams

    sync = llm.engine.core.model_runner.platform.synchronize

    def run(batch: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        sync()
        start = time.perf_counter()
        outputs = llm.generate(batch, params)
        sync()
        elapsed = time.perf_counter() - start
        lengths = {len(o.outputs[0].token_ids) for o in outputs}
        if len(outputs) != len(batch) or lengths != {max_tokens}:
            raise RuntimeError(f"wick produced {sorted(lengths)} tokens, expected {max_tokens}")
        return elapsed

    return run


def hf_run(hf: HFGenerator) -> TimedRun:
    return lambda batch, max_tokens: hf.timed([(batch, max_tokens)])


def format_figures(name: str, result: LatencyResult, batch_size: int, input_len: int) -> str:
    prefill = result.prefill_s
    step = result.decode_s_per_token
    return (
        f"{name} prefill: {prefill * 1e3:.2f} ms ({batch_size * input_len / prefill:.1f} prompt "
        f"tok/s)\n"
        f"{name} decode: {step * 1e3:.3f} ms/token, {1 / step:.1f} tok/s per sequence, "
        f"{batch_size / step:.1f} tok/s at batch {batch_size} (full run {result.full_s:.3f} s)"
    )


def format_bound(
    achieved: float,
    batch_size: int,
    step: StepBytes,
    peak_gbs: float | None,
    peak_label: str,
    copy_bytes_per_s: float,
    read_bytes_per_s: float,
) -> str:
    """The `decode:` line: the achieved batch tok/s against the bound at each bandwidth (the
    spec's when known, the measured copy's, then the measured read's)."""
    copy_bound = bound_tokens_per_s(copy_bytes_per_s, step, batch_size)
    read_bound = bound_tokens_per_s(read_bytes_per_s, step, batch_size)
    copy_gbs = f"{copy_bytes_per_s / GB:.4g} GB/s copy"
    per_step = f"{step.total / GB:.4g} GB per step"
    head = f"decode: {achieved:.1f} tok/s at batch {batch_size} = "
    copy_part = (
        f"{100 * achieved / copy_bound:.1f}% of the {copy_bound:.1f} tok/s measured-copy bound"
    )
    read_part = (
        f"{100 * achieved / read_bound:.1f}% of the {read_bound:.1f} tok/s measured-read bound "
        f"({read_bytes_per_s / GB:.4g} GB/s read)"
    )
    if peak_gbs is None:
        return f"{head}{copy_part} ({copy_gbs}, {per_step}); {read_part}; no spec bandwidth"
    spec_bound = bound_tokens_per_s(peak_gbs * GB, step, batch_size)
    return (
        f"{head}{100 * achieved / spec_bound:.1f}% of the {spec_bound:.1f} tok/s bound "
        f"({peak_gbs:g} GB/s {peak_label}, {per_step}); {copy_part} ({copy_gbs}); {read_part}"
    )


def report_bound(
    args: argparse.Namespace,
    target: BaselineTarget,
    name: str | None,
    step: StepBytes,
    achieved: float,
) -> None:
    """Print the bandwidths (spec, a measured copy and a measured read) and the `decode:` line.
    Needs the engine's memory released: the copy takes 2 GiB on a GPU."""
    peak_gbs, peak_label = args.peak_bandwidth_gbs, "given"
    if peak_gbs is None:
        peak_gbs, peak_label = peak_bandwidth_gbs(name), "spec"
    copy_bw = measure_copy_bandwidth(
        target.device,
        target.platform.synchronize,
        host_memory=target.platform.shares_host_memory,
    )
    read_bw = measure_read_bandwidth(
        target.device,
        target.platform.synchronize,
        host_memory=target.platform.shares_host_memory,
    )
    if peak_gbs is not None:
        spec_text = f"{peak_label} {peak_gbs:g} GB/s"
    else:
        spec_text = f"spec unknown for {name or target.device.type!r} (pass --peak-bandwidth-gbs)"
    print(
        f"bandwidth: {spec_text}, measured copy {copy_bw / GB:.1f} GB/s, measured read "
        f"{read_bw.bytes_per_s / GB:.1f} GB/s ({read_bw.method})",
        flush=True,
    )
    line = format_bound(
        achieved, args.batch_size, step, peak_gbs, peak_label, copy_bw, read_bw.bytes_per_s
    )
    print(line, flush=True)


def run_latency_benchmark(args: argparse.Namespace, config: EngineConfig) -> int:
    from model_server.benchmarks.throughput import build_llm

    check_latency_args(args)
    if args.batch_size > config.max_num_seqs:
        raise ValueError(
            f"--batch-size {args.batch_size} exceeds --max-num-seqs {config.max_num_seqs}: the "
            "batch would not run as one"
        )
    llm = build_llm(config)
    runner = llm.engine.core.model_runner
    prompts = PromptSource(args.workload_seed, runner.vocab_size)
    name = runner.platform.device_name()
    print(
        f"latency: batch {args.batch_size}, input {args.input_len}, output {args.output_len}, "
        f"median of {args.num_iters} iterations after {args.num_iters_warmup} warmup",
        flush=True,
    )
    dtype = str(runner.dtype).removeprefix("torch.")
    print(f"device: {runner.device.type}{f' ({name})' if name else ''}, {dtype}", flush=True)
    wick = measure_latency(wick_run(llm), prompts, args)
    print(format_figures("wick", wick, args.batch_size, args.input_len), flush=True)

    step = decode_step_bytes(
        runner.model,
        args.batch_size,
        args.input_len,
        args.output_len,
        runner.bytes_per_block() // runner.block_size,
    )
    print(
        f"step bytes: {step.total / GB:.4g} GB per decode step (weights {step.weights / GB:.4g} "
        f"GB + KV cache {step.kv_cache / GB:.4g} GB at mean context {step.mean_context:g})",
        flush=True,
    )
    # The matmul shapes of the step (every linear layer and the LM head), for the compute bound.
    from model_server.engine.execution.model_preparation import model_linear_shapes

    shapes = {(n, k): count for n, k, count in model_linear_shapes(runner.model, experts=False)}
    run_dtype = runner.dtype
    target = baseline_target(llm)
    # Release the engine first: the copy buffers and the baseline need the memory it holds.
    del runner
    llm.shutdown()
    del llm
    free_device_memory(target.platform)

    achieved = args.batch_size / wick.decode_s_per_token
    report_bound(args, target, name, step, achieved)
    free_device_memory(target.platform)
    if target.platform.shares_host_memory and shapes:  # the host CPU computes
        rate = measure_gemm_rate(shapes, args.batch_size, run_dtype)
        print(format_compute_bound(achieved, args.batch_size, rate, dtype), flush=True)

    if args.baseline == "transformers":
        hf = measure_latency(hf_run(HFGenerator(target)), prompts, args)
        print(format_figures("transformers", hf, args.batch_size, args.input_len), flush=True)
        print(
            f"ratio: decode {hf.decode_s_per_token / wick.decode_s_per_token:.2f}x, prefill "
            f"{hf.prefill_s / wick.prefill_s:.2f}x (wick / transformers)",
            flush=True,
        )
    return 0
