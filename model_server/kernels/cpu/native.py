"""Native CPU kernels: the C files in SOURCES (paged attention with the KV-cache store; the
pooling models' attention over packed sequences, wrapped in varlen_attention.py; the decoder
layer's RMSNorm, SiLU-and-mul and rotary embedding, whose Python side is
kernels/cpu/layer_ops.py; the skinny matmul, wrapped in gemm.py; the matmuls on panel-packed
weights, bf16 on vdpbf16ps and fp32 on any ISA, wrapped in panel_gemm.py; the wNa16 matmul of
GPTQ/AWQ weights, wrapped in wna16.py; the GGUF block-quantized matmuls, float and int8 dot
products, wrapped in gguf_linear.py; LoRA adapters' batched shrink/expand, wrapped in lora.py;
mixture-of-experts routing and grouped experts, wrapped in moe.py, and DeepSeek's grouped
top-k routing, wrapped in moe_routing.py;
multi-head latent attention over a latent cache, wrapped in mla_attention.py;
all of a decoder stack's layers in one call of them, wrapped in decoder_stack.py), compiled
into one library on first use with the system's C compiler for the best vector ISA this CPU
runs (kernels/cpu/isa.py), the files in parallel (no torch headers; 44 s for the AVX2 build on
two Zen 3 cores), and loaded through ctypes. `NativeKernels.lib` binds every entry point
declared in the headers with the types declared there, once the library's struct layouts are
checked against their ctypes mirrors (`_bind`, kernels/cpu/abi.py); a library that disagrees
with its Python side is refused, and callers fall back to PyTorch.

Builds are cached under `${WICK_CACHE_DIR:-~/.cache/wick}/kernels/` (or the temp dir when that is
not writable), keyed by the source, the compiler, the ISA and the full flag list. The flags name
the ISA explicitly (no -march=native), so a cached build is only ever loaded where its ISA was
chosen from the CPU's flags. When an ISA's build fails, the next lower one is tried; without a
compiler or when every build fails, `load_kernels()` returns None and logs why once, and callers
fall back to PyTorch.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from model_server.kernels.cpu import abi
from model_server.kernels.cpu.isa import ISAS, Isa, choose_isas, hardware_isas
from model_server.settings_spec import wick_cache_dir

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
# Compiled into one library, each file to an object of its own in parallel (_build), started in
# this order: the longest compiles first (paged attention's copies of its work item, then the
# GGUF and panel matmuls), so that no long one starts last. HEADERS are part of the cache key.
SOURCES: tuple[Path, ...] = (
    _HERE / "paged_attention_quant_bf16.c",
    _HERE / "paged_attention_quant_f32.c",
    _HERE / "paged_attention_f32.c",
    _HERE / "paged_attention_bf16.c",
    _HERE / "gguf_q8.c",
    _HERE / "panel_gemm_f32.c",
    _HERE / "wna16_gemm.c",
    _HERE / "layer_ops.c",
    _HERE / "lora.c",
    _HERE / "gemm.c",
    _HERE / "gguf_gemm.c",
    _HERE / "varlen_attention.c",
    _HERE / "paged_attention.c",
    _HERE / "mla_attention.c",
    _HERE / "memory_read.c",
    _HERE / "decoder_stack.c",
    _HERE / "moe.c",
    _HERE / "moe_routing.c",
    _HERE / "abi_layout.c",
    _HERE / "moe_wna16.c",
    _HERE / "panel_gemm.c",
)
HEADERS: tuple[Path, ...] = (
    _HERE / "wick_attend.h",
    _HERE / "wick_cpu.h",
    _HERE / "wick_vec.h",
    _HERE / "wick_kv.h",
    _HERE / "wick_gguf.h",
    _HERE / "wick_entry.h",
    _HERE / "wick_lora.h",
    _HERE / "wick_mla.h",
    _HERE / "wick_moe.h",
    _HERE / "wick_moe_grouping.h",
    _HERE / "wick_moe_routing.h",
    _HERE / "wick_moe_wna16.h",
    _HERE / "wick_stack.h",
    _HERE / "wick_vmath.h",
)
# Tried in order per ISA; OpenMP threading is optional (the code is correct without it).
# -fopenmp-simd makes the `omp simd` reductions vectorize; -fno-strict-aliasing: see the source;
# -ffp-contract=off: no fused multiply-adds, every product rounded as PyTorch's ops round it
# (layer_ops.c's contract); -fno-trapping-math: FP exceptions are never read, and without it GCC
# keeps the conditionals of the exp and SiLU loops as branches, which do not vectorize.
_COMMON = (
    "-O3",
    "-fopenmp-simd",
    "-fno-strict-aliasing",
    "-ffp-contract=off",
    "-fno-trapping-math",
)
_THREADING: tuple[tuple[str, ...], ...] = (("-fopenmp",), ())
BUILD_TIMEOUT_S = 120
# Scratch rows are head_dim floats per query row; larger heads are untested and refused.
MAX_HEAD_DIM = 512
# Values of every entry point's `dtype` argument (wick_cpu.h: 0 fp32, 1 bf16), declared once for
# all the Python wrappers; the attention kernel's q, k, v and out are all of this type.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# Values of its `kv_format` (wick_kv.h) by cache dtype: a cache in q's dtype passes `dtype`.
_KV_FORMATS = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.int8: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
}
# Multiply-adds (~0.1-0.3 ms) worth another thread: smaller steps, e.g. a batch-1 decode, run on
# fewer threads than torch's instead of paying a fork/join (see the kernel's comment).
MIN_WORK_PER_THREAD = 1 << 20


@dataclass(frozen=True)
class NativeKernels:
    """A loaded build: the library and the ISA it was compiled for."""

    lib: ctypes.CDLL
    isa: str


def _cache_dirs() -> list[Path]:
    base = wick_cache_dir()  # --cache-dir, exported to WICK_CACHE_DIR by the entry points
    return [base / "kernels", Path(tempfile.gettempdir()) / "wick-kernels"]


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _build(cc: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile SOURCES into `target` atomically; returns an error text or None on success.
    Each source compiles to an object of its own, as many at once as this process may use
    CPUs, in SOURCES' order, then one link."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as scratch:
        objects = [Path(scratch) / f"{source.stem}.o" for source in SOURCES]
        jobs = list(zip(SOURCES, objects, strict=True))
        workers = min(len(jobs), len(os.sched_getaffinity(0)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            compiled = pool.map(
                lambda job: _run([cc, *flags, "-fPIC", "-std=c11", "-c", str(job[0]), "-o",
                                  str(job[1])]),
                jobs,
            )  # fmt: skip
            error = next((e for e in compiled if e is not None), None)
        if error is not None:
            return error
        linked = Path(scratch) / "wick_cpu.so"
        error = _run([cc, *flags, "-shared", *map(str, objects), "-o", str(linked), "-lm"])
        if error is not None:
            return error
        os.replace(linked, target)  # concurrent builders (TP ranks, servers) race harmlessly
    return None


def _run(cmd: list[str]) -> str | None:
    """One compiler call; the last line of its errors, or None on success."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    if proc.returncode != 0:
        return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"
    return None


