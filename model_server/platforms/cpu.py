"""CPU platform: PyTorch's CPU kernels (and kernels/cpu/ for matmuls), gloo for collectives."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from functools import cache

import torch

from model_server.kernels.cpu import native
from model_server.kernels.cpu.decoder_stack import CpuDecoderStack
from model_server.kernels.cpu.dtype_choice import dtype_figures, forced_auto_dtype
from model_server.kernels.cpu.gguf_linear import fixed_gguf_linear, gguf_dequantize, int8_dot_mode
from model_server.kernels.cpu.isa import cpu_flags as _cpu_flags
from model_server.kernels.cpu.layer_ops import native_kernel_table
from model_server.kernels.cpu.linear import int8_linear, skinny_linear
from model_server.kernels.cpu.linear_tuning import (
    CpuGGUFLinear,
    CpuInt8Linear,
    CpuLinear,
    CpuWNA16Linear,
    tune_cpu_linears,
    tuning_enabled,
)
from model_server.kernels.cpu.onednn_cache import bound_onednn_caches
from model_server.kernels.cpu.tuning_cache import TuningCache, machine_identity
from model_server.kernels.cpu.wna16 import wna16_linear
from model_server.kernels.linear_sites import LinearSite
from model_server.kernels.table import KernelTable
from model_server.platforms.interface import Platform

logger = logging.getLogger(__name__)

_DEFAULT_KV_CACHE_BYTES = 2 * 1024**3
# With tuning off (WICK_CPU_LINEAR_TUNING=0): the fixed MKL-friendly matmuls for decode's few
# rows and PyTorch's int8 weight-only kernel (kernels/cpu/linear.py). Norms, SiLU-and-mul and
# rotary run on the native C kernels either way (`_with_layer_ops`).
_FIXED_CPU_KERNELS = KernelTable(
    linear=skinny_linear, int8_linear=int8_linear, wna16_linear=wna16_linear
)
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    default_attention_backend = "cpu"
    quantization_methods = ("int8", "gptq", "awq")
    keeps_gguf_quantized = True  # kernels/cpu/gguf_gemm.c
    quantized_kv_cache_dtypes = ("int8", "fp8_e4m3", "fp8_e5m2")
    shares_host_memory = True
    # A CPU's matmuls reach their full rate well below 512 rows: 16 and 64 streams served the
    # same tok/s at 512 as at 2048 (docs/benchmarks.md, "The CPU token budget"). A 2048-token
    # step takes 1.5 s on a 2-core box, so 16 prompts arriving together got their first token
    # after 1.43 s (median) at 2048 and 0.69 s at 512. Below 512 the step's decodes eat the
    # budget's prefill share under load (64 streams: 1.45 s at 256 against 1.22 s at 512).
    default_max_num_batched_tokens = 512

    @classmethod
    def check_available(cls) -> None:
        return None  # always

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def mem_get_info(self) -> tuple[int, int]:
        pages = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * pages, os.sysconf("SC_PHYS_PAGES") * pages

    def default_dtype(self) -> torch.dtype:
        # Without native bf16 (avx512_bf16 / AMX) bf16 runs 3-10x slower than fp32 on CPUs.
        return torch.bfloat16 if _NATIVE_BF16_FLAGS & _cpu_flags() else torch.float32

    def auto_dtype(self, linear_shapes: Sequence[tuple[int, int, int]] = ()) -> torch.dtype:
        """fp32 without native bf16 (nothing measured); with it, bf16 only where the model's
        linears (`linear_shapes`) run faster in bf16 on this machine (kernels/cpu/
        dtype_choice.py, cached), or as WICK_CPU_AUTO_DTYPE says. With tuning off or no shapes
        given: bf16 on the flags alone."""
        if self.default_dtype() != torch.bfloat16:
            return torch.float32
        bound_onednn_caches()  # before the first oneDNN matmul (the timings below may be it)
        forced = forced_auto_dtype()
        if forced is not None:
            logger.info("dtype auto: %s (%s)", forced, "WICK_CPU_AUTO_DTYPE")
            return forced
        if not linear_shapes or not tuning_enabled():
            return torch.bfloat16
        measured = dtype_figures(linear_shapes, self._tuning_cache())
        if measured.busy:
            # One start once timed bf16 at 718 ms where a quiet machine gives 4 ms, and served
            # fp32: a busy machine's figures do not decide, the CPU's native bf16 does.
            logger.warning(
                "dtype auto: bfloat16 on this CPU's native bf16 flags; other processes kept "
                "the machine busy while the dtypes were timed (%s), so the figures decide "
                "nothing and are not cached: the next start times again",
                measured.figures.describe(),
            )
            return torch.bfloat16
        dtype = torch.bfloat16 if measured.figures.bf16_wins else torch.float32
        logger.info(
            "dtype auto: %s on this CPU's native bf16 (%s%s)",
            str(dtype).removeprefix("torch."),
            measured.figures.describe(),
            ", cached" if measured.cached else "",
        )
        return dtype

    def default_kv_cache_memory(self, bytes_per_block: int) -> int:
        return _DEFAULT_KV_CACHE_BYTES

    def allocate_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # Zeroed and faulted in now (torch.zeros writes every page), not lazily (calloc): the
        # prefix cache's LRU hands out every never-used block before it evicts a cached one, so
        # under traffic a lazy pool was faulted in block by block and the resident size crept up
        # for hours until the whole --kv-cache-memory was in (+150 MiB over a 20-minute soak,
        # docs/benchmarks.md#soak); and a pool larger than the machine could hold failed as an
        # OOM kill mid-traffic instead of at start. Costs 2-4 s per 2 GiB at start (2-core VM).
        return torch.zeros(shape, dtype=dtype)

    def select_device(self, local_rank: int, device_ids: Sequence[int] | None) -> None:
        return None  # every rank computes on the host's cores (see prepare)

    def prepare(self, num_threads: int | None, local_world_size: int = 1) -> None:
        # Tensor-parallel ranks on one machine share its cores: each gets an equal part.
        threads = num_threads or max(1, len(os.sched_getaffinity(0)) // local_world_size)
        torch.set_num_threads(threads)
        # Before any matmul: oneDNN's per-shape caches otherwise grow to about 1 GB under a
        # server's ever-new prefill row counts (kernels/cpu/onednn_cache.py).
        bound_onednn_caches()

    def kernel_table(self) -> KernelTable:
        """A fresh table per model: its matmuls are fitted to that model's weights by
        `tune_kernels` (one shared fixed table with WICK_CPU_LINEAR_TUNING=0). Norms, SiLU-and-
        mul and rotary are the native C kernels (built on first call, like the attention's)."""
        kernels = native.load_kernels()
        int8_dot = int8_dot_mode()  # GGUF blocks: may x be rounded to int8 (gguf_linear.py)
        if not tuning_enabled():
            return _fixed_table(kernels, int8_dot)
        linear = CpuLinear()
        table = _with_layer_ops(
            KernelTable(
                linear=linear,
                linear_silu_and_mul=linear.linear_silu_and_mul,
                int8_linear=CpuInt8Linear(),
                wna16_linear=CpuWNA16Linear(),
            ),
            kernels,
            int8_dot,
        )
        if kernels is not None:  # GGUF blocks have native kernels to choose from
            table = replace(table, gguf_linear=CpuGGUFLinear(int8_dot))
            table = replace(
                table, decoder_stack=CpuDecoderStack(kernels, linear, table.gguf_linear)
            )
        return table

    def tune_kernels(
        self, kernels: KernelTable, sites: Sequence[LinearSite], dtype: torch.dtype
    ) -> None:
        """Time the matmul candidates for the model's linear shapes on this CPU (or read the
        timings cached by an earlier start) and set the table's choices; logs one line per
        shape."""
        if not isinstance(kernels.linear, CpuLinear) or not isinstance(
            kernels.int8_linear, CpuInt8Linear
        ):
            return  # the fixed table (tuning off) or a table from elsewhere
        wna16, gguf = kernels.wna16_linear, kernels.gguf_linear
        report = tune_cpu_linears(
            sites,
            dtype,
            kernels.linear,
            kernels.int8_linear,
            self._tuning_cache(),
            wna16=wna16 if isinstance(wna16, CpuWNA16Linear) else None,
            gguf=gguf if isinstance(gguf, CpuGGUFLinear) else None,
        )
        logger.info(
            "cpu linear kernels for %d shapes: %d timed in %.2fs, %d cached%s",
            report.timed + report.cached,
            report.timed,
            report.seconds,
            report.cached,
            f"; packed copies beside shared weights: {report.extra_bytes / 2**20:.1f} MiB"
            if report.extra_bytes
            else "",
        )
        if report.busy:
            logger.warning(
                "other processes used %.0f%% of the CPU while the matmuls were timed: the "
                "choice may be off, and is not cached (timed again at the next start)",
                100 * report.others_share,
            )
        for line in report.lines:
            logger.info("cpu linear %s", line)

    def _tuning_cache(self) -> TuningCache:
        return TuningCache.open(machine_identity(_cpu_flags()))


@cache
def _fixed_table(kernels: native.NativeKernels | None, int8_dot: str = "auto") -> KernelTable:
    """One table per build: every model with tuning off shares it (and `is` compares it)."""
    return _with_layer_ops(_FIXED_CPU_KERNELS, kernels, int8_dot)


def _with_layer_ops(
    base: KernelTable, kernels: native.NativeKernels | None, int8_dot: str = "auto"
) -> KernelTable:
    """`base` with the native norms, SiLU-and-mul and rotary, and the native GGUF matmuls, or
    as it is (portable ops) after one warning when the library could not be built."""
    if kernels is None:
        _warn_no_layer_ops()
        return base
    gguf_linear = fixed_gguf_linear(int8_dot)
    base = replace(base, gguf_linear=gguf_linear, gguf_dequantize=gguf_dequantize)
    return native_kernel_table(kernels, base)


@cache
def _warn_no_layer_ops() -> None:
    logger.warning(
        "native CPU rms_norm, fused_add_rms_norm, silu_and_mul and rotary_embedding "
        "(kernels/cpu/layer_ops.c) are not used: the native kernels could not be built (see the "
        "warning above); the portable PyTorch ops run instead, which are slower"
    )
