"""The wheels a lent GPU machine installs before scripts/gpu_check.sh runs: what the engine needs
beyond the machine's image (torch, Triton, transformers, numpy, ... are there), for its CPython
3.12 on x86-64. scripts/fetch_gpu_wheels.sh downloads them into the ignored .whl/ on a machine
with a package index; `check_wheels` says whether a folder holds an installable set.

    python -m tools.gpu_wheels .whl
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MAX_WHEEL_BYTES = 16 * 1024**2
# What the engine needs beyond a lent machine's image (torch, triton, transformers, numpy, ...):
# the settings' pydantic stack and gguf. scripts/fetch_gpu_wheels.sh downloads them.
REQUIRED_WHEELS = (
    "pydantic",
    "pydantic-core",
    "pydantic-settings",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "python-dotenv",
    "gguf",
)
WHEEL_PYTHON = "3.12"
_WHEEL_NAME = re.compile(
    r"^(?P<name>[A-Za-z0-9_.]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)"
    r"-(?P<plat>[^-]+)\.whl$"
)


def check_wheels(wheel_dir: Path, py: str, install: bool) -> dict[str, Any]:
    """Whether `wheel_dir` holds an installable set for the machines' Python 3.12 on x86-64."""
    problems: list[str] = []
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    if not wheels:
        problems.append(f"no wheels in {wheel_dir} (bash scripts/fetch_gpu_wheels.sh)")
    versions: dict[str, list[str]] = {}
    for wheel in wheels:
        match = _WHEEL_NAME.match(wheel.name)
        if match is None:
            problems.append(f"{wheel.name}: not a wheel file name")
            continue
        project = re.sub(r"[-_.]+", "-", match["name"]).lower()
        versions.setdefault(project, []).append(match["version"])
        if not _fits_machine(match["py"], match["abi"], match["plat"]):
            problems.append(f"{wheel.name}: not for CPython {WHEEL_PYTHON} on manylinux x86_64")
    problems += [f"{p}: versions {', '.join(v)}" for p, v in versions.items() if len(v) > 1]
    problems += [f"{name}: missing" for name in REQUIRED_WHEELS if name not in versions]
    total = sum(w.stat().st_size for w in wheels)
    if total > MAX_WHEEL_BYTES:
        problems.append(f"{total / 1024**2:.1f} MiB of wheels; at most {MAX_WHEEL_BYTES >> 20}")
    if install and wheels and not problems:
        problems += _pip_install_check(py, wheels)
    return {
        "dir": str(wheel_dir),
        "files": [w.name for w in wheels],
        "mib": round(total / 1024**2, 2),
        "problems": problems,
    }


def _fits_machine(py_tag: str, abi: str, plat: str) -> bool:
    if plat == "any":
        return any(t in ("py3", "py2.py3", "cp312") for t in (py_tag, py_tag.replace(".", "")))
    platform_ok = "x86_64" in plat and "manylinux" in plat
    if abi == "abi3":
        return platform_ok and all(
            t.startswith("cp3") and int(t[3:]) <= 12 for t in py_tag.split(".")
        )
    return platform_ok and "cp312" in py_tag.split(".") and abi in ("cp312", "none")


def _pip_install_check(py: str, wheels: Sequence[Path]) -> list[str]:
    """pip's own tag check: install the wheels for Python 3.12 / manylinux x86-64 into a
    throwaway folder (what scripts/gpu_check.sh does there, minus the target's interpreter)."""
    with tempfile.TemporaryDirectory(prefix="wick-wheels-") as target:
        proc = subprocess.run(
            [
                py,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--only-binary=:all:",
                "--python-version",
                WHEEL_PYTHON,
                "--implementation",
                "cp",
                "--platform",
                "manylinux2014_x86_64",
                "--platform",
                "manylinux_2_28_x86_64",
                "--target",
                target,
                *map(str, wheels),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    if proc.returncode != 0:
        return [f"pip install for Python {WHEEL_PYTHON}: {proc.stderr.strip()[-500:]}"]
    return []


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    report = check_wheels(Path(args[0] if args else ".whl"), sys.executable, install=True)
    print(f"{len(report['files'])} wheels, {report['mib']} MiB in {report['dir']}")
    for problem in report["problems"]:
        print(f"  {problem}")
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
