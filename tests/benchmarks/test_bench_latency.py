"""`bench latency`: the bandwidth bound (bytes per step, device table, copy bandwidth), the
figures' arithmetic, a real CPU run through the CLI, the summary of `scripts/bench_gpu.sh` and the
script's behaviour without a GPU."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from model_server.benchmarks.bandwidth import (
    GB,
    StepBytes,
    bound_tokens_per_s,
    decode_step_bytes,
    measure_copy_bandwidth,
    measure_read_bandwidth,
    peak_bandwidth_gbs,
    weight_bytes_per_step,
)
from model_server.benchmarks.gpu_summary import (
    format_summary,
    parse_latency,
    parse_tests,
    parse_throughput,
)
from model_server.benchmarks.latency import LatencyResult, format_bound
from model_server.entrypoints.cli import main
from model_server.layers.attention import get_attention_backend
from model_server.models.registry import build_model
from tests.benchmarks.test_bench_throughput import TINY

ROOT = Path(__file__).resolve().parents[2]

# -- the device table ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "gbs"),
    [
        # Names exactly as torch.cuda.get_device_name() reports them.
        ("NVIDIA H100 80GB HBM3", 3350.0),
        ("NVIDIA H100 PCIe", 2000.0),
        ("NVIDIA H100 NVL", 3900.0),
        ("NVIDIA H200", 4800.0),
        ("NVIDIA A100-SXM4-80GB", 2039.0),
        ("NVIDIA A100 80GB PCIe", 1935.0),
        ("NVIDIA A100-SXM4-40GB", 1555.0),
        ("NVIDIA A100-PCIE-40GB", 1555.0),
        ("NVIDIA L40S", 864.0),
        ("NVIDIA L4", 300.0),
        ("NVIDIA GeForce RTX 4090", 1008.0),
        ("NVIDIA GeForce RTX 4070 Laptop GPU", 256.0),
        # Partial names, any case.
        ("h100", 3350.0),
        ("H100 SXM5", 3350.0),
        ("a100 80gb", 2039.0),
        ("rtx 4070 laptop", 256.0),
    ],
)
def test_peak_bandwidth_by_device_name(name: str, gbs: float) -> None:
    assert peak_bandwidth_gbs(name) == gbs


@pytest.mark.parametrize("name", ["NVIDIA GH200 480GB", "Tesla T4", "cpu", "L400", "", None])
def test_unknown_device_has_no_peak_bandwidth(name: str | None) -> None:
    assert peak_bandwidth_gbs(name) is None


# -- bytes per decode step -----------------------------------------------------------------------

H, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 32, 64, 4, 2, 8, 2, 100


def _tiny_model(tied: bool) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=H,
        intermediate_size=INTER,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_hidden_layers=LAYERS,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    config.architectures = ["LlamaForCausalLM"]
    return build_model(config, get_attention_backend("torch"), dtype=torch.float32)


def _layer_params() -> int:
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM * H
    o_proj = HEADS * HEAD_DIM * H
    gate_up, down = 2 * INTER * H, INTER * H
    return qkv + o_proj + gate_up + down + 2 * H  # + input and post-attention norms


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_per_step_exact(tied: bool) -> None:
    model = _tiny_model(tied)
    body = LAYERS * _layer_params() + H  # + final norm
    # Untied: the LM head whole, and 3 gathered rows of the embedding. Tied: the one table,
    # read whole by the LM head.
    expected = body + VOCAB * H + (0 if tied else 3 * H)
    assert weight_bytes_per_step(model, batch_size=3) == 4 * expected
    # More rows gathered than the table has: the whole table, no more.
    if not tied:
        assert weight_bytes_per_step(model, batch_size=500) == 4 * (body + 2 * VOCAB * H)


def test_decode_step_bytes_adds_the_kv_cache_at_the_mean_context() -> None:
    model = _tiny_model(tied=False)
    kv_per_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4  # K and V, every layer, fp32
    step = decode_step_bytes(model, 3, input_len=10, output_len=6, kv_bytes_per_token=kv_per_token)
    assert step.mean_context == 13.0  # decode steps attend to 11..15 tokens
    assert step.kv_cache == 3 * 13 * kv_per_token
    assert step.total == weight_bytes_per_step(model, 3) + step.kv_cache


def test_copy_bandwidth_is_measured_with_the_device_synchronized() -> None:
    calls = []
    bw = measure_copy_bandwidth(
        torch.device("cpu"), lambda: calls.append(1), nbytes=4 << 20, trials=2
    )
    assert bw > 0 and math.isfinite(bw)
    assert len(calls) >= 6  # around the single timing and every trial


def test_read_bandwidth_is_measured_natively_on_the_host() -> None:
    from model_server.kernels.cpu.native import load_kernels

    calls = []
    read = measure_read_bandwidth(
        torch.device("cpu"),
        lambda: calls.append(1),
        nbytes=64 << 20,
        trials=3,
        host_memory=True,
        num_threads=2,
        streams=(4,),
    )
    # Plausible for host memory: above a slow disk, below any CPU's caches summed over cores.
    assert 0.5 * GB < read.bytes_per_s < 2000 * GB, read
    assert len(calls) >= 5  # around the single timing and every trial
    if load_kernels() is not None:  # CI has a C compiler: the native kernel
        assert read.method == "native 2 threads x 4 streams, 64 MiB, best of 3 each"
    else:
        assert read.method == "torch sum, 64 MiB, best of 3"


def test_the_read_bandwidth_is_the_fastest_stream_count() -> None:
    from model_server.kernels.cpu.native import load_kernels

    if load_kernels() is None:
        pytest.fail("the native CPU kernels did not build (CI has a C compiler)")
    read = measure_read_bandwidth(
        torch.device("cpu"), lambda: None, nbytes=16 << 20, trials=2, host_memory=True,
        num_threads=1, streams=(1, 8),
    )  # fmt: skip
    fastest = re.fullmatch(
        r"native 1 threads x 1/8 streams \(fastest ([18])\), 16 MiB, best of 2 each", read.method
    )
    assert fastest is not None, read.method
    with pytest.raises(ValueError, match="cannot read 16777216 bytes as 1 threads x 9 streams"):
        measure_read_bandwidth(
            torch.device("cpu"), lambda: None, nbytes=16 << 20, trials=1, host_memory=True,
            num_threads=1, streams=(2, 9),
        )  # fmt: skip


def test_the_native_read_kernel_reads_every_line_once() -> None:
    import ctypes

    from model_server.kernels.cpu.native import load_kernels

    native = load_kernels()
    if native is None:
        pytest.fail("the native CPU kernels did not build (CI has a C compiler)")
    lines, threads = 2 * 3 * 5, 2
    buf = torch.arange(lines * 8, dtype=torch.int64)  # eight int64 lanes per 64-byte line
    checksum = ctypes.c_uint64()
    for streams in (1, 3, 5):
        rc = native.lib.wick_memory_read(
            buf.data_ptr(), buf.numel() * 8, streams, threads, ctypes.addressof(checksum)
        )
        assert rc == 0 and checksum.value == int(buf.sum()), streams
    # Out of range: nothing read.
    assert native.lib.wick_memory_read(buf.data_ptr(), 64, 2, threads, None) == -1
    assert native.lib.wick_memory_read(buf.data_ptr(), buf.numel() * 8, 9, 1, None) == -1


# -- the figures ---------------------------------------------------------------------------------


def test_latency_result_medians() -> None:
    r = LatencyResult(prefill=[0.1, 0.2, 0.1], full=[1.1, 1.3, 0.8], output_len=11)
    assert r.prefill_s == pytest.approx(0.1)
    assert r.full_s == pytest.approx(1.1)
    # Per iteration (full - prefill) / 10: 0.1, 0.11, 0.07.
    assert r.decode_s_per_token == pytest.approx(0.1)


def test_format_bound() -> None:
    step = StepBytes(weights=15 * 10**9, kv_cache=10**9, mean_context=256.0)
    assert bound_tokens_per_s(3200 * GB, step, 1) == pytest.approx(200.0)
    line = format_bound(180.0, 1, step, 3200.0, "spec", 2880 * GB, 3000 * GB)
    assert line == (
        "decode: 180.0 tok/s at batch 1 = 90.0% of the 200.0 tok/s bound (3200 GB/s spec, "
        "16 GB per step); 100.0% of the 180.0 tok/s measured-copy bound (2880 GB/s copy); "
        "96.0% of the 187.5 tok/s measured-read bound (3000 GB/s read)"
    )
    line = format_bound(90.0, 2, step, None, "spec", 1440 * GB, 1600 * GB)
    assert line == (
        "decode: 90.0 tok/s at batch 2 = 50.0% of the 180.0 tok/s measured-copy bound "
        "(1440 GB/s copy, 16 GB per step); 45.0% of the 200.0 tok/s measured-read bound "
        "(1600 GB/s read); no spec bandwidth"
    )
    figures = parse_latency(f"wick prefill: 1.00 ms (1.0 prompt tok/s)\n{line}\n")
    assert figures is not None
    assert (figures.copy_pct, figures.read_pct, figures.read_bound_tps) == (50.0, 45.0, 200.0)


# -- a real run on the CPU -----------------------------------------------------------------------


@pytest.fixture
def torch_threads():
    """The engine sets torch's thread count for the process: put it back afterwards."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_bench_latency_cli_on_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], torch_threads: None
) -> None:
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    # One thread: a model this small gains nothing from two, and threads that wait on each
    # other at every op slow to a crawl when other processes load the cores.
    argv = ["bench", "latency", "--load-format", "dummy", "--model", str(config), "--num-threads"]
    argv += ["1", "--dtype", "float32"]  # the baseline is compared in fp32
    argv += ["--batch-size", "2", "--input-len", "16", "--output-len", "64", "--num-iters", "3"]
    argv += ["--peak-bandwidth-gbs", "100", "--baseline", "transformers"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out = capsys.readouterr().out
    assert exit_info.value.code == 0, out
    assert out.startswith("latency: batch 2, input 16, output 64, median of 3 iterations after 1")
    assert "device: cpu, float32" in out

    figures = parse_latency(out)
    assert figures is not None, out
    assert figures.batch_size == 2
    assert figures.prefill_ms > 0 and figures.decode_tps > 0
    lines = {line.split(":")[0]: line.split() for line in out.splitlines()}
    ms_per_token, per_seq_tps = float(lines["wick decode"][2]), float(lines["wick decode"][4])
    # Printed as %.3f ms and %.1f tok/s: equal up to rounding.
    rel = 0.05 / per_seq_tps + 0.0005 / ms_per_token
    assert per_seq_tps * ms_per_token / 1e3 == pytest.approx(1.0, rel=rel)
    assert figures.decode_tps == pytest.approx(2 * per_seq_tps, abs=0.11)

    # The bound: exact bytes of the tiny model (fp32, untied: 2 gathered embedding rows) and its
    # KV cache (2 sequences at a mean context of 16 + 64 / 2 = 48 tokens).
    layer = (4 + 2 * 2) * 8 * 32 + 4 * 8 * 32 + 3 * 64 * 32 + 2 * 32
    weights = 4 * (2 * layer + 32 + 256 * 32 + 2 * 32)
    kv = 2 * 48 * (2 * 2 * 2 * 8 * 4)
    assert lines["step bytes"][2] == f"{(weights + kv) / 1e9:.4g}"
    assert figures.spec_gbs == 100.0
    bound = 2 * 100e9 / (weights + kv)
    assert figures.spec_bound_tps == pytest.approx(bound, abs=0.05)
    assert figures.spec_pct == pytest.approx(100 * figures.decode_tps / bound, abs=0.06)
    assert figures.copy_bound_tps > 0
    assert figures.copy_pct == pytest.approx(
        100 * figures.decode_tps / figures.copy_bound_tps, rel=0.002, abs=0.06
    )
    # The measured read: printed with its method (the native kernel on the engine's one
    # thread), and the decode line's read-bound percentage agrees with it.
    bandwidth = re.search(
        r"^bandwidth: given 100 GB/s, measured copy ([\d.]+) GB/s, measured read ([\d.]+) GB/s "
        r"\(native 1 threads x 2/4/8 streams \(fastest [248]\), 256 MiB, best of 10 each\)$",
        out,
        re.MULTILINE,
    )
    assert bandwidth is not None, out
    read_gbs = float(bandwidth[2])
    assert 0.5 < read_gbs < 2000
    assert figures.read_pct is not None and figures.read_bound_tps is not None
    assert figures.read_bound_tps == pytest.approx(2 * read_gbs * 1e9 / (weights + kv), rel=0.01)
    assert figures.read_pct == pytest.approx(
        100 * figures.decode_tps / figures.read_bound_tps, rel=0.002, abs=0.06
    )

    # The compute bound: the best GEMM at the batch's 2 rows over the tiny model's linear shapes.
    compute = re.search(
        r"^compute: best GEMM float32 at 2 rows on the model's shapes ([\d.e+-]+) GFLOP/s; decode "
        r"step ([\d.e+-]+) GFLOP at ([\d.e+-]+) GFLOP/s = ([\d.]+)% of it \(([\d.]+) tok/s compute "
        r"bound\)$",
        out,
        re.MULTILINE,
    )
    assert compute is not None, out
    rate, step_gflop, achieved, pct, bound_tps = map(float, compute.groups())
    linears = (4 + 2 * 2) * 8 * 32 + 32 * 4 * 8 + 2 * 64 * 32 + 32 * 64  # per layer
    assert step_gflop == pytest.approx(2 * 2 * (2 * linears + 256 * 32) / 1e9, rel=1e-3)
    assert rate > 0 and pct == pytest.approx(100 * achieved / rate, rel=0.01, abs=0.06)
    assert bound_tps == pytest.approx(2 * rate / step_gflop, rel=0.01)

    assert "transformers prefill: " in out
    assert figures.hf_decode_tps is not None and figures.hf_decode_tps > 0
    assert figures.decode_ratio == pytest.approx(
        figures.decode_tps / figures.hf_decode_tps, rel=0.02
    )


def test_bench_latency_rejects_bad_lengths(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "latency", "--output-len", "1"])
    assert exit_info.value.code == 1
    assert "--output-len must be at least 2" in capsys.readouterr().err


