"""The summary table of `scripts/bench_gpu.sh`: the figures in its step logs next to issue #6's
references.

References: nano-vllm's bench (RTX 4070 Laptop, Qwen3-0.6B, 256 requests with random input and
output lengths 100-1024) gives vLLM 1362 tok/s and nano-vllm 1434 tok/s, a ratio of 1.053; on an
H100, Llama-3.1-8B in bf16 at batch 1 is bounded by memory bandwidth at about 200 tok/s. Goals:
at least nano-vllm's ratio over the baseline (here HF transformers: vLLM is not installed), and
at least 85% of the bandwidth bound at batch 1.

    python -m model_server.benchmarks.gpu_summary bench_results/gpu
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

NANO_VLLM_TPS = 1434.0
VLLM_TPS = 1362.0
RATIO_GOAL = NANO_VLLM_TPS / VLLM_TPS
BOUND_REFERENCE_TPS = 200.0
BOUND_GOAL_PCT = 85.0

# Step logs written by scripts/bench_gpu.sh, by step name.
STEP_LOGS = {
    "tests": "tests.log",
    "throughput": "throughput.log",
    "latency": "latency.log",
    "eager": "eager.log",
    "int8": "int8.log",
}

_NUM = r"([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)"


@dataclass(slots=True)
class ThroughputFigures:
    wick_tps: float
    hf_tps: float | None = None
    hf_batch: int | None = None
    ratio: float | None = None


@dataclass(slots=True)
class LatencyFigures:
    device: str
    batch_size: int
    decode_tps: float  # the batch's output tok/s
    prefill_ms: float
    copy_pct: float
    copy_bound_tps: float
    spec_pct: float | None = None
    spec_bound_tps: float | None = None
    spec_gbs: float | None = None
    read_pct: float | None = None  # absent from outputs older than the measured read
    read_bound_tps: float | None = None
    hf_decode_tps: float | None = None
    decode_ratio: float | None = None


def _search(pattern: str, text: str) -> re.Match[str] | None:
    return re.search(pattern, text, re.MULTILINE)


def parse_throughput(text: str) -> ThroughputFigures | None:
    """The figures of a `bench throughput` output, None when it has no `wick:` line."""
    wick = _search(rf"^wick: {_NUM} s, {_NUM} output tok/s", text)
    if wick is None:
        return None
    figures = ThroughputFigures(float(wick[2]))
    hf = _search(rf"^transformers \(batch (\d+)\): {_NUM} s, {_NUM} output tok/s", text)
    if hf is not None:
        figures.hf_batch, figures.hf_tps = int(hf[1]), float(hf[3])
    ratio = _search(rf"^ratio: {_NUM}x", text)
    if ratio is not None:
        figures.ratio = float(ratio[1])
    return figures


def parse_latency(text: str) -> LatencyFigures | None:
    """The figures of a `bench latency` output, None when it has no `decode:` bound line."""
    bound = _search(
        rf"^decode: {_NUM} tok/s at batch (\d+) = "
        rf"(?:{_NUM}% of the {_NUM} tok/s bound \({_NUM} GB/s \w+, [^)]*\); )?"
        rf"{_NUM}% of the {_NUM} tok/s measured-copy bound",
        text,
    )
    prefill = _search(rf"^wick prefill: {_NUM} ms", text)
    if bound is None or prefill is None:
        return None
    device = _search(r"^device: (.*)$", text)
    figures = LatencyFigures(
        device=device[1] if device else "?",
        batch_size=int(bound[2]),
        decode_tps=float(bound[1]),
        prefill_ms=float(prefill[1]),
        copy_pct=float(bound[6]),
        copy_bound_tps=float(bound[7]),
    )
    if bound[3] is not None:
        figures.spec_pct, figures.spec_bound_tps = float(bound[3]), float(bound[4])
        figures.spec_gbs = float(bound[5])
    read = _search(rf"^decode: .*; {_NUM}% of the {_NUM} tok/s measured-read bound", text)
    if read is not None:
        figures.read_pct, figures.read_bound_tps = float(read[1]), float(read[2])
    hf = _search(rf"^transformers decode: {_NUM} ms/token, {_NUM} tok/s per sequence", text)
    if hf is not None:
        figures.hf_decode_tps = float(hf[2]) * figures.batch_size
    ratio = _search(rf"^ratio: decode {_NUM}x", text)
    if ratio is not None:
        figures.decode_ratio = float(ratio[1])
    return figures


def parse_tests(text: str) -> str | None:
    """pytest's final line without its `=` padding (`12 passed, 1 skipped in 4.2s`)."""
    lines = [
        line.strip("= ").strip()
        for line in text.splitlines()
        if re.search(r"\b(passed|failed|error|errors|deselected|skipped|no tests ran)\b", line)
        and re.search(r"\bin [\d.]+s\b", line)
    ]
    return lines[-1] if lines else None


