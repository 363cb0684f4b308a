"""The model-preparation stage: everything between an engine config and a model ready to run.

1. `resolve_model_config`: the config's model decisions made once, on rank 0 (`--dtype auto`
   from the built model's own linear shapes, MoE experts and latent projections included; the
   KV cache dtype, the quantization, GGUF blocks kept or not, the attention backend, the
   context length, the kernel settings: --cpu-linear-tuning and its budget, --cpu-auto-dtype,
   --gguf-int8-dot, each from its flag or else its WICK_* variable), frozen and broadcast to the
   other tensor-parallel ranks, so every rank runs the same plan. The kernel settings reach
   the platform as a value (`KernelOptions`), never read from the environment further down.
2. `prepare_model`: build -> load -> quantize -> the platform plans the linear layers
   (`Platform.plan_linears`: a kernel per row bucket, packed weights) -> the planned weights
   are installed -> the platform says whether the decoder layers run in one native call
   (`Platform.native_decoder_step`, with why not). The result, `PreparedModel`, is what the
   model runner runs; `describe()` prints it (`wick plan`, `serve --print-plan`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model_server.config import EngineConfig, KernelOptions, SpeculativeConfig, parse_quantization
from model_server.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    tensor_model_parallel_all_reduce,
)
from model_server.engine.execution.kernel_tuning import config_linear_shapes, linear_sites
from model_server.engine.execution.kv_cache_groups import KVCacheGroups, kv_cache_groups
from model_server.engine.execution.memory_profiler import MemorySnapshot, take_memory_snapshot
from model_server.engine.spec_decode.row_invariance import verification_rows
from model_server.kernels.kv_cache_dtype import KVCacheDtype, resolve_kv_cache_dtype
from model_server.kernels.planned_weight import LinearPlan
from model_server.kernels.stack_layer import NativeDecoderStep
from model_server.layers.attention import get_attention_backend
from model_server.layers.attention.layer import Attention
from model_server.layers.embedding import ParallelLMHead
from model_server.layers.fused_moe import FusedMoE
from model_server.layers.linear import LinearBase
from model_server.layers.quantization.wna16 import (
    WNA16Config,
    checkpoint_quantization,
    resolve_quantization,
)
from model_server.loader import ModelSource
from model_server.loader.hf_loader import config_dtype
from model_server.models.gguf_weights import GGUFWeightCollector
from model_server.models.quantization import (
    model_quantization,
    process_weights_after_loading,
    quantize_model,
)
from model_server.models.registry import build_model, init_dummy_weights
from model_server.platforms import Platform
from model_server.settings_spec import KV_SCALES_DTYPES, read_kv_cache_scales

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class ResolvedModelConfig:
    """The engine config's model decisions, made once on rank 0 and the same on every rank."""

    dtype: torch.dtype
    dtype_reason: str  # "given", or what `auto` weighed
    kv_cache_dtype: str  # the --kv-cache-dtype name (resolve_kv_cache_dtype reads it)
    # --quantization-param-path: per TP rank, each layer's static KV scale; None: per row.
    kv_cache_scales: tuple[tuple[float, ...], ...] | None
    quantization: str | None  # int8 at load, or a checkpoint format checked
    # GGUF matrices: "quantized" (kept in their blocks), "dequantized" or "mixed" (kept, each
    # beside its float twin; the plan runs the faster per row count): gguf_weights_layout.
    gguf_layout: str
    # How -q int8 weights are held: "int8" (Int8Weight) or "wna16" (8-bit wNa16 codes, for a
    # platform whose native wNa16 kernels and decoder step run them): int8_weights_layout.
    int8_layout: str
    attention_backend: str
    max_model_len: int
    max_model_len_given: bool
    kernel_options: KernelOptions  # the platform's kernel_table / plan_linears / ... take it

    def kv_dtype(self) -> KVCacheDtype:
        return resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype)