def test_bench_latency_help_documents_the_bound(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "latency", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--peak-bandwidth-gbs" in text and "measured device copy" in text
    assert "--enforce-eager" in text  # the engine flags


# -- the summary of scripts/bench_gpu.sh ---------------------------------------------------------

LATENCY_LOG = """\
latency: batch 1, input 128, output 256, median of 3 iterations after 1 warmup
device: cuda (NVIDIA H100 80GB HBM3), bfloat16
wick prefill: 25.31 ms (5057.2 prompt tok/s)
wick decode: 5.515 ms/token, 181.3 tok/s per sequence, 181.3 tok/s at batch 1 (full run 1.432 s)
step bytes: 15.05 GB per decode step (weights 15.01 GB + KV cache 0.0336 GB at mean context 256)
bandwidth: spec 3350 GB/s, measured copy 2950.3 GB/s, measured read 3010.2 GB/s (torch sum, \
1024 MiB, best of 5)
decode: 181.3 tok/s at batch 1 = 81.4% of the 222.6 tok/s bound (3350 GB/s spec, 15.05 GB per \
step); 92.5% of the 196.0 tok/s measured-copy bound (2950 GB/s copy); 90.7% of the 200.0 tok/s \
measured-read bound (3010 GB/s read)
transformers prefill: 40.10 ms (3192.0 prompt tok/s)
transformers decode: 25.000 ms/token, 40.0 tok/s per sequence, 40.0 tok/s at batch 1 (full \
run 6.4 s)
ratio: decode 4.53x, prefill 1.58x (wick / transformers)
"""
THROUGHPUT_LOG = """\
workload: 256 requests, 143000 input tokens, 144000 output tokens
wick: 20.00 s, 7200.0 output tok/s, 14350.0 total tok/s
transformers (batch 64): 240.00 s, 600.0 output tok/s
ratio: 12.00x
"""


def test_gpu_summary_parses_and_tabulates() -> None:
    lat = parse_latency(LATENCY_LOG)
    assert lat is not None
    assert (lat.device, lat.decode_tps, lat.spec_pct, lat.spec_bound_tps) == (
        "cuda (NVIDIA H100 80GB HBM3), bfloat16",
        181.3,
        81.4,
        222.6,
    )
    assert (lat.copy_pct, lat.hf_decode_tps, lat.decode_ratio) == (92.5, 40.0, 4.53)
    assert (lat.read_pct, lat.read_bound_tps) == (90.7, 200.0)
    tp = parse_throughput(THROUGHPUT_LOG)
    assert tp is not None and (tp.wick_tps, tp.hf_tps, tp.hf_batch, tp.ratio) == (
        7200.0,
        600.0,
        64,
        12.0,
    )
    tests = parse_tests("....\n======= 42 passed, 3 deselected in 61.20s (0:01:01) =======\n")
    assert tests == "42 passed, 3 deselected in 61.20s (0:01:01)"
    eager = parse_latency(
        LATENCY_LOG.replace("181.3 tok/s at batch 1 =", "120.0 tok/s at batch 1 =")
    )
    text = format_summary(tests, tp, lat, eager)
    assert text.splitlines()[0] == "== bench_gpu summary: cuda (NVIDIA H100 80GB HBM3), bfloat16 =="
    assert "gpu tests: 42 passed" in text
    assert "nano-vllm / vLLM 1.053x: goal met" in text
    assert "81.4% of 222.6  goal >= 85%: NOT met" in text
    assert re.search(r"% of the measured-read bound +90\.7% of 200\.0", text), text
    assert "eager" in text and "120.0" in text
    assert "int8" not in text  # no int8 run: no int8 rows
    int8 = parse_latency(LATENCY_LOG.replace("181.3 tok/s at batch", "250.5 tok/s at batch"))
    assert "latency: Llama-3.1-8B, batch 1, int8 weights" in format_summary(
        tests, tp, lat, eager, int8
    )
    assert parse_latency("no figures") is None and parse_throughput("") is None


# -- scripts/bench_gpu.sh without a GPU ----------------------------------------------------------


def _bench_gpu(*args: str) -> subprocess.CompletedProcess[str]:
    # No device visible whatever the machine, so the script can never start a real run here.
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "bench_gpu.sh"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_bench_gpu_script_refuses_without_cuda() -> None:
    proc = _bench_gpu()
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith("bench_gpu.sh: no CUDA device for ")


def test_bench_gpu_script_dry_run_prints_the_commands() -> None:
    proc = _bench_gpu("--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "pip install" not in line]
    lines = [line for line in lines if not line.startswith("export ")]
    py = sys.executable
    assert lines[0].startswith(f"{py} -m pytest -m gpu tests/kernels")
    assert lines[1] == (
        f"{py} -m model_server bench throughput --workload nano-vllm --load-format dummy "
        "--model qwen3-0.6b --device cuda --baseline transformers"
    )
    latency = (
        f"{py} -m model_server bench latency --load-format dummy --model llama-3.1-8b "
        "--device cuda --dtype bfloat16 --batch-size 1"
    )
    assert lines[2] == f"{latency} --baseline transformers"
    assert lines[3] == f"{latency} --enforce-eager"
    assert lines[4] == f"{latency} --quantization int8"
    assert lines[5].startswith(f"{py} -m model_server.benchmarks.gpu_summary ")
    assert _bench_gpu("--dry-run", "latency").stdout.count("bench latency") == 1
