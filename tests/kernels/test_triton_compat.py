"""kernels/triton_compat.py: the one reader of Triton's version-dependent internals, and the
version bounds that pyproject.toml and docker/Dockerfile.cuda state agree with it."""

from __future__ import annotations

import re
import subprocess
import types
from pathlib import Path

import pytest

from model_server.kernels import triton_compat
from model_server.kernels.triton_compat import (
    MIN_TRITON,
    UnsupportedTriton,
    interpreting,
    parse_version,
    require_supported_triton,
)

pytestmark = pytest.mark.kernels
ROOT = Path(__file__).resolve().parents[2]
# The Triton each torch release's CUDA wheels pin (torch's `triton` requirement).
TORCH_PINS_TRITON = {
    (2, 7): (3, 3),
    (2, 8): (3, 4),
    (2, 9): (3, 5),
    (2, 10): (3, 6),
    (2, 11): (3, 6),
}


def _fake_triton(monkeypatch, version: str, knobs: object | None) -> None:
    fake = types.SimpleNamespace(__version__=version)
    if knobs is not None:
        fake.knobs = knobs
    monkeypatch.setattr(triton_compat, "_triton", lambda: fake)
    require_supported_triton.cache_clear()


@pytest.fixture(autouse=True)
def _clear_cache():
    yield
    require_supported_triton.cache_clear()


def test_parse_version() -> None:
    assert parse_version("3.6.0") == (3, 6)
    assert parse_version("3.4.0+git1234abcd") == (3, 4)
    assert parse_version("3.10.1") == (3, 10)  # numeric, not lexical
    with pytest.raises(ValueError):
        parse_version("main")


def test_old_triton_is_refused_with_a_clear_error(monkeypatch) -> None:
    # Triton 3.3 (torch 2.7's): no knobs; the kernels would fail at their first bf16 launch.
    _fake_triton(monkeypatch, "3.3.1", knobs=None)
    with pytest.raises(UnsupportedTriton, match=r"Triton 3\.3\.1 .* Triton >= 3\.4"):
        require_supported_triton()
    _fake_triton(monkeypatch, "3.6.0", knobs=None)
    assert require_supported_triton() == (3, 6)


def test_interpret_flag_from_knobs_or_the_environment(monkeypatch) -> None:
    knobs = types.SimpleNamespace(runtime=types.SimpleNamespace(interpret=True))
    _fake_triton(monkeypatch, "3.6.0", knobs=knobs)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert interpreting() is True  # knobs win where they exist
    knobs.runtime.interpret = False
    assert interpreting() is False
    _fake_triton(monkeypatch, "3.3.1", knobs=None)  # before knobs: the variable itself
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreting() is True
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert interpreting() is False


def test_installed_triton_is_supported_and_its_cuobjdump_found() -> None:
    assert require_supported_triton() >= MIN_TRITON
    assert Path(triton_compat.cuobjdump_path()).name == "cuobjdump"


def test_no_other_module_reads_triton_internals() -> None:
    """knobs, the active driver and the binary paths are read in triton_compat.py only."""
    pattern = r"triton\.knobs|from triton import knobs|driver\._active|_path_to_binary"
    out = subprocess.run(
        ["grep", "-rlE", "--include=*.py", pattern, "model_server", "tools", "scripts"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert out == ["model_server/kernels/triton_compat.py"]


def _lower_bound(pyproject: str, name: str) -> tuple[int, int]:
    """The `name>=X.Y` bound of pyproject.toml (one requirement string per project)."""
    (bound,) = re.findall(rf'"{name}>=([\d.]+)', pyproject)
    return parse_version(bound)


def test_declared_bounds_agree_with_the_kernels() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert _lower_bound(pyproject, "triton") == MIN_TRITON
    assert TORCH_PINS_TRITON[_lower_bound(pyproject, "torch")] >= MIN_TRITON
    assert _lower_bound(pyproject, "transformers") >= (4, 56)


def test_cuda_image_base_has_a_supported_triton() -> None:
    dockerfile = (ROOT / "docker" / "Dockerfile.cuda").read_text()
    base = re.search(r"^ARG BASE_IMAGE=pytorch/pytorch:(\d+\.\d+)\.\d+-cuda", dockerfile, re.M)
    assert base, "docker/Dockerfile.cuda's default base is a pytorch/pytorch image"
    assert TORCH_PINS_TRITON[parse_version(base[1])] >= MIN_TRITON
    # And the build refuses a base given with an older one.
    assert "require_supported_triton" in dockerfile
