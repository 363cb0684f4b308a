"""The installed package, as the images and `pip install .` get it: a wheel built from the package
sources, installed (not editable) into a fresh venv outside the checkout, run from another working
directory. Every file the packages read at run time must be in it: the native kernels' C sources
and headers, the presets, the chat page.

The fresh venv borrows its third-party dependencies (torch and the rest, several GB) from the test
environment's site-packages through a `.pth` path line; such a line only extends `sys.path`, so
the editable install's finder there is never activated and `model_server` can only come from the
wheel (asserted)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.deploy.conftest import ROOT, clean_env

pytestmark = pytest.mark.slow

PACKAGES = ("model_server", "microservice")


def tracked_data_files() -> list[str]:
    """Every non-Python file git tracks under the packages (what an installed copy may read)."""
    out = subprocess.run(
        ["git", "ls-files", *PACKAGES], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return sorted(p for p in out if not p.endswith(".py"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of what the Dockerfiles copy (pyproject, README, packages), so
    the checkout gets no build/ or egg-info."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--quiet", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = out.glob("wick-*.whl")
    return built


def test_wheel_ships_every_data_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [path for path in tracked_data_files() if path not in names]
    assert not missing, f"the wheel lacks files the packages read at run time: {missing}"


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed; returns its python."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # Last on sys.path: the wheel's own copy, in `site` itself, comes first.
    (Path(site) / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def run_installed(
    python: Path, args: list[str], cwd: Path, **env: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), *args], cwd=cwd, capture_output=True, text=True, timeout=600,
        env=clean_env(PYTHONPATH="", **env),
    )  # fmt: skip


def test_installed_packages_come_from_the_venv(installed: Path, tmp_path: Path) -> None:
    probe = "import model_server, microservice; print(model_server.__file__, microservice.__file__)"
    proc = run_installed(installed, ["-c", probe], tmp_path)
    assert proc.returncode == 0, proc.stderr
    venv = installed.parent.parent
    for path in proc.stdout.split():
        assert Path(path).is_relative_to(venv), f"{path} is not the installed copy"
        assert not Path(path).is_relative_to(ROOT)


def test_installed_generate_builds_native_kernels(installed: Path, tmp_path: Path) -> None:
    """`generate` with the embedded model; an empty kernel cache makes it compile the native
    kernels from the installed C files (the header-less wheel failed right here)."""
    proc = run_installed(
        installed,
        ["-m", "model_server", "generate", "--prompt", "What is the capital of France?",
         "--max-tokens", "12", "--log-level", "INFO"],
        tmp_path, WICK_CACHE_DIR=str(tmp_path / "cache"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "built the native CPU kernels" in proc.stderr, proc.stderr[-4000:]
    assert "Paris" in proc.stdout, proc.stdout
    assert any((tmp_path / "cache" / "kernels").glob("*.so"))


def test_installed_microservice_help(installed: Path, tmp_path: Path) -> None:
    proc = run_installed(installed, ["-m", "microservice", "--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout.lower()
    assert "--port" in proc.stdout or "LLM_USVC_PORT" in proc.stdout, proc.stdout
