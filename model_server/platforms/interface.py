"""The interface every device platform implements.

A platform module imports its vendor runtime (torch_gcu, habana_frameworks, ...) only inside
methods, never at import time: `import model_server.platforms.gcu` works on any machine, and
`check_available()` turns a missing runtime into one `PlatformUnavailable` naming what to install.
"""

from __future__ import annotations

import dataclasses
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Protocol

import torch

from model_server.config import EngineConfig, KernelOptions
from model_server.kernels.kv_cache_dtype import KVCacheDtype
from model_server.kernels.linear_sites import LinearSite
from model_server.kernels.planned_weight import LinearPlan
from model_server.kernels.stack_layer import NativeDecoderStep, StackLayer
from model_server.kernels.table import TORCH_KERNELS, KernelTable


class GraphCapturer(Protocol):
    """Records a function's device work once and replays it (engine/execution/cuda_graph.py
    drives it)."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Run `fn` under capture; return (replay, output). `replay()` reruns the recorded work,
        rewriting `output` in place from whatever the static inputs hold at that time."""
        ...


class PlatformUnavailable(ValueError):
    """The device was asked for but its runtime (package, driver or device) is missing."""


_DTYPE_ALIASES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "f16": torch.float16,  # candle-vllm's spelling (with bf16)
    "f32": torch.float32,
    "half": torch.float16,
}


# The torch.cuda-style allocator calls that memory profiling needs (torch.gcu mirrors them; recent
# Habana releases offer them in habana_frameworks.torch.hpu).
_PROFILING_CALLS = (
    "reset_peak_memory_stats",
    "max_memory_allocated",
    "memory_allocated",
    "memory_reserved",
)


