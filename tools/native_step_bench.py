"""A/B of the CPU's native decoder step against the model's modules, on one engine (one plan):
batch-1 greedy decode, the two paths alternating round by round.

    python -m tools.native_step_bench /tmp/bench-models/phi2 --dtype bfloat16
    python -m tools.native_step_bench FOLDER --threads 1 --rounds 6 --pin-panels

Each round runs, for each path, a one-token request (the prefill) and the same request to
--output-len + 1 tokens; the difference over --output-len is that path's decode ms per token.
The first round warms up and is not counted. Prints the machine's load average, the row counts
the native step takes, each path's median and fastest ms per token, their ratio, and whether
both generated the same tokens (they must: the step gives the modules' bits).

The step is switched on the runner (`ModelRunner.native_step`, the runner's fast path), as
tests/kernels/test_native_step_families.py does: there is no setting that turns it off alone.
--pin-panels plans every matmul on the native panels instead of timing the candidates: on a
busy machine the timings are not cached and may leave some row counts without a native kernel
(the step then declines them, and both paths run the modules).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from model_server.engine.llm import LLM
from model_server.sampling_params import SamplingParams


def _pin_panels() -> Callable[[], None]:
    """Every matmul's timing answers "the native panels" wherever they are offered, until the
    returned function restores the timer."""
    from model_server.kernels.cpu import linear_tuning

    own = linear_tuning.time_candidates

    def fake(calls: dict, pair_budget_s: float = 0.0) -> dict[str, float]:
        times = {}
        for name, call in calls.items():
            try:
                call()
            except Exception:  # a candidate that fails is dropped, as the real timer drops it
                continue
            times[name] = 1.0 if name == linear_tuning.PANELS else 2.0
        return times

    linear_tuning.time_candidates = fake

    def restore() -> None:
        linear_tuning.time_candidates = own

    return restore


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="An HF model folder.")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="Default: torch's.")
    parser.add_argument("--rounds", type=int, default=5, help="Counted rounds (after 1 warm-up).")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--pin-panels", action="store_true", help="See the module docstring.")
    args = parser.parse_args(argv)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    extra = {} if args.threads is None else {"num_threads": args.threads}
    restore = _pin_panels() if args.pin_panels else None
    try:
        llm = LLM(args.model, dtype=args.dtype, device="cpu", seed=0, **extra)
    finally:
        if restore is not None:
            restore()
    try:
        runner = llm.engine.core.model_runner
        step = runner.native_step
        if step is None:
            print(f"no native step: {runner.prepared.native_reason}")
            return 1
        print(f"native step: {step.row_coverage(64)}")
        prompt = [3 + i % 200 for i in range(args.prompt_len)]
        prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        decode = SamplingParams(max_tokens=args.output_len + 1, temperature=0.0, ignore_eos=True)
        times: dict[str, list[float]] = {"native": [], "modules": []}
        tokens: dict[str, list[int]] = {}
        for r in range(args.rounds + 1):
            order = ("native", "modules") if r % 2 == 0 else ("modules", "native")
            for name in order:
                runner.native_step = step if name == "native" else None
                t0 = time.perf_counter()
                llm.generate([prompt], prefill)
                t1 = time.perf_counter()
                out = llm.generate([prompt], decode)
                t2 = time.perf_counter()
                tokens[name] = list(out[0].outputs[0].token_ids)
                if r:
                    times[name].append(((t2 - t1) - (t1 - t0)) / args.output_len * 1e3)
        runner.native_step = step
    finally:
        llm.shutdown()
    for name, ts in times.items():
        runs = ", ".join(f"{t:.2f}" for t in ts)
        print(f"{name}: {statistics.median(ts):.2f} ms/token median, {min(ts):.2f} min ({runs})")
    ratio = statistics.median(times["modules"]) / statistics.median(times["native"])
    print(f"modules / native: {ratio:.2f}x (medians)")
    same = tokens["native"] == tokens["modules"]
    print(f"same tokens: {same}")
    return 0 if same else 2


if __name__ == "__main__":
    raise SystemExit(main())
