"""The first-run check of a bare GPU machine in one call (driven by scripts/gpu_check.sh).

Stages, each step a subprocess under its own timeout, with its status and time recorded:
  A  machine facts: device, clocks, measured copy GB/s, bf16 GEMM TFLOP/s (tools/gpu_facts.py)
  B  the compiled kernel tests against their torch references (`pytest -m gpu`, JUnit XML)
  C  end-to-end parity on a random-weight Qwen3-0.6B written by transformers in the run: HF vs
     Wick eager vs Wick with CUDA graphs (tools/gpu_parity.py)
  E  Llama-3.1-8B shape, dummy weights: batch-1 decode as a share of the HBM bound, then where
     its step's time goes (tools/gpu_profile.py: kernel time against the wall, top kernels)
  D  `bench latency` of the 0.6B shape at batch 1 and 64, graphs on and off, and offline
     throughput on nano-vllm's workload shape (64 requests) against HF in the same run
E (two steps) runs before D: its bound and profile, then D's five fill whatever time is left.

Budget guard: no step starts after `--budget-s` (420 s), and a step's timeout is cut so that it
ends by `--deadline-s` (560 s): one 10-minute device call holds the whole run. Results go to
`--out` as at most MAX_OUT_FILES files: summary.json (facts, every step's status, seconds and
parsed figures, the goals), run.log (every step's output) and junit_kernels.xml.

`--dry-run` (a CPU, in the test suite) checks the plan (every step's command parses, the output
files fit the limit), the carried wheels (`--wheel-dir`: one cp312 manylinux x86_64 or pure
wheel per project, the needed projects present, pip installs them for Python 3.12) and runs
stages A-C small under TRITON_INTERPRET=1 (stage C with the CPU stand-in for graphs); D and E
are planned, not run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tools.gpu_wheels import check_wheels

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 420.0
DEADLINE_S = 560.0
MAX_OUT_FILES = 8
GOALS = {
    "fp32 greedy tokens identical to HF (eager and graphs)": "parity",
    "8B batch-1 decode >= 85% of the HBM bound": "hbm",
    "CUDA graphs >= 1.5x eager at batch 1 (0.6B)": "graphs",
}


@dataclass(frozen=True, slots=True)
class Step:
    key: str  # stage letter and index: "A", "D3"
    name: str
    argv: tuple[str, ...]
    timeout_s: float
    run: bool = True  # False: planned only (the dry run's D and E)
    parse: str | None = None  # "latency" | "throughput": figures parsed from the output
    result: str | None = None  # JSON file name (in the work folder) the step writes


@dataclass(slots=True)
class StepRecord:
    key: str
    name: str
    command: str
    status: str = "pending"  # running | passed | failed | timeout | skipped (budget) | planned
    seconds: float = 0.0
    returncode: int | None = None
    result: dict[str, Any] | None = None


@dataclass(slots=True)
class Summary:
    dry_run: bool
    started_utc: str
    budget_s: float
    deadline_s: float
    git: str | None = None
    wheels: dict[str, Any] = field(default_factory=dict)
    plan_problems: list[str] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    goals: dict[str, bool | None] = field(default_factory=dict)
    elapsed_s: float = 0.0
    passed: bool = False


def plan(
    py: str, out: Path, work: Path, dry_run: bool, other_gpu_tests: Sequence[str]
) -> list[Step]:
    """The steps in run order (A, B, C, E, D); small CPU variants of A-C when `dry_run`."""
    device = "cpu" if dry_run else "cuda"
    junit = f"--junitxml={out / 'junit_kernels.xml'}"
    if dry_run:
        # The interpreter runs ~1 ms per program: a few kernels stand for the rest.
        tests: tuple[str, ...] = (
            "tests/kernels/test_store_kv.py",
            "tests/kernels/test_mla_decode.py",
            "tests/kernels/test_triton_compat.py",
        )
    else:
        tests = ("-m", "gpu", "tests/kernels", *other_gpu_tests, *_xdist_args(py))
    parity = ("--shape", "tiny-qwen3", "--max-tokens", "8", "--num-prompts", "3")
    parity += ("--stand-in-graphs",) if dry_run else ()
    bench = (py, "-m", "model_server", "bench")
    small = ("--model", "qwen3-0.6b", "--load-format", "dummy", "--device", "cuda")
    small += ("--dtype", "bfloat16", "--input-len", "128", "--output-len", "128")
    small += ("--num-iters", "2", "--max-model-len", "1024")
    steps = [
        Step(
            "A",
            "machine facts",
            (py, "-m", "tools.gpu_facts", "--device", device, "--result", str(work / "facts.json")),
            90,
            result="facts.json",
        ),
        Step(
            "B",
            "compiled kernel tests",
            (py, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider", junit),
            240,
        ),
        Step(
            "C",
            "end-to-end parity",
            (
                py,
                "-m",
                "tools.gpu_parity",
                "--device",
                device,
                *(parity if dry_run else ("--shape", "qwen3-0.6b")),
                "--result",
                str(work / "parity.json"),
            ),
            180,
            result="parity.json",
        ),
        Step(
            "E",
            "Llama-3.1-8B batch-1 decode vs the HBM bound",
            (
                *bench,
                "latency",
                "--model",
                "llama-3.1-8b",
                "--load-format",
                "dummy",
                "--device",
                "cuda",
                "--dtype",
                "bfloat16",
                "--batch-size",
                "1",
                "--output-len",
                "128",
                "--num-iters",
                "2",
                "--max-model-len",
                "1024",
            ),
            150,
            run=not dry_run,
            parse="latency",
        ),
        Step(
            "E2",
            "Llama-3.1-8B batch-1 decode profile (kernel time vs wall)",
            (py, "-m", "tools.gpu_profile", "--model", "llama-3.1-8b", "--device", device),
            60,
            run=not dry_run,
        ),
        Step(
            "D1",
            "latency 0.6B batch 1, graphs",
            (*bench, "latency", *small, "--batch-size", "1"),
            90,
            run=not dry_run,
            parse="latency",
        ),
        Step(
            "D2",
            "latency 0.6B batch 1, eager",
            (*bench, "latency", *small, "--batch-size", "1", "--enforce-eager"),
            90,
            run=not dry_run,
            parse="latency",
        ),
        Step(
            "D3",
            "throughput 0.6B, nano-vllm shape x64, vs HF",
            (
                *bench,
                "throughput",
                "--model",
                "qwen3-0.6b",
                "--load-format",
                "dummy",
                "--device",
                "cuda",
                "--dtype",
                "bfloat16",
                "--num-prompts",
                "64",
                "--min-input-len",
                "100",
                "--max-input-len",
                "1024",
                "--min-output-len",
                "100",
                "--max-output-len",
                "1024",
                "--baseline",
                "transformers",
            ),
            180,
            run=not dry_run,
            parse="throughput",
        ),
        Step(
            "D4",
            "latency 0.6B batch 64, graphs",
            (*bench, "latency", *small, "--batch-size", "64"),
            90,
            run=not dry_run,
            parse="latency",
        ),
        Step(
            "D5",
            "latency 0.6B batch 64, eager",
            (*bench, "latency", *small, "--batch-size", "64", "--enforce-eager"),
            90,
            run=not dry_run,
            parse="latency",
        ),
    ]
    return steps


def _xdist_args(py: str) -> tuple[str, ...]:
    """`-n 4` where pytest-xdist is installed: four processes compile kernels in parallel."""
    probe = subprocess.run([py, "-c", "import xdist"], capture_output=True)
    return ("-n", "4") if probe.returncode == 0 else ()


def check_plan(steps: Sequence[Step], out_files: int) -> list[str]:
    """Problems of the plan: a bench command its parser rejects, a missing module, too many
    output files, a stage letter missing."""
    from model_server.entrypoints.cli import build_parser

    problems = []
    if out_files > MAX_OUT_FILES:
        problems.append(f"{out_files} output files; a call brings back {MAX_OUT_FILES}")
    if {s.key[0] for s in steps} != set("ABCDE"):
        problems.append(f"stages {sorted({s.key[0] for s in steps})}: A-E expected")
    for step in steps:
        argv = list(step.argv)
        module = argv[argv.index("-m") + 1]
        if module == "model_server":
            try:
                build_parser("bench").parse_args(argv[argv.index("-m") + 2 :])
            except SystemExit:
                problems.append(f"{step.key}: the bench parser rejects {' '.join(argv[3:])}")
        elif (
            module != "pytest" and not (ROOT / Path(*module.split("."))).with_suffix(".py").exists()
        ):
            problems.append(f"{step.key}: no module {module}")
    return problems


def run_step(step: Step, timeout_s: float, log: TextIO, env: dict[str, str]) -> StepRecord:
    """Runs `step` in its own process group (killed whole at the timeout), its output copied
    line by line to `log` and stdout."""
    record = StepRecord(step.key, step.name, " ".join(step.argv))
    start = time.monotonic()
    proc = subprocess.Popen(
        step.argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            _emit(log, line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        record.returncode = proc.wait(timeout=timeout_s)
        record.status = "passed" if record.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        record.status = "timeout"
    reader.join(timeout=10)
    record.seconds = round(time.monotonic() - start, 1)
    record.result = _parse("".join(lines), step.parse)
    return record


def _parse(text: str, kind: str | None) -> dict[str, Any] | None:
    from model_server.benchmarks import gpu_summary

    figures = None
    if kind == "latency":
        figures = gpu_summary.parse_latency(text)
    elif kind == "throughput":
        figures = gpu_summary.parse_throughput(text)
    return None if figures is None else asdict(figures)


def _emit(log: TextIO, line: str) -> None:
    print(line, flush=True)
    log.write(line + "\n")
    log.flush()


def evaluate_goals(steps: Sequence[StepRecord]) -> dict[str, bool | None]:
    """The issue's goals from the steps' results (None: not measured in this run)."""
    by_key = {s.key: s for s in steps}

    def figure(key: str, name: str) -> float | None:
        record = by_key.get(key)
        if record is None or not record.result:
            return None
        return record.result.get(name)

    parity = by_key.get("C")
    identical = (parity.result or {}).get("fp32_identical") if parity else None
    spec_pct = figure("E", "spec_pct")
    graphs, eager = figure("D1", "decode_tps"), figure("D2", "decode_tps")
    values: dict[str, bool | None] = {
        "parity": bool(identical) and all(identical.values()) if identical else None,
        "hbm": None if spec_pct is None else spec_pct >= 85.0,
        "graphs": None if graphs is None or not eager else graphs / eager >= 1.5,
    }
    return {label: values[key] for label, key in GOALS.items()}


def run(
    steps: Sequence[Step],
    summary: Summary,
    out: Path,
    work: Path,
    env: dict[str, str],
    clock: Callable[[], float] = time.monotonic,
) -> Summary:
    start = clock()
    with (out / "run.log").open("a") as log:
        for step in steps:
            elapsed = clock() - start
            record = StepRecord(step.key, step.name, " ".join(step.argv))
            if not step.run:
                record.status = "planned"
            elif elapsed > summary.budget_s:
                record.status = "skipped (budget)"
            else:
                timeout = min(step.timeout_s, summary.deadline_s - elapsed)
                _emit(log, f"== [{step.key}] {step.name} (timeout {timeout:.0f} s)")
                _emit(log, f"$ {record.command}")
                # Recorded as running first: a call cut off mid-step still says which one.
                record.status = "running"
                summary.steps.append(record)
                _write_summary(out, summary, elapsed)
                record = run_step(step, timeout, log, env)
                if step.result and (work / step.result).is_file():
                    record.result = json.loads((work / step.result).read_text())
                _emit(log, f"== [{step.key}] {record.status} after {record.seconds} s")
                summary.steps.pop()
            summary.steps.append(record)
            _write_summary(out, summary, clock() - start)
    summary.goals = evaluate_goals(summary.steps)
    ran = [s for s in summary.steps if s.status not in ("planned", "skipped (budget)")]
    summary.passed = (
        bool(ran)
        and all(s.status == "passed" for s in ran)
        and not summary.plan_problems
        and not summary.wheels.get("problems")
    )
    _write_summary(out, summary, clock() - start)
    return summary


def _write_summary(out: Path, summary: Summary, elapsed: float) -> None:
    summary.elapsed_s = round(elapsed, 1)
    (out / "summary.json").write_text(json.dumps(asdict(summary), indent=2))


def _git_commit() -> str | None:
    proc = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    if proc.returncode != 0:
        return None
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0
    return proc.stdout.strip() + (" (with local changes)" if dirty else "")


def _other_gpu_tests() -> list[str]:
    """Test files outside tests/kernels holding gpu-marked tests."""
    found = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith("tests/kernels/") and re.search(r"mark\.gpu\b", path.read_text()):
            found.append(rel)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dry-run", action="store_true", help="on a CPU: plan, wheels, A-C small")
    p.add_argument("--out", type=Path, required=True, help="results folder (the device's $OUT)")
    p.add_argument("--wheel-dir", type=Path, default=ROOT / ".whl")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="start no step after this")
    p.add_argument("--deadline-s", type=float, default=DEADLINE_S, help="end every step by this")
    args = p.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    summary = Summary(
        dry_run=args.dry_run,
        started_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        budget_s=args.budget_s,
        deadline_s=args.deadline_s,
        git=_git_commit(),
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    # The wheels were installed by scripts/gpu_check.sh before this process started; the dry
    # run (another Python) checks them with pip for the machines' Python instead.
    summary.wheels = check_wheels(args.wheel_dir, py, install=args.dry_run)
    with tempfile.TemporaryDirectory(prefix="wick-gpu-check-") as tmp:
        work = Path(tmp)
        steps = plan(py, args.out, work, args.dry_run, [] if args.dry_run else _other_gpu_tests())
        summary.plan_problems = check_plan(steps, out_files=3)
        with (args.out / "run.log").open("w") as log:
            _emit(log, f"== gpu_check {'--dry-run ' if args.dry_run else ''}{summary.started_utc}")
            _emit(
                log,
                f"git: {summary.git}; wheels: {summary.wheels['mib']} MiB, problems: "
                f"{summary.wheels['problems'] or 'none'}",
            )
            for problem in summary.plan_problems:
                _emit(log, f"plan: {problem}")
        run(steps, summary, args.out, work, env)
    with (args.out / "run.log").open("a") as log:
        for step in summary.steps:
            _emit(log, f"{step.key:<3} {step.status:<17} {step.seconds:>6.1f} s  {step.name}")
        for label, met in summary.goals.items():
            _emit(
                log,
                f"goal: {label}: {'not measured' if met is None else 'met' if met else 'NOT met'}",
            )
        _emit(
            log, f"gpu_check: {'passed' if summary.passed else 'FAILED'} in {summary.elapsed_s} s"
        )
    return 0 if summary.passed else 1


if __name__ == "__main__":
    sys.exit(main())