def load_kernels(isa: str | None = None) -> NativeKernels | None:
    """The kernels for this CPU (or the `WICK_CPU_ISA` path; never a path the hardware lacks,
    whatever WICK_CPU_FLAGS says: isa.hardware_isas), built on first call per ISA;
    None when they cannot be built here (the reason is logged once). `isa` names one path
    exactly (tests; the caller checks that the CPU runs it), without lower fallbacks."""
    if isa is not None:
        return _load((next(i for i in ISAS if i.name == isa),))
    return _load(hardware_isas(choose_isas()))


def clear_cache() -> None:
    """Forget loaded builds (tests change the cache dir, the compiler or the ISA)."""
    _load.cache_clear()


@cache
def _load(isas: tuple[Isa, ...]) -> NativeKernels | None:
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler found (set CC): the native CPU kernels fall back to PyTorch")
        return None
    errors: list[str] = []
    for isa in isas:
        try:
            kernels = _load_isa(cc, isa, errors)
        except abi.AbiError as exc:
            # Not specific to an ISA: every build compiles the same headers.
            logger.error("native CPU kernels refused, falling back to PyTorch: %s", exc)
            return None
        if kernels is not None:
            if isa is not isas[0]:
                logger.warning(
                    "native CPU kernels: the %s build failed (%s); using %s",
                    isas[0].name,
                    "; ".join(errors),
                    isa.name,
                )
            return kernels
    logger.warning(
        "could not build the native CPU kernels (%s): falling back to PyTorch",
        "; ".join(errors),
    )
    return None


