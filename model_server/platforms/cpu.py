"""CPU platform: PyTorch's CPU kernels (and kernels/cpu/ for matmuls), gloo for collectives."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import cache, partial

import torch

from model_server.config import KernelOptions
from model_server.kernels.cpu import native
from model_server.kernels.cpu.decoder_stack import CpuDecoderStack
from model_server.kernels.cpu.dtype_choice import dtype_figures, forced_auto_dtype
from model_server.kernels.cpu.experts_plan import install_expert_panels, plan_experts
from model_server.kernels.cpu.gguf_linear import fixed_gguf_linear, gguf_dequantize
from model_server.kernels.cpu.isa import cpu_flags as _cpu_flags
from model_server.kernels.cpu.layer_ops import native_kernel_table
from model_server.kernels.cpu.linear import int8_linear, skinny_linear
from model_server.kernels.cpu.linear_plan import planned_weights
from model_server.kernels.cpu.linear_tuning import tune_cpu_linears
from model_server.kernels.cpu.moe import (
    native_fused_experts,
    native_shared_expert_add,
    native_softmax_topk,
)
from model_server.kernels.cpu.moe_routing import native_grouped_topk
from model_server.kernels.cpu.onednn_cache import bound_onednn_caches
from model_server.kernels.cpu.tuning_cache import TuningCache, machine_identity
from model_server.kernels.cpu.varlen_attention import varlen_attention as native_varlen_attention
from model_server.kernels.cpu.wna16 import wna16_linear
from model_server.kernels.linear_sites import LinearSite
from model_server.kernels.planned_weight import LinearPlan
from model_server.kernels.stack_layer import NativeDecoderStep, StackLayer
from model_server.kernels.table import KernelTable
from model_server.platforms.interface import Platform

logger = logging.getLogger(__name__)

_DEFAULT_KV_CACHE_BYTES = 2 * 1024**3
# The matmuls of weights without a plan (all of them with --no-cpu-linear-tuning): the fixed
# MKL-friendly matmuls for decode's few rows and PyTorch's int8 weight-only kernel (kernels/cpu/
# linear.py). Norms, SiLU-and-mul and rotary run on the native C kernels (`_with_layer_ops`).
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
        # Without native bf16 (avx512_bf16 / AMX) torch's bf16 matmuls run 3-10x slower than
        # fp32 on CPUs: the flags alone say fp32 there (auto_dtype may measure otherwise).
        return torch.bfloat16 if _NATIVE_BF16_FLAGS & _cpu_flags() else torch.float32

    def auto_dtype(
        self,
        linear_shapes: Sequence[tuple[int, int, int]] = (),
        options: KernelOptions | None = None,
        checkpoint_dtype: torch.dtype | None = None,
    ) -> torch.dtype:
        """bf16 where the model's linears (`linear_shapes`) run faster in bf16 on this machine
        (kernels/cpu/dtype_choice.py, cached), or as --cpu-auto-dtype (`options.auto_dtype`)
        pins it; with tuning off or no shapes given, the flags alone decide (default_dtype).

        bf16 is a candidate on CPUs with native bf16, and on the others for a checkpoint stored
        in bf16 (`checkpoint_dtype`) where the native kernels built: their panels read its bf16
        weights and multiply in fp32, at half fp32's bytes, and a decode step is bound by the
        bytes (Zen 3, no AVX-512, the Llama-3.2-1B shape, one sitting: batch-1 decode 2.1x
        fp32's tok/s, prefill 0.88x; docs/benchmarks.md); the model runs as stored, nothing
        rounded. Anything else runs fp32 there, nothing measured."""
        on_flags = self.default_dtype()
        native_bf16 = on_flags == torch.bfloat16
        if not native_bf16 and not (
            checkpoint_dtype == torch.bfloat16 and native.load_kernels() is not None
        ):
            return torch.float32
        options = options or KernelOptions.resolve()
        bound_onednn_caches()  # before the first oneDNN matmul (the timings below may be it)
        forced = forced_auto_dtype(options.auto_dtype)
        if forced is not None:
            logger.info("dtype auto: %s (--cpu-auto-dtype)", forced)
            return forced
        if not linear_shapes or not options.linear_tuning:
            return on_flags
        measured = dtype_figures(linear_shapes, self._tuning_cache())
        why = "this CPU's native bf16" if native_bf16 else "the native panels' bf16 weights"
        if measured.busy:
            # One start once timed bf16 at 718 ms where a quiet machine gives 4 ms, and served
            # fp32: a busy machine's figures do not decide, the CPU's flags do.
            logger.warning(
                "dtype auto: %s on this CPU's flags; other processes kept the machine busy "
                "while the dtypes were timed (%s), so the figures decide nothing and are not "
                "cached: the next start times again",
                str(on_flags).removeprefix("torch."),
                measured.figures.describe(),
            )
            return on_flags
        dtype = torch.bfloat16 if measured.figures.bf16_wins else torch.float32
        logger.info(
            "dtype auto: %s, timed with %s (%s%s)",
            str(dtype).removeprefix("torch."),
            why,
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

    def kernel_table(self, options: KernelOptions | None = None) -> KernelTable:
        """One immutable table per native build and GGUF int8 mode (`options.gguf_int8_dot`):
        the fixed matmuls (for weights the plan does not name), the native norms, SiLU-and-mul
        and rotary (built on first call, like the attention's). What each weight runs is
        planned per model by `plan_linears`."""
        options = options or KernelOptions.resolve()
        return _fixed_table(native.load_kernels(), options.gguf_int8_dot)

    def plan_linears(
        self,
        kernels: KernelTable,
        sites: Sequence[LinearSite],
        dtype: torch.dtype,
        options: KernelOptions | None = None,
        gguf_beside_float: bool = False,
        row_invariant_rows: int = 0,
    ) -> LinearPlan:
        """Time the matmul candidates for the model's linear shapes on this CPU (or read the
        timings cached by an earlier start) within `options.tuning_budget_s` and plan each
        weight's kernel per row bucket; logs one line per shape. Nothing with
        --no-cpu-linear-tuning (the fixed table serves)."""
        options = options or KernelOptions.resolve()
        if not options.linear_tuning:
            return LinearPlan()
        built = native.load_kernels() is not None
        report, plans = tune_cpu_linears(
            sites,
            dtype,
            self._tuning_cache(),
            options.tuning_budget_s,
            int8_dot=options.gguf_int8_dot,
            quantized_kernels=built,
            blocks_beside_float=gguf_beside_float,
            row_invariant_rows=row_invariant_rows,
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
        if report.blocks_beside_bytes:
            logger.info(
                "GGUF blocks kept beside their float twins (--gguf-weights auto; faster at few "
                "rows): %.1f MiB",
                report.blocks_beside_bytes / 2**20,
            )
        if report.busy:
            logger.warning(
                "other processes used %.0f%% of the CPU while the matmuls were timed: the "
                "choice may be off, and is not cached (timed again at the next start)",
                100 * report.others_share,
            )
        for line in report.lines:
            logger.info("cpu linear %s", line)
        return LinearPlan(planned_weights(plans, kernels, dtype), tuple(report.lines))

    def plan_experts(
        self, model: torch.nn.Module, dtype: torch.dtype, options: KernelOptions | None = None
    ) -> str:
        """Float experts packed into panels where the experts' plan says they win
        (kernels/cpu/experts_plan.py); kept as loaded with --no-cpu-linear-tuning or no native
        build (the fixed table's kernels)."""
        options = options or KernelOptions.resolve()
        kernels = native.load_kernels()
        if not options.linear_tuning or kernels is None:
            return ""
        plan = plan_experts(dtype, kernels)
        changed = install_expert_panels(model, plan, kernels)
        return f"{changed} MoE layers' experts: {plan.reason}" if changed else ""

    def gguf_weights_layout(
        self, mode: str, options: KernelOptions, tp_size: int, dtype: torch.dtype
    ) -> str:
        """`mixed` where the plan can time blocks against floats (linear tuning on, the native
        kernels built) on one rank: the blocks on their float kernel win at few rows on some
        shapes (the Gemma 3 270M Q4_K_M file's LM head: 4.3 against 7.6 ms per decode token on
        a Zen 5), the float weights from a few rows on (README, GGUF section). Under tensor
        parallelism a rank's blocks may not split (`models/gguf_weights.py`). `auto` mixes in
        float32 only: there the twins hold the blocks' values exactly, while bf16 twins round
        them, so which rows ran on which would change a request's tokens with its batch."""
        if mode not in ("auto", "mixed") or not self.keeps_gguf_quantized:
            return super().gguf_weights_layout(mode, options, tp_size, dtype)
        why = None
        if tp_size > 1:
            why = "tensor parallelism (each rank's blocks would be split)"
        elif not options.linear_tuning:
            why = "--no-cpu-linear-tuning (nothing times the blocks against the floats)"
        elif native.load_kernels() is None:
            why = "the native kernels could not be built"
        if mode == "mixed":
            if why is not None:
                raise ValueError(f"--gguf-weights mixed is not supported with {why}")
            return "mixed"
        return "mixed" if why is None and dtype == torch.float32 else "dequantized"

    def int8_weights_layout(self, options: KernelOptions) -> str:
        """The wNa16 layout where the native kernels built: the native wNa16 kernel and the
        native decoder step then run the layers, and fp32 activations stay unrounded (the
        embedded model on the Zen 5 box: 1.68x bf16 and 1.71x fp32 at batch 1,
        docs/benchmarks.md); else "int8" (PyTorch's int8 kernel)."""
        return "wna16" if native.load_kernels() is not None else "int8"

    def native_decoder_step(
        self,
        layers: Sequence[StackLayer] | str,
        dtype: torch.dtype,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        options: KernelOptions | None = None,
    ) -> NativeDecoderStep | str:
        """kernels/cpu/decoder_stack.py where the native build loaded, linear tuning is on
        (`options`) and the layers qualify, else why not (logged once)."""
        options = options or KernelOptions.resolve()
        kernels = native.load_kernels()
        if kernels is None:
            return "the native CPU kernels could not be built (see the warning above)"
        if not options.linear_tuning:
            return "cpu linear tuning off (--no-cpu-linear-tuning): no planned native matmuls"
        return CpuDecoderStack.build(kernels, layers, dtype, all_reduce)

    def _tuning_cache(self) -> TuningCache:
        kernels = native.load_kernels()
        return TuningCache.open(machine_identity(_cpu_flags(), kernels.isa if kernels else None))


@cache
def _fixed_table(kernels: native.NativeKernels | None, int8_dot: str = "auto") -> KernelTable:
    """One table per build and GGUF int8 mode: every model shares it (and `is` compares it)."""
    return _with_layer_ops(_FIXED_CPU_KERNELS, kernels, int8_dot)


def _with_layer_ops(
    base: KernelTable, kernels: native.NativeKernels | None, int8_dot: str = "auto"
) -> KernelTable:
    """`base` with the native norms, SiLU-and-mul and rotary, the native GGUF matmuls and MoE
    routing and experts, or
    as it is (portable ops) after one warning when the library could not be built."""
    if kernels is None:
        _warn_no_layer_ops()
        return base
    gguf_linear = fixed_gguf_linear(int8_dot)
    base = replace(
        base,
        gguf_linear=gguf_linear,
        gguf_dequantize=gguf_dequantize,
        varlen_attention=partial(native_varlen_attention, kernels=kernels),
        # MoE layers on kernels/cpu/moe.c: the native decoder step runs the same calls
        moe_softmax_topk=partial(native_softmax_topk, kernels),
        moe_grouped_topk=partial(native_grouped_topk, kernels),
        fused_experts=partial(native_fused_experts, kernels),
        shared_expert_add=partial(native_shared_expert_add, kernels),
    )
    return native_kernel_table(kernels, base)


@cache
def _warn_no_layer_ops() -> None:
    logger.warning(
        "native CPU rms_norm, fused_add_rms_norm, silu_and_mul and rotary_embedding "
        "(kernels/cpu/layer_ops.c) are not used: the native kernels could not be built (see the "
        "warning above); the portable PyTorch ops run instead, which are slower"
    )