def model_linear_shapes(model: nn.Module, experts: bool = True) -> list[tuple[int, int, int]]:
    """(N, K, count) of every matmul weight the built model holds on this rank: the linear
    layers and the LM head, each MoE expert (one matrix per expert; `experts` False leaves
    them out), the latent projections (they are linear layers). Works on a model built on the
    meta device, and on planned weights."""
    counts: Counter[tuple[int, int]] = Counter()
    for module in model.modules():
        if isinstance(module, LinearBase | ParallelLMHead):
            shape = getattr(module.weight, "shape", None)
            if shape is not None and len(shape) == 2:
                counts[(int(shape[0]), int(shape[1]))] += 1
        elif experts and isinstance(module, FusedMoE):
            for param in module.parameters(recurse=False):
                if param.dim() == 3:
                    counts[(int(param.shape[1]), int(param.shape[2]))] += int(param.shape[0])
    return [(n, k, count) for (n, k), count in counts.items()]


def _auto_dtype_shapes(
    config: EngineConfig, source: ModelSource, platform: Platform, options: KernelOptions
) -> Any:
    """The built model's linear shapes, from a model built on the meta device (no memory, no
    weights); the config's Llama-formula shapes where a family cannot build there."""
    try:
        model = build_model(
            source.hf_config,
            get_attention_backend(config.attention_backend or platform.default_attention_backend),
            dtype=torch.float32,
            device=torch.device("meta"),
            max_model_len=config.max_model_len or source.context_length,
            kernels=platform.kernel_table(options),
        )
        return model_linear_shapes(model)
    except Exception as exc:  # a family whose construction computes on its tensors
        logger.debug("dtype auto: the model does not build on the meta device (%s)", exc)
        return config_linear_shapes(source.hf_config, get_tensor_model_parallel_world_size())


def _checkpoint_dtype(source: ModelSource) -> torch.dtype | None:
    """The float dtype the checkpoint's weights are stored in; None for a quantized one (GPTQ,
    AWQ, compressed tensors, a GGUF with quantized blocks) or where the config names none."""
    if checkpoint_quantization(source.hf_config) is not None:
        return None
    stored = config_dtype(source.hf_config)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if isinstance(stored, torch.dtype) else None


def _resolve_here(
    config: EngineConfig, source: ModelSource, platform: Platform
) -> ResolvedModelConfig:
    options = config.kernel_options()
    if config.dtype in ("auto", "", None):
        shapes = _auto_dtype_shapes(config, source, platform, options)
        stored = _checkpoint_dtype(source) if config.quantization is None else None
        dtype = platform.resolve_dtype("auto", shapes, options, stored)
        matrices = sum(count for _, _, count in shapes)
        reason = (
            f"auto, for the model's {matrices} matrices of {len(shapes)} shapes on {platform.name}"
        )
    else:
        dtype, reason = platform.resolve_dtype(config.dtype), "given"
    checkpoint = checkpoint_quantization(source.hf_config)
    quantization = resolve_quantization(parse_quantization(config.quantization), checkpoint)
    gguf_layout = platform.gguf_weights_layout(
        config.gguf_weights, options, get_tensor_model_parallel_world_size(), dtype
    )
    if gguf_layout == "mixed" and quantization is not None:
        if config.gguf_weights == "mixed":
            raise ValueError("--gguf-weights mixed keeps GGUF blocks: -q int8 takes float weights")
        gguf_layout = "dequantized"  # -q int8 quantizes float weights at load
    return ResolvedModelConfig(
        dtype=dtype,
        dtype_reason=reason,
        kv_cache_dtype=config.kv_cache_dtype,
        kv_cache_scales=_kv_cache_scales(config, get_tensor_model_parallel_world_size()),
        quantization=quantization,
        gguf_layout=gguf_layout,
        int8_layout=platform.int8_weights_layout(options),
        attention_backend=config.attention_backend or platform.default_attention_backend,
        max_model_len=config.max_model_len or source.context_length,
        max_model_len_given=config.max_model_len is not None,
        kernel_options=options,
    )


