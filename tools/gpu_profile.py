"""Where a CUDA decode step's time goes: kernel time per step against the step's wall time.

Builds the engine on dummy weights, generates once to warm up, then profiles one batch's decode
with torch.profiler and prints, per decode step, the GPU kernel time (sum of kernel durations),
the wall time, the share of the wall the GPU was busy (what launch gaps and host work leave), and
the kernels that take the most time. Run with and without `--enforce-eager` to see what CUDA
graphs recover; a busy share near 100 % with a slow step means the kernels themselves are slow.

Usage: python -m tools.gpu_profile --model llama-3.1-8b [--batch-size 1] [--enforce-eager]
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--device", default="cuda", help="cpu: checks the tool without a GPU")
    args = parser.parse_args(argv)

    from model_server.config import EngineConfig
    from model_server.engine.llm import LLM
    from model_server.sampling_params import SamplingParams

    config = EngineConfig(
        model=args.model,
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.input_len + args.output_len + 16,
        enforce_eager=args.enforce_eager,
    )
    llm = LLM.from_config(config)
    prompts = [
        [(7 * i + j) % 1000 + 10 for j in range(args.input_len)] for i in range(args.batch_size)
    ]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up: compiles, captures graphs
    sync = llm.engine.core.model_runner.platform.synchronize
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params)
        sync()
        wall = time.perf_counter() - start
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_us = sum(e.device_time for e in events)
    steps = args.output_len  # one prefill + output_len - 1 decode steps
    mode = "eager" if args.enforce_eager else "graphs"
    print(
        f"profile: {args.model} {args.dtype} batch {args.batch_size} ({mode}): {steps} steps in "
        f"{wall * 1e3:.1f} ms wall ({wall * 1e3 / steps:.3f} ms/step); GPU kernels "
        f"{kernel_us / 1e3:.1f} ms ({kernel_us / 1e3 / steps:.3f} ms/step), busy "
        f"{100 * kernel_us / 1e6 / wall:.1f} % of the wall; {len(events)} kernels "
        f"({len(events) / steps:.0f} per step)",
        flush=True,
    )
    totals: dict[str, list[float]] = {}
    for e in events:
        entry = totals.setdefault(e.name, [0.0, 0])
        entry[0] += e.device_time
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[: args.top]
    for name, (us, count) in ranked:
        share = 100 * us / kernel_us if kernel_us else 0.0
        print(f"  {share:5.1f} %  {us / 1e3:8.2f} ms  x{count:<6d} {name[:110]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
