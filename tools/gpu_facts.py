"""Machine facts for stage A of scripts/gpu_check.sh: the device, its clocks, a measured copy
bandwidth and a bf16 (fp32 off CUDA) matrix-product rate.

    python -m tools.gpu_facts --device cuda --result facts.json

Copy GB/s counts bytes read plus bytes written (as `bench latency`'s measured-copy bound does);
TFLOP/s is 2 M N K over the median of timed products after warm-ups. Off CUDA the sizes shrink
(the dry run checks the code path, not the machine).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

GB = 1e9


def _timed(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    """Median seconds of `fn` over `repeats` runs after two warm-ups."""
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def nvidia_smi() -> dict[str, str]:
    """Name, driver, clocks (current and max) and memory of GPU 0, from nvidia-smi if present."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    fields = (
        "name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,"
        "power.limit"
    )
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    values = [v.strip() for v in out.splitlines()[0].split(",")] if out.strip() else []
    return dict(zip(fields.split(","), values, strict=False))


def measure(device_name: str) -> dict[str, Any]:
    import torch

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": device.type,
    }
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:
        facts["triton"] = None
    if cuda:
        props = torch.cuda.get_device_properties(device)
        facts.update(
            name=props.name,
            capability=f"sm_{props.major}{props.minor}",
            sm_count=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            nvidia_smi=nvidia_smi(),
        )
        sync = torch.cuda.synchronize
    else:
        facts["name"] = platform.processor() or platform.machine()

        def sync() -> None:
            return None

    copy_bytes = (1 << 30) if cuda else (64 << 20)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), sync, repeats=10 if cuda else 3)
    facts["copy_gbs"] = round(2 * copy_bytes / seconds / GB, 1)

    n = 8192 if cuda else 512
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _timed(lambda: a @ b, sync, repeats=10 if cuda else 3)
    facts["gemm"] = {
        "n": n,
        "dtype": str(dtype).removeprefix("torch."),
        "tflops": round(2 * n**3 / seconds / 1e12, 2),
    }
    return facts


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.gpu_facts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--result", type=Path, default=None, help="write the facts as JSON here")
    args = p.parse_args(argv)
    facts = measure(args.device)
    text = json.dumps(facts, indent=2)
    print(text)
    if args.result is not None:
        args.result.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
