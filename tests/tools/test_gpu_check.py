"""scripts/gpu_check.sh and tools/gpu_check.py: the dry run on this CPU (plan, carried wheels,
stages A-C under the interpreter), the budget guard, the wheel checks and the goals."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tools import gpu_check
from tools.gpu_check import Step, StepRecord, Summary, check_plan, evaluate_goals, plan
from tools.gpu_wheels import REQUIRED_WHEELS, check_wheels

ROOT = Path(__file__).resolve().parents[2]
PURE = "py3-none-any"
CORE = "cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64"


def make_wheel(folder: Path, project: str, version: str, tags: str = PURE) -> Path:
    """A minimal valid wheel of `project` (one module, its dist-info)."""
    dist = project.replace("-", "_")
    path = folder / f"{dist}-{version}-{tags}.whl"
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{dist}_stub.py": "",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        + "".join(f"Tag: {t}\n" for t in _expand(tags)),
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


def _expand(tags: str) -> list[str]:
    py, abi, plat = tags.split("-")
    return [f"{p}-{a}-{q}" for p in py.split(".") for a in abi.split(".") for q in plat.split(".")]


@pytest.fixture
def wheel_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir()
    for project in REQUIRED_WHEELS:
        make_wheel(folder, project, "1.0", CORE if project == "pydantic-core" else PURE)
    return folder


@pytest.mark.slow
def test_dry_run_on_the_cpu(tmp_path: Path, wheel_dir: Path) -> None:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHON=sys.executable, OUT=str(out), WHEEL_DIR=str(wheel_dir))
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["junit_kernels.xml", "run.log", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] and summary["passed"]
    assert summary["plan_problems"] == [] and summary["wheels"]["problems"] == []
    assert len(summary["wheels"]["files"]) == len(REQUIRED_WHEELS)
    status = {s["key"]: s["status"] for s in summary["steps"]}
    assert status == {
        "A": "passed",
        "B": "passed",
        "C": "passed",
        **{k: "planned" for k in ("E", "E2", "D1", "D2", "D3", "D4", "D5")},
    }
    steps = {s["key"]: s for s in summary["steps"]}
    assert steps["A"]["result"]["device"] == "cpu" and steps["A"]["result"]["copy_gbs"] > 0
    parity = steps["C"]["result"]
    assert parity["fp32_identical"] == {"eager": True, "graphs": True}
    assert parity["graph_replays"] > 0  # decode steps went through the graph runner
    assert parity["bf16_max_logprob_diff"] < 0.1
    junit = (out / "junit_kernels.xml").read_text()
    assert 'failures="0"' in junit and 'errors="0"' in junit and 'tests="0"' not in junit
    log = (out / "run.log").read_text()
    assert "gpu_check: passed" in log and "== [B] passed" in log
    assert seconds < summary["budget_s"]


def test_wheel_check_names_what_is_wrong(tmp_path: Path, wheel_dir: Path) -> None:
    assert check_wheels(wheel_dir, sys.executable, install=False)["problems"] == []
    (wheel_dir / f"pydantic_core-1.0-{CORE}.whl").unlink()
    make_wheel(wheel_dir, "pydantic-core", "1.0", "cp311-cp311-manylinux2014_x86_64")
    make_wheel(wheel_dir, "gguf", "2.0")
    make_wheel(wheel_dir, "xgrammar", "0.2", "cp312-cp312-macosx_11_0_arm64")
    (wheel_dir / "python_dotenv-1.0-py3-none-any.whl").unlink()
    problems = check_wheels(wheel_dir, sys.executable, install=False)["problems"]
    assert sorted(problems) == sorted(
        [
            "pydantic_core-1.0-cp311-cp311-manylinux2014_x86_64.whl: not for CPython 3.12 on "
            "manylinux x86_64",
            "xgrammar-0.2-cp312-cp312-macosx_11_0_arm64.whl: not for CPython 3.12 on "
            "manylinux x86_64",
            "gguf: versions 1.0, 2.0",
            "python-dotenv: missing",
        ]
    )
    empty = check_wheels(tmp_path / "none", sys.executable, install=False)["problems"]
    assert empty[0] == f"no wheels in {tmp_path / 'none'} (bash scripts/fetch_gpu_wheels.sh)"
    assert len(empty) == 1 + len(REQUIRED_WHEELS)


def test_pip_refuses_what_the_names_allow(tmp_path: Path, wheel_dir: Path) -> None:
    """pip's install for Python 3.12 is the final word (here: a broken archive)."""
    assert check_wheels(wheel_dir, sys.executable, install=True)["problems"] == []
    (wheel_dir / "gguf-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    (problem,) = check_wheels(wheel_dir, sys.executable, install=True)["problems"]
    assert problem.startswith("pip install for Python 3.12")


def test_the_gpu_plan_parses_and_fits(tmp_path: Path) -> None:
    steps = plan(sys.executable, tmp_path, tmp_path, dry_run=False, other_gpu_tests=[])
    assert [s.key for s in steps] == ["A", "B", "C", "E", "E2", "D1", "D2", "D3", "D4", "D5"]
    assert all(s.run for s in steps)
    assert check_plan(steps, out_files=3) == []
    tests = steps[1].argv
    assert tests[tests.index("pytest") + 1 : tests.index("pytest") + 4] == (
        "-m",
        "gpu",
        "tests/kernels",
    )
    bad = Step("D9", "typo", (sys.executable, "-m", "model_server", "bench", "latency",
                              "--batch-sise", "1"), 10)  # fmt: skip
    assert check_plan([*steps, bad], out_files=9) == [
        "9 output files; a call brings back 8",
        "D9: the bench parser rejects bench latency --batch-sise 1",
    ]


def _python_step(key: str, code: str, timeout_s: float = 30) -> Step:
    return Step(key, key, (sys.executable, "-c", code), timeout_s)


def test_budget_guard_and_deadline(tmp_path: Path) -> None:
    # A fake clock, read at the start, before each step and after it: A starts at 0 s, B at
    # 419 s (inside the 420 s budget, its 240 s timeout cut to the 421 s deadline: 2 s), C at
    # 500 s (past the budget: not started).
    readings = itertools.chain([0.0, 0.0, 0.0, 419.0, 419.0, 500.0], itertools.repeat(500.0))
    steps = [
        _python_step("A", "print('facts')"),
        _python_step("B", "import time; time.sleep(60)", timeout_s=240),
        _python_step("C", "print('never')"),
    ]
    summary = Summary(dry_run=False, started_utc="t", budget_s=420.0, deadline_s=421.0)
    gpu_check.run(
        steps, summary, tmp_path, tmp_path, dict(os.environ), clock=lambda: next(readings)
    )
    status = [(s.key, s.status) for s in summary.steps]
    assert status == [("A", "passed"), ("B", "timeout"), ("C", "skipped (budget)")]
    assert summary.steps[1].seconds < 30
    assert not summary.passed
    written = json.loads((tmp_path / "summary.json").read_text())
    assert [s["status"] for s in written["steps"]] == ["passed", "timeout", "skipped (budget)"]
    assert "facts" in (tmp_path / "run.log").read_text()


def test_goals_from_the_figures() -> None:
    def record(key: str, result: dict) -> StepRecord:
        return StepRecord(key, key, "", status="passed", result=result)

    goals = evaluate_goals(
        [
            record("C", {"fp32_identical": {"eager": True, "graphs": True}}),
            record("E", {"spec_pct": 86.0}),
            record("D1", {"decode_tps": 300.0}),
            record("D2", {"decode_tps": 250.0}),
        ]
    )
    assert list(goals.values()) == [True, True, False]  # graphs only 1.2x eager
    assert list(evaluate_goals([]).values()) == [None, None, None]