def _load_isa(cc: str, isa: Isa, errors: list[str]) -> NativeKernels | None:
    source = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    for threading in _THREADING:
        flags = (*_COMMON, *isa.cflags, *threading)
        key = hashlib.sha256(
            b"|".join([source, cc.encode(), isa.name.encode(), " ".join(flags).encode()])
        ).hexdigest()[:16]
        for directory in _cache_dirs():
            target = directory / f"wick_cpu-{isa.name}-{key}.so"
            if not target.is_file():
                start = time.perf_counter()
                try:
                    error = _build(cc, flags, target)
                except OSError as exc:  # unwritable cache directory: try the next one
                    errors.append(f"{directory}: {exc}")
                    continue
                if error is not None:
                    errors.append(f"{isa.name} {' '.join(flags)}: {error}")
                    break  # these flags fail with this compiler; try the next set
                logger.info(
                    "built the native CPU kernels (%s) in %.2fs",
                    " ".join(flags),
                    time.perf_counter() - start,
                )
            try:
                return NativeKernels(_bind(abi.BoundLibrary(str(target))), isa.name)
            except OSError as exc:
                errors.append(f"{target}: {exc}")
    return None


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Every entry point declared in wick_entry.h and wick_stack.h bound with its declared types
    (kernels/cpu/abi.py), and no other name callable; abi.AbiError when one is missing or a
    struct's layout differs."""
    return abi.bind(lib)


def unsupported_reason(q: torch.Tensor, k_cache: torch.Tensor, head_dim: int) -> str | None:
    """Why `paged_attention` cannot run these inputs, or None when it can."""
    if q.device.type != "cpu":
        return f"runs on the CPU only, not {q.device.type}"
    if q.dtype not in DTYPE_CODES:
        return f"dtype {q.dtype} is not supported (float32 and bfloat16 are)"
    if k_cache.dtype not in _KV_FORMATS or (
        k_cache.dtype == torch.float32 and q.dtype != torch.float32
    ):
        return (
            f"a {k_cache.dtype} KV cache under {q.dtype} queries is not supported (the query's "
            "dtype, bfloat16, int8 and float8 caches are)"
        )
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        return f"head_dim {head_dim} is not supported (1 to {MAX_HEAD_DIM} are)"
    if not k_cache.is_contiguous():
        return "the KV cache is not contiguous"
    return None


