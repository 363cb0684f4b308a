"""The Triton kernels compile for real NVIDIA targets (not only under the interpreter).

`python -m tools.compile_check` runs in a fresh process (the kernels must be
decorated with TRITON_INTERPRET off) and compiles, with Triton's bundled ptxas, every variant the
attention backend, the fused ops, the quantized matmuls, the fused MoE, the MLA decode and the
pooling models' varlen attention launch for real models' shapes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from model_server.kernels.attention_tile import default_tile_n
from tools import compile_check

pytestmark = pytest.mark.kernels
ROOT = Path(__file__).resolve().parents[2]
KERNELS = (
    "_store_kv_kernel",
    "_paged_decode_kernel",
    "_reduce_splits_kernel",
    "_paged_prefill_kernel",
    "_rms_norm_kernel",
    "_silu_and_mul_kernel",
    "_rotary_neox_kernel",
    "_int8_linear_kernel",
    "_wna16_linear_kernel",
    "_grouped_gemm_kernel",  # fused MoE (deepseek-v2-lite: 64 experts, top 6)
    "_mla_decode_kernel",  # latent attention (deepseek-v2-lite: L 512, R 64, 16 heads)
    "_varlen_attention_kernel",  # pooling models' packed attention (qwen3-0.6b's heads)
    "_shrink_kernel",  # multi-LoRA (qwen3-0.6b's q/k/v and down projections)
    "_expand_kernel",
)


def _run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_every_kernel_compiles_for_sm80_and_sm90() -> None:
    # sm_80 (A100: mma, 163 KiB of shared memory per block) and sm_90 (H100, H200: wgmma);
    # Qwen3-0.6B (D 128, GQA 2, per-head q/k norm views) and DeepSeek-V2-Lite (MLA, MoE);
    # bf16 (tensor-core dots, never run by the interpreter tests) and fp32 (the largest tiles).
    proc = _run(
        [
            "-m",
            "tools.compile_check",
            "--arch",
            "80,90",
            "--preset",
            "qwen3-0.6b,deepseek-v2-lite",
            "--dtype",
            "bf16,fp32",
            "--kv-cache-dtype",
            "auto",
        ]
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "all kernels compiled" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"sm_\d+\s+_", line)]
    for arch in ("sm_80", "sm_90"):
        compiled = {row[1] for row in rows if row[0] == arch}
        assert compiled == set(KERNELS), (arch, compiled)
        # Every variant's cubin was inspected: registers and spills are numbers, not "?".
        for row in (r for r in rows if r[0] == arch):
            assert row[5].isdigit() and row[6].isdigit(), row
            assert int(row[5]) * int(row[2]) * 32 <= 64 * 1024, row
    for arch, limit in (("80", 163), ("90", 227)):
        summary = re.search(
            rf"sm_{arch} \(.*?\): (\d+) variants compiled; most shared memory ([\d.]+) of "
            rf"{limit} KiB; most registers per block (\d+) of 65536",
            out,
        )
        assert summary and int(summary[1]) >= 2 * 2 * len(KERNELS), out[-2000:]
        assert float(summary[2]) <= limit and int(summary[3]) <= 65536


def _fake_kernel(num_warps: int, shared: int) -> SimpleNamespace:
    metadata = SimpleNamespace(shared=shared, num_warps=num_warps, num_stages=3, hash="h")
    return SimpleNamespace(metadata=metadata, asm={"cubin": b""})


def test_register_and_shared_memory_limits_fail_the_check(monkeypatch) -> None:
    monkeypatch.setattr(compile_check, "cubin_resources", lambda cubin: (255, 0))
    arch = compile_check.ARCHS[80]
    report = compile_check.Report()
    # 255 registers x 256 threads = 65280: fits the 64 Ki register file of a block.
    compile_check._variant("k", _fake_kernel(8, 1024), arch, "fits", report)
    assert report.failures == []
    # x 512 threads: a launch would fail ("too many resources requested for launch").
    variant = compile_check._variant("k", _fake_kernel(16, 1024), arch, "too wide", report)
    assert variant.registers == 255
    (failure,) = report.failures
    assert failure.startswith("too wide: k needs 255 registers per thread x 512 threads")
    compile_check._variant("k", _fake_kernel(4, 164 * 1024), arch, "shared", report)
    assert report.failures[-1].startswith("shared: k needs 164.0 KiB of shared memory")
    assert "FAILED" in compile_check.format_report(report, [80])


@pytest.mark.slow
def test_quantized_kv_cache_kernels_compile_for_sm80_and_sm90() -> None:
    # --kv-cache-dtype int8 / fp8: the store's quantization and the tile's code conversions use
    # integer bit tricks only (no fp8 instructions), so sm_80 (A100) compiles them too.
    proc = _run(
        [
            "-m",
            "tools.compile_check",
            "--arch",
            "80,90",
            "--preset",
            "smollm2-135m",
            "--dtype",
            "bf16",
            "--kv-cache-dtype",
            "int8,fp8_e4m3,fp8_e5m2",
        ]
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "all kernels compiled" in out
    for arch in ("sm_80", "sm_90"):
        for fmt in ("int8", "fp8_e4m3", "fp8_e5m2"):
            for kernel in ("_store_kv_kernel", "_paged_decode_kernel", "_paged_prefill_kernel"):
                assert re.search(rf"^{arch}\s+{kernel}\s.*{fmt} KV cache$", out, re.M), (
                    arch,
                    fmt,
                    kernel,
                )


def test_shared_memory_overflow_is_caught_and_the_default_tile_avoids_it() -> None:
    # fp32 prefill at D 128 with 64-position tiles needs more than sm_89's 99 KiB per block: the
    # check must see it (metadata of the real cubin), and the default tile width must not.
    script = textwrap.dedent(
        """
        import os
        os.environ["TRITON_INTERPRET"] = "0"
        import torch
        from tools.kernel_bench import Case, Shape, build_case_inputs
        from tools.compile_check import ARCHS, compile_only
        from model_server.kernels.paged_prefill import paged_prefill_attention

        md, q, k, v, kc, vc = build_case_inputs(
            Case("p", [(0, 37), (0, 20)]), Shape(16, 8, 128, 16, torch.float32),
            torch.device("cpu"),
        )
        for tile_n in (64, None):
            with compile_only(89) as launched:
                paged_prefill_attention(
                    torch.empty_like(q), q, kc, vc, md.query_start_loc, md.seq_lens,
                    md.block_tables, 0.1, 0, 2, md.max_query_len, tile_n=tile_n,
                )
            (name, kernel), = launched
            print(name, tile_n, kernel.metadata.shared, ARCHS[89].max_shared_bytes)
        """
    )
    proc = _run(["-c", script])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (forced, default) = [line.split() for line in proc.stdout.splitlines()[-2:]]
    assert forced[0] == default[0] == "_paged_prefill_kernel"
    assert int(forced[2]) > int(forced[3])  # tile 64: over the limit
    assert int(default[2]) <= int(default[3])  # default (32 for fp32 at D 128): fits


def test_compile_check_rejects_unknown_targets() -> None:
    proc = _run(["-m", "tools.compile_check", "--arch", "75"])
    assert proc.returncode == 2
    assert "unknown --arch [75]" in proc.stderr


@pytest.mark.parametrize(
    ("block_d", "dtype", "expected"),
    [
        (128, torch.bfloat16, 64),
        (128, torch.float16, 64),
        (64, torch.float32, 64),
        (128, torch.float32, 32),
        (256, torch.bfloat16, 32),
        (256, torch.float32, 16),
        (512, torch.float32, 16),  # never below the 16 rows tl.dot needs
    ],
)
def test_default_tile_n(block_d: int, dtype: torch.dtype, expected: int) -> None:
    assert default_tile_n(block_d, dtype) == expected