def _kv_cache_scales(config: EngineConfig, tp_size: int) -> tuple[tuple[float, ...], ...] | None:
    """The --quantization-param-path file's scales per rank, checked against the cache dtype and
    the rank count (the layer count once the model is built)."""
    path = config.quantization_param_path
    if not path:
        return None
    dtype, scales = read_kv_cache_scales(path)
    want = KV_SCALES_DTYPES[dtype]
    if config.kv_cache_dtype != want:
        raise ValueError(
            f"--quantization-param-path {path}: its scales are for {dtype} KV caches; serve "
            f"with --kv-cache-dtype {want} (not {config.kv_cache_dtype})"
        )
    if len(scales) != tp_size:
        raise ValueError(
            f"--quantization-param-path {path}: scales for {len(scales)} tensor-parallel "
            f"rank(s), but the engine runs {tp_size}"
        )
    return tuple(
        tuple(layers[i] for i in range(len(layers))) for _, layers in sorted(scales.items())
    )


def resolve_model_config(
    config: EngineConfig, source: ModelSource, platform: Platform
) -> ResolvedModelConfig:
    """Rank 0 resolves (the others wait for its answer over the CPU group): one decision per
    engine, never one per rank timed under different loads."""
    group = get_tp_group()
    if group is None or group.world_size == 1:
        return _resolve_here(config, source, platform)
    box: list[Any] = [None]
    if group.is_driver:
        try:
            box[0] = _resolve_here(config, source, platform)
        except Exception as exc:  # every rank raises it, none waits for an answer
            box[0] = exc
    torch.distributed.broadcast_object_list(box, src=0, group=group.cpu_group)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def _check(
    resolved: ResolvedModelConfig, platform: Platform, checkpoint: WNA16Config | None
) -> KVCacheDtype:
    """What is refused before minutes of loading."""
    kv_dtype = resolved.kv_dtype()
    platform.check_kv_cache_dtype(kv_dtype)
    platform.check_quantization(resolved.quantization)
    if checkpoint is not None:
        platform.check_quantization(checkpoint.method)
    if (
        resolved.attention_backend == "triton"
        and platform.name == "cpu"
        and os.environ.get("TRITON_INTERPRET") != "1"
    ):
        # Triton has no CPU driver, and its first launch would fail deep in the warmup with
        # "0 active drivers".
        raise ValueError(
            "--attention-backend triton runs Triton kernels, which need a CUDA or GCU "
            "device; on the CPU use --attention-backend cpu or torch (TRITON_INTERPRET=1 "
            "runs the kernels interpreted, for tests)"
        )
    return kv_dtype


@dataclass(slots=True)
class PreparedModel:
    """A model built, loaded, quantized and planned: what the model runner runs."""

    config: EngineConfig  # as given, with max_model_len resolved
    resolved: ResolvedModelConfig
    model: nn.Module
    kv_dtype: KVCacheDtype
    linear_plan: LinearPlan
    # The decoder layers in one native call per step (None: the modules run), and why not.
    native_step: NativeDecoderStep | None
    native_reason: str
    quantization_description: str | None  # "gptq w4 g128", "int8"; None: float
    gguf_kept: str  # "Q4_K x210, ..." for the log
    load_seconds: float
    hf_config: Any
    # Device memory in use before the weights loaded (memory_profiler.py); None where memory
    # cannot be profiled.
    memory_baseline: MemorySnapshot | None
    kv_groups: KVCacheGroups  # which layers share a KV cache pool
    # This rank's static KV scale per layer (--quantization-param-path); None: per row.
    kv_fixed_scales: tuple[float, ...] | None = None
    source_path: str = ""

    def describe(self) -> str:
        """The plan, for people: `wick plan` and `serve --print-plan` print it."""
        r = self.resolved
        arch = self.hf_config.architectures[0]
        lines = [
            f"model: {self.source_path} ({arch})",
            f"dtype: {str(r.dtype).removeprefix('torch.')} ({r.dtype_reason})",
            f"kv cache dtype: {self.kv_dtype.name}",
            f"weights: {self.quantization_description or 'float'}"
            + (f", GGUF matrices kept ({self.gguf_kept})" if self.gguf_kept else "")
            + (
                ", each beside its float twin"
                if self.gguf_kept and r.gguf_layout == "mixed"
                else ""
            ),
            f"attention backend: {r.attention_backend}",
            f"kernel settings: {r.kernel_options.describe()}",
            f"max model len: {r.max_model_len}",
            "decoder layers: "
            + (
                "module by module"
                if self.native_step is None
                else self.native_step.row_coverage(self.config.max_num_batched_tokens or 1)
            )
            + (f" ({self.native_reason})" if self.native_reason else ""),
            f"linear kernels by shape ({len(self.linear_plan.lines)}):",
            *(f"  {line}" for line in self.linear_plan.lines),
            f"planned weights ({len(self.linear_plan.weights)}):",
            *(
                f"  {name}: {weight.extra_repr()}"
                for name, weight in self.linear_plan.weights.items()
            ),
        ]
        return "\n".join(lines)