def _goal(value: float | None, goal: float) -> str:
    if value is None:
        return "n/a"
    return "met" if value >= goal else "NOT met"


def _num(value: float | None, fmt: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def format_summary(
    tests: str | None,
    throughput: ThroughputFigures | None,
    latency: LatencyFigures | None,
    eager: LatencyFigures | None,
    int8: LatencyFigures | None = None,
) -> str:
    rows: list[tuple[str, str, str]] = []
    if throughput is not None:
        rows += [
            ("throughput: nano-vllm workload, Qwen3-0.6B", "", ""),
            (
                "  wick output tok/s",
                _num(throughput.wick_tps),
                f"nano-vllm {NANO_VLLM_TPS:.0f}, vLLM {VLLM_TPS:.0f} (RTX 4070 Laptop)",
            ),
            (
                f"  transformers output tok/s (batch {throughput.hf_batch or '-'})",
                _num(throughput.hf_tps),
                "",
            ),
            (
                "  wick / transformers",
                _num(throughput.ratio, ".2f", "x"),
                f"nano-vllm / vLLM {RATIO_GOAL:.3f}x: goal {_goal(throughput.ratio, RATIO_GOAL)}",
            ),
        ]
    for label, figures in (("CUDA graphs", latency), ("eager", eager), ("int8 weights", int8)):
        if figures is None:
            continue
        rows += [
            (f"latency: Llama-3.1-8B, batch {figures.batch_size}, {label}", "", ""),
            ("  wick prefill ms", _num(figures.prefill_ms, ".2f"), ""),
            (
                "  wick decode tok/s",
                _num(figures.decode_tps),
                f"~{BOUND_REFERENCE_TPS:.0f} tok/s bandwidth bound (H100, bf16)",
            ),
            (
                "  % of the spec bandwidth bound",
                f"{_num(figures.spec_pct, '.1f', '%')} of {_num(figures.spec_bound_tps)}",
                f"goal >= {BOUND_GOAL_PCT:.0f}%: {_goal(figures.spec_pct, BOUND_GOAL_PCT)}",
            ),
            (
                "  % of the measured-copy bound",
                f"{figures.copy_pct:.1f}% of {figures.copy_bound_tps:.1f}",
                "",
            ),
            (
                "  % of the measured-read bound",
                f"{_num(figures.read_pct, '.1f', '%')} of {_num(figures.read_bound_tps)}",
                "",
            ),
        ]
        if figures.hf_decode_tps is not None:
            rows += [
                ("  transformers decode tok/s", _num(figures.hf_decode_tps), ""),
                ("  wick / transformers decode", _num(figures.decode_ratio, ".2f", "x"), ""),
            ]
    device = next((f.device for f in (latency, eager) if f is not None), None)
    out = [f"== bench_gpu summary{f': {device}' if device else ''} =="]
    out.append(f"gpu tests: {tests or 'not run'}")
    if rows:
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len("this run"), *(len(r[1]) for r in rows))
        out.append(f"{'figure':<{w0}}  {'this run':>{w1}}  reference / goal")
        out += [f"{a:<{w0}}  {b:>{w1}}  {c}".rstrip() for a, b, c in rows]
    if throughput is not None:
        out.append(
            "(the throughput baseline is HF transformers in the same run, not vLLM: compare the "
            "ratios, not the tok/s of different GPUs)"
        )
    return "\n".join(out)


def summarize(log_dir: Path) -> str:
    def read(step: str) -> str:
        path = log_dir / STEP_LOGS[step]
        return path.read_text(errors="replace") if path.is_file() else ""

    tests_log = read("tests")
    tests = parse_tests(tests_log)
    if tests is None and tests_log:
        tests = f"no pytest summary line (see {log_dir / STEP_LOGS['tests']})"
    return format_summary(
        tests,
        parse_throughput(read("throughput")),
        parse_latency(read("latency")),
        parse_latency(read("eager")),
        parse_latency(read("int8")),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m model_server.benchmarks.gpu_summary",
        description="Summarize the step logs of scripts/bench_gpu.sh.",
    )
    parser.add_argument("log_dir", type=Path, help="The folder holding the step logs.")
    args = parser.parse_args(argv)
    sys.stdout.write(summarize(args.log_dir) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