def _int32(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous int32 tensor: itself when it already is (the model runner's metadata),
    without a dispatcher call per layer."""
    if t.dtype == torch.int32 and t.is_contiguous():
        return t
    return t.to(torch.int32).contiguous()


def _token_rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, Hkv, D] in `dtype` with each token's Hkv * D values contiguous (token stride free):
    t itself for the views of the fused qkv projection, else a copy."""
    if t.dtype != dtype:
        t = t.to(dtype)
    if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        t = t.contiguous()
    return t


def paged_attention(
    kernels: NativeKernels,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    min_work_per_thread: int = MIN_WORK_PER_THREAD,
    *,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    kv_fixed_scale: float | None = None,
) -> torch.Tensor:
    """Causal paged attention for decodes and prefills alike, K/V read from the cache.

    q [T, H, D] fp32 or bf16; caches [num_blocks, block_size, Hkv, D] of q's dtype, bf16, or
    int8 / float8 codes with k_scales, v_scales [num_blocks, block_size, Hkv] float32
    (kernels/kv_cache_dtype.py: the store quantizes, reads dequantize); block_tables
    [B, >=nb] int; query_start_loc [B + 1] int (request i owns rows [qsl[i], qsl[i+1])); seq_lens
    [B] int, each >= its query count -> out [T, H, D] in q's dtype. With k, v [T, Hkv, D] (views
    with a token stride are read in place) and slot_mapping [T] int64, the step's K/V are first
    written into the caches at those slots (slots < 0 skipped); without, the caches must already
    hold them. See paged_attention.c for the contract; `unsupported_reason` must have said None.
    Up to torch's thread count run it, fewer for small steps (0 `min_work_per_thread`: all).
    With `sliding_window` W a query at position p sees keys in (p - W, p] (blocks wholly before
    that are never read); with `logits_soft_cap` c scaled scores s become c * tanh(s / c).
    `kv_fixed_scale` (quantized caches): the static scale every stored row takes instead of
    its own (kv_cache_dtype.quantize_kv's `fixed_scale`).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    q = q.contiguous()
    tables = _int32(block_tables)
    starts = _int32(query_start_loc)
    lens = _int32(seq_lens)
    if out is None:
        out = torch.empty_like(q)
    # The KV-cache store: pointers and token strides of k and v, the slots (NULL: no store).
    store: tuple[int | None, int | None, int, int, int | None] = (None, None, 0, 0, None)
    if k is not None:
        if v is None or slot_mapping is None:
            raise ValueError("paged attention: k needs v and slot_mapping")
        # The kernel converts or quantizes q-dtype rows itself.
        k, v = _token_rows(k, q.dtype), _token_rows(v, q.dtype)
        if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
            slot_mapping = slot_mapping.to(torch.int64).contiguous()
        store = (k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), slot_mapping.data_ptr())
    # Gemma 2/3 layers take the entry point with the window and the soft cap (0: off).
    # and a static KV scale: 0 turns each off.
    windowed: tuple[int, float, float] | tuple[()] = ()
    entry = kernels.lib.wick_paged_attention
    if sliding_window is not None or logits_soft_cap is not None or kv_fixed_scale is not None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"paged attention: sliding_window {sliding_window} must be >= 1")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"paged attention: logits_soft_cap {logits_soft_cap} must be > 0")
        if kv_fixed_scale is not None and not kv_fixed_scale > 0:
            raise ValueError(f"paged attention: kv_fixed_scale {kv_fixed_scale} must be > 0")
        windowed = (
            sliding_window or 0,
            float(logits_soft_cap or 0.0),
            float(kv_fixed_scale or 0.0),
        )
        entry = kernels.lib.wick_paged_attention_windowed
    kv_format = _KV_FORMATS[k_cache.dtype]
    scales: tuple[int | None, int | None] = (None, None)
    if kv_format >= 2:
        if k_scales is None or v_scales is None:
            raise ValueError(f"paged attention: a {k_cache.dtype} KV cache needs its scales")
        if k_scales.dtype != torch.float32 or not (
            k_scales.is_contiguous() and v_scales.is_contiguous()
        ):
            raise ValueError("paged attention: KV scales must be contiguous float32")
        scales = (k_scales.data_ptr(), v_scales.data_ptr())
    # ctypes drops the GIL for the call, so the HTTP event loop keeps running meanwhile.
    status = entry(
        DTYPE_CODES[q.dtype],
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        *store,
        num_blocks * block_size,
        tables.data_ptr(),
        tables.stride(0),
        starts.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        lens.shape[0],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        torch.get_num_threads(),
        min_work_per_thread,
        kv_format,
        *scales,
        *windowed,
    )
    if status == -2:
        raise ValueError("paged attention: a request has more query tokens than context")
    if status == -4:
        raise ValueError(f"paged attention: {k_cache.dtype} caches under {q.dtype} queries")
    if status == -3:
        raise IndexError(f"paged attention: a slot is past the cache's {num_blocks * block_size}")
    if status != 0:
        raise MemoryError("paged attention could not allocate its scratch buffers")
    return out


def paged_decode(
    kernels: NativeKernels,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per request: q [B, H, D], seq_lens [B] -> [B, H, D]."""
    starts = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_attention(kernels, q, k_cache, v_cache, block_tables, starts, seq_lens, scale)