class Platform(ABC):
    name: str
    device_type: str  # torch's device type string
    dist_backend: str  # torch.distributed backend for tensor collectives
    default_attention_backend: str = "torch"
    supports_graphs: bool = False
    # `--quantization` methods with a kernel here (layers/quantization/); others are refused.
    quantization_methods: tuple[str, ...] = ()
    # GGUF matrices can stay in their block layout here (`--gguf-weights quantized`): the kernel
    # table has a gguf_linear kernel worth running; elsewhere that choice is refused.
    keeps_gguf_quantized: bool = False
    # Quantized `--kv-cache-dtype` formats this platform's attention backends store and read
    # (float caches run everywhere); others are refused at startup.
    quantized_kv_cache_dtypes: tuple[str, ...] = ()
    # The vendor's variable that restricts which devices the runtime sees; None on CPU.
    visible_devices_env: str | None = None
    # Device memory is the host's RAM (CPU): sizes that assume accelerator memory shrink.
    shares_host_memory: bool = False
    # `--max-num-batched-tokens` when not given: the step's token budget. A burst of prompts
    # is prefilled this many tokens per step, first come first; a request's first token waits
    # for every step before its last chunk, so a budget larger than the device needs to run its
    # matmuls at full rate only delays first tokens.
    default_max_num_batched_tokens: int = 2048

    def with_defaults(self, config: EngineConfig) -> EngineConfig:
        """`config` with this platform's values in place of the settings left unset (None): the
        token budget. Every rank resolves it the same way (EngineCore, and remote workers that
        get the config as given)."""
        if config.max_num_batched_tokens is not None:
            return config
        return dataclasses.replace(
            config, max_num_batched_tokens=self.default_max_num_batched_tokens
        )

    def __init__(self) -> None:
        # Index of this process's device among the visible ones (None: the runtime's default).
        self.device_index: int | None = None

    # ---- availability -----------------------------------------------------------------------

    @classmethod
    def is_available(cls) -> bool:
        """Whether the runtime and at least one device are present (used by `auto`)."""
        try:
            cls.check_available()
        except PlatformUnavailable:
            return False
        return True

    @classmethod
    @abstractmethod
    def check_available(cls) -> None:
        """Raise PlatformUnavailable (saying what to install) unless the device can be used."""

    # ---- devices ----------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type, self.device_index)

    def set_device(self, index: int) -> None:
        """Bind this process to visible device `index` (one device per tensor-parallel rank)."""
        self.device_index = index

    def device_count(self) -> int:
        return 1

    def device_name(self) -> str | None:
        """The device's product name as its runtime reports it (e.g. "NVIDIA H100 80GB HBM3");
        None where there is none."""
        return None

    def visible_device_ids(self) -> list[str] | None:
        """The vendor's visible-devices list (e.g. CUDA_VISIBLE_DEVICES=2,3), None when unset."""
        if self.visible_devices_env is None:
            return None
        value = os.environ.get(self.visible_devices_env, "").strip()
        return [v.strip() for v in value.split(",") if v.strip()] if value else None

    def select_device(self, local_rank: int, device_ids: Sequence[int] | None) -> None:
        """Bind local rank `local_rank` to `device_ids[local_rank]` (default: `local_rank`).

        Ids index the devices the runtime sees, i.e. after the visible-devices variable.
        """
        index = device_ids[local_rank] if device_ids else local_rank
        count = self.device_count()
        if not 0 <= index < count:
            visible = self.visible_device_ids()
            seen = f" ({self.visible_devices_env}={','.join(visible)})" if visible else ""
            raise ValueError(
                f"{self.name} device {index} does not exist: {count} visible{seen}; "
                "check --device-ids and --tensor-parallel-size"
            )
        self.set_device(index)

    # ---- dtypes and memory ------------------------------------------------------------------

    @abstractmethod
    def supported_dtypes(self) -> list[torch.dtype]: ...

    @abstractmethod
    def default_dtype(self) -> torch.dtype: ...

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        raise NotImplementedError(f"{self.name} has no device memory query")

    def default_kv_cache_memory(self, bytes_per_block: int) -> int:
        """Bytes for the KV cache when the user gives no `--kv-cache-memory` and the platform
        cannot profile memory (where it can, engine/execution/memory_profiler.py sizes the cache).

        This fallback, for accelerator runtimes without allocator statistics, is a guess: 80%
        of the memory free now, after the weights loaded."""
        free, _ = self.mem_get_info()
        return int(free * 0.8)

    # ---- memory profiling -------------------------------------------------------------------

    def memory_stats_api(self) -> ModuleType | None:
        """The torch.cuda-like namespace with this device's allocator statistics (torch.cuda,
        torch.gcu, habana_frameworks.torch.hpu), or None where there is none (CPU)."""
        return None

    def can_profile_memory(self) -> bool:
        """Whether the KV cache can be sized by profiling a forward pass: the namespace offers
        every call below and `mem_get_info` works."""
        api = self.memory_stats_api()
        return api is not None and all(callable(getattr(api, n, None)) for n in _PROFILING_CALLS)

    def reset_peak_memory_stats(self) -> None:
        """Restart `max_memory_allocated` from the memory allocated now."""
        self._memory_api().reset_peak_memory_stats(self.device)

    def max_memory_allocated(self) -> int:
        """Peak bytes held by tensors since the last `reset_peak_memory_stats`."""
        return int(self._memory_api().max_memory_allocated(self.device))

    def memory_allocated(self) -> int:
        """Bytes held by tensors now."""
        return int(self._memory_api().memory_allocated(self.device))

    def memory_reserved(self) -> int:
        """Bytes torch's caching allocator holds from the device (tensors plus its cache)."""
        return int(self._memory_api().memory_reserved(self.device))

    def empty_cache(self) -> None:
        """Give the allocator's cached, unused blocks back to the device (no-op without one)."""
        api = self.memory_stats_api()
        empty = getattr(api, "empty_cache", None) if api is not None else None
        if callable(empty):
            empty()

    def _memory_api(self) -> ModuleType:
        api = self.memory_stats_api()
        if api is None:
            raise NotImplementedError(f"{self.name} has no allocator statistics")
        return api

    def allocate_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Zeroed memory for the KV cache. It must be zeros, not garbage: slots past a sequence's
        length are masked out of the softmax, but NaN bits there would still poison probs @ V."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    # ---- execution --------------------------------------------------------------------------

    def synchronize(self) -> None:
        return None

    def graph_capturer(self) -> GraphCapturer:
        """What records and replays device graphs (engine/execution/cuda_graph.py); only called when
        `supports_graphs`."""
        raise NotImplementedError(f"{self.name} cannot capture device graphs")

    def mark_step(self) -> None:
        """Called by every rank at the end of each model step (HPU lazy mode flushes its graph)."""
        return None

    def prepare(self, num_threads: int | None, local_world_size: int = 1) -> None:
        """Process-wide setup before the model loads (threads, allocator, runtime import).

        `local_world_size`: how many tensor-parallel ranks share this machine's CPU cores.
        """
        return None

    def kernel_table(self, options: KernelOptions | None = None) -> KernelTable:
        """The kernels this platform's models run (the model builder hands them to every layer);
        the portable PyTorch ones unless the platform has better. Imports what they need (triton
        on CUDA), so call it in the process that builds the model. `options`: the model's
        resolved kernel settings (`ResolvedModelConfig.kernel_options`; None: from the WICK_*
        variables, for callers outside the model-preparation stage)."""
        return TORCH_KERNELS

    def plan_linears(
        self,
        kernels: KernelTable,
        sites: Sequence[LinearSite],
        dtype: torch.dtype,
        options: KernelOptions | None = None,
        gguf_beside_float: bool = False,
        row_invariant_rows: int = 0,
    ) -> LinearPlan:
        """The kernels the loaded model's linear weights (`sites`; activations in `dtype`) run on
        this machine, per row bucket, as planned weights for the model-preparation stage to
        install (kernels/planned_weight.py); `kernels` is the table this platform's
        `kernel_table()` made; `options` the model's kernel settings (tuning on or off, its
        budget, the GGUF int8 mode; None: from the variables); `gguf_beside_float`: GGUF
        weights get float twins (`gguf_weights_layout` said "mixed"); `row_invariant_rows`: a
        row's output must not depend on the row count up to that many rows (speculative
        verification, engine/spec_decode/row_invariance.py). Changes nothing itself.
        None planned by default: every weight runs the table's slot."""
        return LinearPlan()

    def plan_experts(
        self, model: torch.nn.Module, dtype: torch.dtype, options: KernelOptions | None = None
    ) -> str:
        """Lay the loaded model's stacked float MoE experts out for this machine's kernels,
        once (the platform's experts plan; the modules and a native step then read the same
        holders), and say how; "" where nothing changed (the default: kept as loaded)."""
        return ""

    def int8_weights_layout(self, options: KernelOptions) -> str:
        """How `-q int8` weights are held: "int8" (`Int8Weight`, the table's `int8_linear`)
        or "wna16" (the same values as 8-bit wNa16 codes, for native wNa16 kernels)."""
        return "int8"

    def native_decoder_step(
        self,
        layers: Sequence[StackLayer] | str,
        dtype: torch.dtype,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        options: KernelOptions | None = None,
    ) -> NativeDecoderStep | str:
        """The model's decoder layers in one native call per step (`layers`: the model's
        description of them, or why it has none; under tensor parallelism one call per half
        layer, `all_reduce` summing each half's output over the ranks in between), or why the
        modules run instead. Call after `plan_linears`' weights are installed."""
        return f"the {self.name} platform has no native decoder step"

    def init_distributed_backend(self) -> None:
        """Import whatever registers `dist_backend` with torch.distributed (eccl, hccl)."""
        return None

    @classmethod
    def compute_units(cls, device: torch.device) -> int | None:
        """Streaming multiprocessors (or the device's equivalent) of `device`; None: unknown."""
        return None

    def check_quantization(self, method: str | None) -> None:
        """ValueError when `method` (a parsed `--quantization`) has no kernel on this platform."""
        if method is not None and method not in self.quantization_methods:
            have = ", ".join(self.quantization_methods) or "none"
            raise ValueError(
                f"quantization {method} is not supported on {self.name} (supported: {have})"
            )

    def gguf_weights_layout(
        self, mode: str, options: KernelOptions, tp_size: int, dtype: torch.dtype
    ) -> str:
        """How a GGUF's quantized matrices load for `--gguf-weights mode` (auto | quantized |
        dequantized | mixed) under activations in `dtype`: "quantized" (kept in their blocks),
        "dequantized" (float weights) or "mixed" (kept, each beside its float twin:
        `plan_linears` runs the faster of the two per row count); ValueError for a mode that
        keeps blocks where no kernel runs them. Here `auto` dequantizes; a platform whose plan
        times blocks against floats may mix."""
        if mode in ("quantized", "mixed") and not self.keeps_gguf_quantized:
            raise ValueError(
                f"--gguf-weights {mode} is not supported on {self.name} (cpu only); use "
                "auto or dequantized to load the GGUF as float weights"
            )
        if mode == "mixed":
            raise ValueError(f"--gguf-weights mixed is not supported on {self.name}")
        return "quantized" if mode == "quantized" else "dequantized"

    def check_kv_cache_dtype(self, kv_dtype: KVCacheDtype) -> None:
        """ValueError when this platform cannot run a quantized `--kv-cache-dtype`."""
        if kv_dtype.quantized and kv_dtype.name not in self.quantized_kv_cache_dtypes:
            have = ", ".join(self.quantized_kv_cache_dtypes) or "none"
            raise ValueError(
                f"kv_cache_dtype {kv_dtype.name} is not supported on {self.name} (quantized "
                f"caches supported: {have}; float caches: auto, bfloat16, float16)"
            )

    def auto_dtype(
        self,
        linear_shapes: Sequence[tuple[int, int, int]] = (),
        options: KernelOptions | None = None,
        checkpoint_dtype: torch.dtype | None = None,
    ) -> torch.dtype:
        """What `--dtype auto` means for a model whose linear weights are `linear_shapes`
        ((N, K, how many layers), possibly empty), stored as `checkpoint_dtype` (the float dtype
        of a checkpoint's weights; None: quantized or unknown): `default_dtype()` unless the
        platform measures (as `options` say: CPU's --cpu-auto-dtype; None: from the
        variables)."""
        return self.default_dtype()

    def resolve_dtype(
        self,
        name: str,
        linear_shapes: Sequence[tuple[int, int, int]] = (),
        options: KernelOptions | None = None,
        checkpoint_dtype: torch.dtype | None = None,
    ) -> torch.dtype:
        if name in ("auto", "", None):
            return self.auto_dtype(linear_shapes, options, checkpoint_dtype)
        if name not in _DTYPE_ALIASES:
            raise ValueError(f"unknown dtype {name!r}; choose auto, float32, bfloat16 or float16")
        dtype = _DTYPE_ALIASES[name]
        if dtype not in self.supported_dtypes():
            raise ValueError(f"dtype {name} is not supported on {self.name}")
        return dtype