def group_kv_layers(model: nn.Module, config: EngineConfig) -> KVCacheGroups:
    """The KV cache groups (kv_cache_groups.py): sliding-window layers may get a pool of their
    own, whose block tables they read (their attention's `kv_group` 1). Decided before the
    layers are described for the native step, which reads each layer's group."""
    windows = getattr(model, "layer_sliding_windows", None) or [None] * model.num_layers
    groups = kv_cache_groups(
        windows,
        config.max_model_len,
        config.block_size,
        config.max_num_seqs,
        config.max_num_batched_tokens,
    )
    attn_layers = [mod for mod in model.modules() if isinstance(mod, Attention)]
    for i in groups.sliding_layers:
        attn_layers[i].kv_group = 1
    if groups.hybrid:
        logger.info(
            "KV cache groups: %d full-attention layers, %d sliding-window layers (window %d) "
            "in a pool of their own; prefix caching is off for this model",
            len(groups.full_layers),
            len(groups.sliding_layers),
            groups.sliding_window,
        )
    return groups


def _rank_kv_scales(
    resolved: ResolvedModelConfig, model: nn.Module, config: EngineConfig
) -> tuple[float, ...] | None:
    """This rank's layer scales, one per KV cache layer of the model."""
    if resolved.kv_cache_scales is None:
        return None
    scales = resolved.kv_cache_scales[get_tensor_model_parallel_rank()]
    if len(scales) != model.num_layers:
        raise ValueError(
            f"--quantization-param-path {config.quantization_param_path}: scales for "
            f"{len(scales)} layers, but the model has {model.num_layers}"
        )
    return scales


def install_planned_weights(model: nn.Module, plan: LinearPlan) -> None:
    """Each planned module's `weight` becomes its planned weight (a submodule; the float
    tensor or quantized weight it replaces lives on inside it, or only its packed copy)."""
    for name, weight in plan.weights.items():
        module = model.get_submodule(name)
        module._parameters.pop("weight", None)
        module._modules.pop("weight", None)
        module.weight = weight


