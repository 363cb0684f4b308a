"""What a GPU machine collects: `pytest -m gpu` selects every kernel test that runs on the device,
and tests/kernels collects in the GPU image (no gguf, pydantic, fastapi or xgrammar).

Collected in a subprocess with `torch.cuda.is_available` forced true (nothing runs, so no device
is touched) and those packages made unimportable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.kernels
ROOT = Path(__file__).resolve().parents[2]
# Not in the GPU machines' image (see scripts/fetch_gpu_wheels.sh for what travels instead).
ABSENT_THERE = ("gguf", "pydantic", "pydantic_core", "pydantic_settings", "fastapi", "xgrammar")


def _pytest(*args: str, cuda: bool) -> str:
    script = (
        "import sys\n"
        f"for name in {ABSENT_THERE!r}: sys.modules[name] = None\n"
        "import torch\n"
        f"torch.cuda.is_available = lambda: {cuda}\n"
        "import pytest\n"
        "sys.exit(pytest.main(sys.argv[1:]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # plugins of this venv import pydantic
    proc = subprocess.run(
        [sys.executable, "-c", script, "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _collect(*args: str, cuda: bool) -> list[str]:
    out = _pytest("--collect-only", *args, cuda=cuda)
    return [line for line in out.splitlines() if "::" in line]


@pytest.mark.slow
def test_gpu_marker_selects_every_device_test_on_a_cuda_machine() -> None:
    files = [
        "tests/kernels/test_mla_decode.py",
        "tests/kernels/test_kv_cache_dtype_triton.py",
        "tests/kernels/test_model_triton.py",
        "tests/kernels/test_cuda_graph.py",
        "tests/kernels/test_cpu_gguf_gemm.py",  # imports gguf_packing: skipped, not an error
    ]
    everything = _collect(*files, cuda=True)
    selected = _collect("-m", "gpu", *files, cuda=True)
    by_file = {f: [t for t in selected if t.startswith(f)] for f in files}
    # Device-fixture tests: all of them, and only them, besides the explicit gpu tests.
    for name in files[:3]:
        device_tests = [t for t in everything if t.startswith(name) and "refused" not in t]
        assert by_file[name] == device_tests, name
    assert not any("test_unknown_decode_kernel_is_refused" in t for t in selected)
    # test_cuda_graph: the real-graph tests, not the CPU stand-ins.
    graph_tests = by_file["tests/kernels/test_cuda_graph.py"]
    assert graph_tests and all("test_real_cuda_graphs_match_eager" in t for t in graph_tests)
    assert by_file["tests/kernels/test_cpu_gguf_gemm.py"] == []
    # Without CUDA the same tests are collected unmarked (they run interpreted); gpu ones go.
    cpu = _collect(*files, cuda=False)
    assert not any("test_real_cuda_graphs_match_eager" in t for t in cpu)
    assert set(by_file["tests/kernels/test_mla_decode.py"]) <= set(cpu)


def test_cpu_stand_ins_skip_where_cuda_is_present() -> None:
    """The CPU graph stand-in patches the CPU platform only: with CUDA the engine would run
    there, so those tests skip rather than fail (the gpu tests capture real graphs)."""
    out = _pytest(
        "-rs", "tests/kernels/test_cuda_graph.py::test_padding_rows_write_no_kv", cuda=True
    )
    assert "1 skipped" in out and "CPU stand-in for CUDA graphs" in out, out
