"""Native CPU kernels: C sources in this folder, compiled on first use with the system's C
compiler and loaded through ctypes (no torch headers, so a build takes well under a second).

Builds are cached under `${WICK_CACHE_DIR:-~/.cache/wick}/kernels/` (or the temp dir when that is
not writable), keyed by the source, the compiler, the flags and the CPU's feature flags: a cache
shared between machines never hands a `-march=native` build to a CPU that lacks its instructions.
Without a compiler, or when every build fails, `load_library()` returns None and callers fall
back to PyTorch; the reason is logged once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
# Tried in order; OpenMP and -march=native are optional (the code is correct without them).
FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-fopenmp"),
    ("-O3",),
)
BUILD_TIMEOUT_S = 120


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return os.uname().machine


def _cache_dirs() -> list[Path]:
    base = Path(os.environ.get("WICK_CACHE_DIR") or Path.home() / ".cache" / "wick")
    return [base / "kernels", Path(tempfile.gettempdir()) / "wick-kernels"]


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _build(cc: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile SOURCE into `target` atomically; returns an error text or None on success."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cc, *flags, "-shared", "-fPIC", "-std=c11", str(SOURCE), "-o", tmp, "-lm"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"
        os.replace(tmp, target)  # concurrent builders (TP ranks, servers) race harmlessly
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first call; None when they cannot be built here."""
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler found (set CC): CPU attention falls back to PyTorch")
        return None
    source = SOURCE.read_bytes()
    errors: list[str] = []
    for flags in FLAG_SETS:
        key = hashlib.sha256(
            b"|".join([source, cc.encode(), " ".join(flags).encode(), _cpu_identity().encode()])
        ).hexdigest()[:16]
        for directory in _cache_dirs():
            target = directory / f"paged_decode-{key}.so"
            if not target.is_file():
                start = time.perf_counter()
                try:
                    error = _build(cc, flags, target)
                except OSError as exc:  # unwritable cache directory: try the next one
                    errors.append(f"{directory}: {exc}")
                    continue
                if error is not None:
                    errors.append(f"{' '.join(flags)}: {error}")
                    break  # these flags fail with this compiler; try the next set
                logger.info(
                    "built CPU attention kernels (%s) in %.2fs",
                    " ".join(flags),
                    time.perf_counter() - start,
                )
            try:
                return _bind(ctypes.CDLL(str(target)))
            except OSError as exc:
                errors.append(f"{target}: {exc}")
    logger.warning(
        "could not build the CPU attention kernels (%s): falling back to PyTorch",
        "; ".join(errors),
    )
    return None


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    fn = lib.wick_paged_decode_f32
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, i32, i32, i32, i32, i32, ctypes.c_float, i32]
    fn.restype = i32
    return lib


def paged_decode_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `paged_decode` can run these inputs (fp32 on the CPU, contiguous caches)."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and k_cache.dtype == torch.float32
        and k_cache.is_contiguous()
    )


def paged_decode(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, H, D] fp32, caches [num_blocks, block_size, Hkv, D], block_tables [B, >=nb] int32,
    seq_lens [B] int32 (each >= 1) -> [B, H, D]. See paged_decode.c for the contract."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    # ctypes drops the GIL for the call, so the HTTP event loop keeps running meanwhile.
    status = lib.wick_paged_decode_f32(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("paged decode attention could not allocate its scores buffer")
    return out