def prepare_model(config: EngineConfig, source: ModelSource, platform: Platform) -> PreparedModel:
    """Resolve, build, load, quantize and plan (see the module docstring). Every rank calls it
    at the same time (the resolution is a collective under tensor parallelism)."""
    resolved = resolve_model_config(config, source, platform)
    config = dataclasses.replace(config, max_model_len=resolved.max_model_len)
    checkpoint = checkpoint_quantization(source.hf_config)
    kv_dtype = _check(resolved, platform, checkpoint)
    memory_baseline = take_memory_snapshot(platform)
    start = time.perf_counter()
    options = resolved.kernel_options
    kernels = platform.kernel_table(options)
    dtype = resolved.dtype
    model = build_model(
        source.hf_config,
        get_attention_backend(resolved.attention_backend),
        dtype=dtype,
        device=platform.device,
        max_model_len=resolved.max_model_len,
        kernels=kernels,
    )
    gguf_kept = ""
    if source.weights is None:
        if checkpoint is not None:
            raise ValueError(
                f"load_format dummy cannot make {checkpoint.method} weights: "
                "load the checkpoint, or drop quantization_config from the config"
            )
        init_dummy_weights(model, seed=config.seed)
    elif source.quantized_weights is not None and resolved.gguf_layout != "dequantized":
        collector = GGUFWeightCollector(model)
        model.load_weights(_with_progress(source.quantized_weights(), source.num_weights))
        counts = collector.finish()
        gguf_kept = ", ".join(f"{name} x{n}" for name, n in sorted(counts.items()))
    else:
        model.load_weights(_with_progress(source.weights(), source.num_weights))
    process_weights_after_loading(model)
    if resolved.quantization is not None:
        quantize_model(model, resolved.quantization, resolved.int8_layout)
    model.eval()
    description = model_quantization(model)
    if kv_dtype.quantized and hasattr(model, "kv_cache_shape"):
        raise ValueError(
            f"--kv-cache-dtype {config.kv_cache_dtype}: {source.hf_config.architectures[0]} "
            "keeps a latent KV cache (multi-head latent attention), which is not quantized; "
            "use auto, bfloat16 or float16"
        )
    # Once the weights are final, before anything runs: the platform fits the matmuls to them
    # (CPU: times kernels per shape and row bucket, cached on disk).
    # Speculation: the LM head takes each request's verified rows, which must compute as their
    # decodes (spec_decode/row_invariance.py).
    spec = SpeculativeConfig.parse(config.speculative_config)
    head_rows_per_seq = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    max_head_rows = min(config.max_num_seqs * head_rows_per_seq, config.max_num_batched_tokens)
    sites = linear_sites(model, config.max_num_batched_tokens, max_head_rows)
    beside = bool(gguf_kept) and resolved.gguf_layout == "mixed"
    invariant_rows = verification_rows(spec)
    plan = platform.plan_linears(
        kernels,
        sites,
        dtype,
        options,
        gguf_beside_float=beside,
        row_invariant_rows=invariant_rows,
    )
    install_planned_weights(model, plan)
    experts_layout = platform.plan_experts(model, dtype, options)
    if experts_layout:
        logger.info("%s", experts_layout)
    kv_groups = group_kv_layers(model, config)
    kv_fixed_scales = _rank_kv_scales(resolved, model, config)
    decoder = getattr(model, "model", None)
    layers = (
        decoder.stack_layers()
        if hasattr(decoder, "stack_layers")
        else f"{type(model).__name__} does not describe its layers for a native step"
    )
    tp = get_tensor_model_parallel_world_size() > 1
    all_reduce = tensor_model_parallel_all_reduce if tp else None
    native = platform.native_decoder_step(layers, dtype, all_reduce, options)
    native_step, reason = (None, native) if isinstance(native, str) else (native, "")
    return PreparedModel(
        config=config,
        resolved=resolved,
        model=model,
        kv_dtype=kv_dtype,
        linear_plan=plan,
        native_step=native_step,
        native_reason=reason,
        quantization_description=description,
        gguf_kept=gguf_kept,
        load_seconds=time.perf_counter() - start,
        hf_config=source.hf_config,
        memory_baseline=memory_baseline,
        kv_groups=kv_groups,
        kv_fixed_scales=kv_fixed_scales,
        source_path=str(source.path),
    )


def _with_progress(weights: Iterator[Any], total: int) -> Iterator[Any]:
    """Wrap the weight iterator in a progress bar on stderr when it is a terminal."""
    if not sys.stderr.isatty() or total <= 0:
        yield from weights
        return
    from tqdm import tqdm

    with tqdm(total=total, desc="Loading weights", unit="tensor", file=sys.stderr) as bar:
        for item in weights:
            yield item
            bar.update(1)
