"""The CPU's native decoder step (`Platform.native_decoder_step`, the model runner's fast path):
a model's decoder layers in one native call (kernels/cpu/decoder_stack.c) instead of ~10
Python module calls per layer.

A batch-1 decode of SmolLM2-135M (30 layers) spent ~4.5 of its ~13.5 ms per step between the
kernels (module calls, allocations, argument marshalling; 2-core Zen 4). The native stack calls
the very kernels the per-module path calls, with the same arguments in the same order, so its
outputs are the same bits; the Python between them is gone.

It runs where the model describes its layers (`StackLayer`, models/decoder_parts.py) and
`_native_reason` finds nothing the C code lacks: RMSNorms (sandwich norms too) or LayerNorms
with or without biases, fused q/k/v with optional biases and per-head q/k RMSNorms, neox rotary
over the whole head or its leading dims, causal attention (sliding windows in their own KV
pool, soft caps, quantized caches) on the native CPU backend, or DeepSeek's latent attention
(`StackMLA`: q through its LoRA or not, the latent's norm, rotary on the rope dims, the latent
cache, absorbed attention for every row: kernels/cpu/mla_attention.c, which the cpu backend's
modules run too; under tensor parallelism a rank's heads), o_proj, a gated MLP (SiLU or
GELU tanh) or a plain one (fc1 -> GELU erf or tanh -> fc2, biases allowed), or an MoE block
(`StackMoE`: the router's linear, softmax top-k renormalised or not, or DeepSeek's grouped
top-k router on fp32 logits (kernels/cpu/moe_routing.c), float experts in the
activation dtype or GPTQ / AWQ experts kept in their codes (kernels/cpu/moe_wna16.c),
optionally a shared expert MLP, scaled by sigmoid of its gate (Qwen2-MoE) or not (DeepSeek);
the CPU table's MoE slots and the step both run kernels/cpu/moe.c), the MLP after the attention
or beside it from the same norm (Phi-2, StableLM's parallel residual: x + (attn + mlp)); under
tensor parallelism one call per half layer with the all-reduce between (a parallel layer's
attention and MLP partial sums reduced apart, then added; an MoE layer's experts, float or
GPTQ / AWQ codes in whole groups, each a slice of their intermediate dim, routing replicated,
the routed and shared experts' partial sums reduced apart as the modules reduce them).
Families so covered: Llama, Qwen2/3, Mistral, Phi-3, Gemma 1-3, GLM-4, InternLM2, Baichuan,
Phi-2, StableLM, StarCoder2, Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3. GPTQ / AWQ weights
act-order too (decoder_stack.c gathers x's columns as the module's index_select does). Not yet:
StableLM's per-head q/k LayerNorm (its modules refuse it
too), the gated exact GELU.

Per row bucket every matmul must have a native kernel as the planned weights say
(kernels/planned_weight.py): dense or panel kernels for float weights, the GGUF or wNa16
kernels planned for that count for kept quantized weights. Elsewhere the model's own modules
run: `CpuDecoderStack.build` returns why (logged once), or `takes` says no for a row count
without native kernels.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from model_server.kernels.cpu import abi, layer_ops, native
from model_server.kernels.cpu import mla_attention as native_mla
from model_server.kernels.cpu.experts_plan import PanelExperts
from model_server.kernels.cpu.gemm import MIN_WORK_PER_THREAD as GEMM_MIN_WORK
from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.cpu.gguf_linear import MIN_WORK_PER_THREAD as GGUF_MIN_WORK
from model_server.kernels.cpu.gguf_linear import gguf_gemm, gguf_q8_gemm
from model_server.kernels.cpu.linear_tuning import NATIVE, WNA16_NATIVE, panels_prefetch
from model_server.kernels.cpu.lora import lora_struct
from model_server.kernels.cpu.moe_routing import grouped_topk_reason, grouped_topk_struct
from model_server.kernels.cpu.moe_wna16 import experts_reason, experts_struct
from model_server.kernels.cpu.panel_gemm import MIN_WORK_PER_THREAD as PANEL_MIN_WORK
from model_server.kernels.cpu.panel_gemm import Panels
from model_server.kernels.cpu.wna16 import MIN_WORK_PER_THREAD as WNA16_MIN_WORK
from model_server.kernels.cpu.wna16 import wna16_applies
from model_server.kernels.kv_cache_dtype import QuantizedKVCache
from model_server.kernels.lora_weights import StackedLoRA
from model_server.kernels.planned_weight import GGUFSegmentDispatch, PlannedWeight
from model_server.kernels.stack_layer import StackLayer, StackMLA
from model_server.kernels.stack_layer import StepMetadata as AttentionMetadata

logger = logging.getLogger(__name__)

# wick_stack.h's structs and constants come from the header itself (kernels/cpu/abi.py parses it
# on first use, cached; the library's load checks the structs against the compiled layout):
# `abi.structure("WickLayer")`, `abi.constant("LINEAR_GGUF")`. Module attributes of the same
# names resolve to them (`__getattr__` below), for readers outside this file.
_HEADER_STRUCTS = ("WickLinear", "WickLayer", "WickStackStep")
_HEADER_CONSTANTS = ("LINEAR_PANELS_BF16", "LINEAR_PANELS_F32", "LINEAR_GGUF", "MAX_SEGMENTS")


def __getattr__(name: str) -> Any:
    if name in _HEADER_STRUCTS:
        return abi.structure(name)
    if name in _HEADER_CONSTANTS:
        return abi.constant(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# decoder_stack.c's STAGE_* codes, for errors.
_STAGES = {
    1: "input norm",
    2: "qkv projection",
    3: "rotary embedding",
    4: "attention",
    5: "output projection",
    6: "post-attention norm",
    7: "gate/up projection",
    8: "down projection",
    9: "layout check",
}

# WickStackStep's buffer pointers, carved from one arena per step (`_run`).
_BUFFERS = (
    "normed",
    "qkv",
    "q_normed",
    "k_normed",
    "q_rot",
    "k_rot",
    "attn",
    "proj",
    "sandwich",
    "residual_a",
    "residual_b",
    "gate_up",
    "mid",
    "segment",
    "hidden_out",
)
# The activations decoder_stack.c runs (wick_stack.h's ACT_*), per MLP kind (MLP_*), and the
# norms (NORM_*).
_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}
_MLP_ACTIVATIONS = {"gated": ("silu", "gelu_tanh"), "plain": ("gelu", "gelu_tanh")}
_MLP_KINDS = {"gated": 0, "plain": 1}
_NORM_KINDS = {"rms": 0, "layer": 1}
# How an MoE layer adds its shared expert (StackMoE.shared_add -> wick_stack.h's MOE_SHARED_*).
_SHARED_KINDS = {"gated": "MOE_SHARED_GATED", "plain": "MOE_SHARED_PLAIN"}


class _Geometry:
    """What every layer shares (checked equal across layers when the step is built)."""

    __slots__ = ("dtype", "eps", "experts", "head_dim", "heads", "hidden", "inter", "kv_heads",
                 "max_position", "mla", "mla_n", "qkv_n", "scale")  # fmt: skip

    def __init__(self, layer: StackLayer, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.hidden = int(layer.input_norm.shape[0])
        self.heads, self.kv_heads = layer.num_heads, layer.num_kv_heads
        self.head_dim = layer.head_dim
        # this layer's MLP (an MoE layer's shared expert; 0: none): the step's buffers take the
        # largest (`build`), each layer runs its own (decoder_stack.c reads down.k)
        self.inter = 0 if layer.down is None else int(layer.down.weight.shape[1])
        self.experts = 0 if layer.moe is None else int(layer.moe.w13.shape[0])  # likewise
        self.eps = float(layer.eps)
        self.scale = float(layer.scale)
        self.max_position = int(layer.cos_sin_cache.shape[0])
        self.qkv_n = (self.heads + 2 * self.kv_heads) * self.head_dim
        # Latent attention: its buffers are `mla_scratch`'s (decoder_stack.c's MLAParts), the
        # q/k/v ones unused; mla_n its widest projection (a GGUF weight's segments' buffer) or
        # o_proj's input H * Dv (an act-order weight's gathered input, also in `segment`).
        self.mla = layer.mla is not None
        self.mla_n = 0
        if layer.mla is not None:
            linears = (layer.qkv, layer.mla.q_b, layer.mla.q_a)
            widest = max(int(m.weight.shape[0]) for m in linears if m is not None)
            self.mla_n = max(widest, int(layer.o.weight.shape[1]))

    def same(self, other: _Geometry) -> bool:
        names = ("hidden", "heads", "kv_heads", "head_dim", "eps", "scale", "qkv_n",
                 "max_position", "mla", "mla_n")  # fmt: skip
        return all(getattr(self, n) == getattr(other, n) for n in names)


class CpuDecoderStack:
    """The native decoder step of one model (`Platform.native_decoder_step`, the model runner's
    fast path): made once the model's planned weights are installed; per row bucket it builds
    the layers' structs on first use (None where a matmul has no native kernel at that count:
    `takes` says no) and runs the layers in one native call."""

    def __init__(
        self,
        kernels: native.NativeKernels,
        layers: Sequence[StackLayer],
        geometry: _Geometry,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.kernels = kernels
        self.layers = tuple(layers)
        self.geometry = geometry
        # Tensor parallelism: sums a rank's partial [T, hidden] over the ranks, in place.
        self.all_reduce = all_reduce
        # Row bucket key ((T - 1).bit_length()) -> the layers' structs (None: not native there).
        self._plans: dict[int, ctypes.Array[Any] | None] = {}
        self._kv_caches: Sequence[Any] | None = None
        # LoRA (`attach_lora`): a layer's base module -> its slots as wick_lora.h's WickLoRA.
        self._lora: dict[nn.Module, Any] = {}

    @classmethod
    def build(
        cls,
        kernels: native.NativeKernels,
        layers: Sequence[StackLayer] | str,
        dtype: torch.dtype,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> CpuDecoderStack | str:
        """The step for `layers` (the model's description, or why it has none) in `dtype`, or
        why not; either way logged once. Under tensor parallelism `all_reduce` sums a rank's
        partial outputs (one native call per half layer between them)."""
        reason = layers if isinstance(layers, str) else _native_reason(layers, dtype, all_reduce)
        geometry = None
        if reason is None:
            assert not isinstance(layers, str)
            geometry = _Geometry(layers[0], dtype)
            for i, layer in enumerate(layers):
                own = _Geometry(layer, dtype)
                if not own.same(geometry):
                    reason = f"layer {i} differs in shape from layer 0"
                    break
                geometry.inter = max(geometry.inter, own.inter)
                geometry.experts = max(geometry.experts, own.experts)
        if reason is not None or geometry is None:
            reason = reason or "no layers"
            logger.info("decoder layers run module by module: %s", reason)
            return reason
        assert not isinstance(layers, str)
        logger.info(
            "decoder layers: one native call per step where every matmul has a native kernel "
            "(kernels/cpu/decoder_stack.c)"
        )
        return cls(kernels, layers, geometry, all_reduce)

    def attach_lora(self, stacks: Mapping[nn.Module, StackedLoRA]) -> str | None:
        """Run the LoRA adapters of these layers (base module -> its slots, which stay at their
        addresses) in the step: each WickLinear points at its slots, and a call's `lora_slots`
        says which rows use which. None, or why not (the runner then runs adapter steps module
        by module)."""
        if self.all_reduce is not None:
            return "tensor parallelism (LoRA runs on one rank)"
        described = {m for layer in self.layers for m in _matmuls(layer).values()}
        missing = [m for m in stacks if m not in described]
        if missing:
            return f"{len(missing)} LoRA layers are not linears the native step runs"
        try:
            self._lora = {module: lora_struct(stack) for module, stack in stacks.items()}
        except ValueError as exc:
            return str(exc)
        self._plans = {}  # rebuilt with the slots (and gate/up unfused where adapters are)
        return None

    # ---- the plan -------------------------------------------------------------------------

    def _linear(self, module: nn.Module, key: int, dtype: torch.dtype) -> ctypes.Structure | None:
        """How `module` multiplies at row bucket `key` natively, or None."""
        weight = module.weight
        bias = module.bias
        if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
            return None
        if not isinstance(weight, PlannedWeight):
            return None  # not planned: the table's fixed matmul, not a native one
        weight = weight.at_bucket(key)  # a GGUF weight's float twin past its blocks' buckets
        out = abi.structure("WickLinear")()
        out.bias = None if bias is None else bias.data_ptr()
        # The kernel the plan chose at this bucket, as the module path's call runs it.
        name = weight.kernel_names[min(key, len(weight.kernel_names) - 1)]
        panels = weight.packed if weight.source is None else None
        if isinstance(panels, Panels):
            if panels.dtype != dtype:
                return None
            panel_kind = "LINEAR_PANELS_BF16" if panels.pairs else "LINEAR_PANELS_F32"
            out.kind = abi.constant(panel_kind)
            out.n, out.k = panels.n, panels.k
            out.data = panels.data.data_ptr()
            out.min_work_per_thread = PANEL_MIN_WORK
            out.hw_prefetch_only = int(not panels_prefetch(name))
            return out
        source = weight.source
        if name == NATIVE and isinstance(source, torch.Tensor):
            if source.dtype != dtype or not source.is_contiguous():
                return None
            out.kind = abi.constant("LINEAR_DENSE_GEMM")
            out.n, out.k = int(source.shape[0]), int(source.shape[1])
            out.data = source.data_ptr()
            out.min_work_per_thread = GEMM_MIN_WORK
            return out
        if name == WNA16_NATIVE and getattr(source, "bits", 0) in (4, 8):
            return self._wna16(out, source, dtype)
        dispatch = None if weight.kernels is None else weight.kernels.gguf_linear
        if not isinstance(dispatch, GGUFSegmentDispatch):
            return None
        parts = weight.source.segments()  # type: ignore[union-attr]
        if len(parts) > abi.constant("MAX_SEGMENTS") or (len(parts) > 1 and bias is not None):
            return None
        out.kind = abi.constant("LINEAR_GGUF")
        out.num_segments = len(parts)
        out.n, out.k = int(weight.shape[0]), int(weight.shape[1])
        out.min_work_per_thread = GGUF_MIN_WORK
        planned = dict(dispatch.by_segment)
        for i, (ggml_type, blocks) in enumerate(parts):
            fns = planned.get((ggml_type, blocks.shape[0]))
            if fns is None or not blocks.is_contiguous():
                return None
            fn = fns[min(key, len(fns) - 1)]
            if fn is gguf_q8_gemm:
                out.segment_q8[i] = 1
            elif fn is not gguf_gemm:
                return None  # dequantize-then-GEMM: PyTorch's matmul, not native
            out.segment_type[i] = ggml_type
            out.segment_rows[i] = blocks.shape[0]
            out.segment_blocks[i] = blocks.data_ptr()
        return out

    @staticmethod
    def _wna16(out: Any, source: Any, dtype: torch.dtype) -> Any:
        """A GPTQ/AWQ weight (layers/quantization/wna16.py's, read by attribute) on the native
        wNa16 kernel, where `wna16_native_linear` would run it, or None."""
        codes, scales, offsets = source.codes, source.scales, source.offsets
        n, k = int(source.shape[0]), int(source.shape[1])
        perm = source.perm  # act-order: decoder_stack.c gathers x's columns, as the module does
        if dtype not in (torch.float32, torch.bfloat16):
            return None
        if perm is not None and (perm.dtype != torch.int64 or not perm.is_contiguous()):
            return None
        if not wna16_applies(codes, source.bits, source.group_size, k):
            return None
        if scales.dtype != torch.float32 or offsets.dtype != torch.float32:
            return None
        if not (scales.is_contiguous() and offsets.is_contiguous()):
            return None
        out.kind = abi.constant("LINEAR_WNA16")
        out.n, out.k = n, k
        out.data = codes.data_ptr()
        out.scales, out.offsets = scales.data_ptr(), offsets.data_ptr()
        out.bits, out.group_size = source.bits, source.group_size
        out.min_work_per_thread = WNA16_MIN_WORK
        out.perm = None if perm is None else perm.data_ptr()
        return out

    def _plan(
        self, key: int, kv_caches: Sequence[Any], dtype: torch.dtype
    ) -> ctypes.Array[Any] | None:
        matmuls = default_kernels()
        if matmuls is None or matmuls.isa != self.kernels.isa:
            # The matmuls run the process's first build (gemm.default_kernels), packed for its
            # ISA; this step's is another (a test switched WICK_CPU_ISA): one call cannot mix.
            return None
        layers = self.layers
        structs = (abi.structure("WickLayer") * len(layers))()
        for i, (s, layer, kv) in enumerate(zip(structs, layers, kv_caches, strict=True)):
            for name, module in _matmuls(layer).items():
                linear = self._linear(module, key, dtype)
                if linear is None:
                    weight = module.weight
                    names = getattr(weight, "kernel_names", ("the table's fixed matmul",))
                    logger.info(
                        "decoder layers run module by module at %d-%d rows: layer %d's %s runs "
                        "%s there (no native kernel)",
                        (1 << key >> 1) + 1 if key else 1,
                        1 << key,
                        i,
                        name,
                        names[min(key, len(names) - 1)],
                    )
                    return None
                if module in self._lora:
                    linear.lora = self._lora[module]
                if name in ("router", "shared_gate"):
                    setattr(s.moe, name, linear)
                elif name in ("q_a", "q_b"):
                    setattr(s.mla, name, linear)
                else:
                    setattr(s, name, linear)
            if layer.moe is not None:
                _describe_moe(s.moe, layer)
                # the ranks' partial sums reduced apart, as the modules do (`_run`)
                s.moe.split_shared_add = int(self.all_reduce is not None and s.moe.has_shared)
            # The module path fuses the SiLU wherever the planned weight can (GatedMLP).
            gate_up = None if layer.gate_up is None else layer.gate_up.weight
            if isinstance(gate_up, PlannedWeight):
                gate_up = gate_up.at_bucket(key)
            fused = getattr(gate_up, "fused_silu_and_mul", None)
            # (LoRA adds to gate/up's output before the activation: never fused there.)
            fusable = layer.mlp == "gated" and layer.activation == "silu" and fused is not None
            if fusable and s.gate_up.lora.num_slices == 0:
                if s.gate_up.kind == abi.constant("LINEAR_GGUF"):
                    return None
                s.fuse_silu = 1
            s.activation = _ACTIVATIONS[layer.activation]
            s.mlp_kind = _MLP_KINDS[layer.mlp]
            s.norm_kind = _NORM_KINDS[layer.norm]
            s.parallel_residual = int(layer.parallel_residual)
            # the attention's and the MLP's partial sums reduced apart (`_run`)
            s.split_parallel_add = int(self.all_reduce is not None and layer.parallel_residual)
            s.input_norm = layer.input_norm.data_ptr()
            s.post_attention_norm = _ptr(layer.post_attention_norm)
            s.input_norm_bias = _ptr(layer.input_norm_bias)
            s.post_attention_norm_bias = _ptr(layer.post_attention_norm_bias)
            s.attn_out_norm = _ptr(layer.attn_out_norm)
            s.mlp_out_norm = _ptr(layer.mlp_out_norm)
            s.q_norm, s.k_norm = _ptr(layer.q_norm), _ptr(layer.k_norm)
            s.cos_sin = layer.cos_sin_cache.data_ptr()
            s.rotary_dim = layer.rotary_dim or layer.head_dim
            s.sliding_window = layer.sliding_window or 0
            s.logits_soft_cap = layer.logits_soft_cap or 0.0
            s.kv_group = layer.kv_group
            if self.all_reduce is not None:
                # After the all-reduce, in Python (`_run`): as RowParallelLinear adds them.
                s.o.bias = s.down.bias = s.mlp_out_norm = None
            if layer.mla is not None:  # the latent cache [blocks, block_size, L + R]
                _describe_mla(s.mla, layer.mla)
                s.k_cache, s.v_cache = kv.data_ptr(), None
                s.num_slots = kv.shape[0] * kv.shape[1]
                continue
            if isinstance(kv, QuantizedKVCache):
                data = kv.data
                s.k_scales, s.v_scales = kv.scales[0].data_ptr(), kv.scales[1].data_ptr()
                s.kv_fixed_scale = kv.fixed_scale or 0.0
            else:
                data = kv
            s.k_cache, s.v_cache = data[0].data_ptr(), data[1].data_ptr()
            s.num_slots = data.shape[1] * data.shape[2]  # [2, blocks, block_size, Hkv, D]
        return structs

    def row_coverage(self, max_rows: int) -> str:
        """Which row buckets up to `max_rows` have a native kernel for every matmul of every
        layer (what `takes` finds there, the caches aside), as runs: "1-32 rows; module by
        module from 33"."""
        native_keys = []
        for key in range((max(max_rows, 1) - 1).bit_length() + 1):
            ok = all(
                self._linear(module, key, self.geometry.dtype) is not None
                for layer in self.layers
                for module in _matmuls(layer).values()
            )
            native_keys.append(ok)
        parts = []
        for key, ok in enumerate(native_keys):
            low, high = (1 << key >> 1) + 1 if key else 1, min(1 << key, max_rows)
            label = "one native call per step" if ok else "module by module"
            if parts and parts[-1][0] == label:
                parts[-1][2] = high
            else:
                parts.append([label, low, high])
        return "; ".join(
            f"{label} at {low}-{high} rows" if low != high else f"{label} at {low} row"
            for label, low, high in parts
        )

    # ---- a step ---------------------------------------------------------------------------

    def takes(self, num_tokens: int, kv_caches: Sequence[Any]) -> bool:
        """Whether a step of `num_tokens` rows runs natively: the caches' format and the row
        bucket's plan (every matmul with a native kernel there) decide, nothing of the step's
        values, so the runner asks before it embeds."""
        if num_tokens == 0 or not kv_caches:
            return False
        if kv_caches is not self._kv_caches:
            first = kv_caches[0]
            first = first.data if isinstance(first, QuantizedKVCache) else first
            query = torch.empty((), dtype=self.geometry.dtype)  # the step's dtype and device
            reason = (
                native_mla.unsupported_reason(query, first)
                if self.geometry.mla
                else native.unsupported_reason(query, first[0], self.geometry.head_dim)
            )
            if reason is not None:
                return False
            self._plans, self._kv_caches = {}, kv_caches
        key = (num_tokens - 1).bit_length()
        if key not in self._plans:
            self._plans[key] = self._plan(key, kv_caches, self.geometry.dtype)
        return self._plans[key] is not None

    def __call__(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_caches: Sequence[Any],
        attn_metadata: AttentionMetadata,
        lora_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual stream before it) as the layers' modules
        return them; `takes` said yes for this step's row count and caches. `lora_slots` [T]
        int32: each row's LoRA slot (-1: the base model; needs `attach_lora`)."""
        geo = self.geometry
        num_tokens = hidden_states.shape[0]
        if not self.takes(num_tokens, kv_caches):
            raise ValueError(f"the native step does not take {num_tokens} rows (ask `takes`)")
        if hidden_states.dtype != geo.dtype or hidden_states.dim() != 2:
            raise ValueError(
                f"hidden states {tuple(hidden_states.shape)} {hidden_states.dtype}: the native "
                f"step takes [T, hidden] {geo.dtype}"
            )
        plan = self._plans[(num_tokens - 1).bit_length()]
        assert plan is not None
        if lora_slots is not None and (
            not self._lora
            or lora_slots.dtype != torch.int32
            or tuple(lora_slots.shape) != (num_tokens,)
            or not lora_slots.is_cpu
        ):
            raise ValueError(
                f"LoRA slots {tuple(lora_slots.shape)} {lora_slots.dtype}: the native step takes "
                f"[{num_tokens}] int32 on the CPU, once attach_lora gave it the adapters' layers"
            )
        return self._run(
            plan, geo, positions, hidden_states.contiguous(), kv_caches[0], attn_metadata,
            lora_slots,
        )  # fmt: skip

    def _run(
        self,
        plan: ctypes.Array[Any],
        geo: _Geometry,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv0: Any,
        md: AttentionMetadata,
        lora_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t = hidden.shape[0]
        q_n, kv_n, qkv_n = geo.heads * geo.head_dim, geo.kv_heads * geo.head_dim, geo.qkv_n
        if geo.mla:  # the q/k/v buffers unused: `mla_scratch` holds an MLA layer's
            q_n = kv_n = qkv_n = 0
        sizes = {
            "normed": geo.hidden,
            "qkv": qkv_n,
            "q_normed": q_n,
            "k_normed": kv_n,
            "q_rot": q_n,
            "k_rot": kv_n,
            "attn": q_n,
            "proj": geo.hidden,
            "sandwich": geo.hidden,
            "residual_a": geo.hidden,
            "residual_b": geo.hidden,
            "gate_up": 2 * geo.inter,
            "mid": geo.inter,
            "segment": max(qkv_n, geo.mla_n, 2 * geo.inter, geo.hidden, geo.experts),
            "hidden_out": geo.hidden,
        }
        # One allocation, carved into 64-byte aligned rows of buffers.
        offsets, total = {}, 0
        for name in _BUFFERS:
            offsets[name] = total
            total += -(-t * sizes[name] // 32) * 32
        arena = torch.empty(total, dtype=geo.dtype)
        base, esize = arena.data_ptr(), arena.element_size()
        step = abi.structure("WickStackStep")()
        step.dtype = native.DTYPE_CODES[geo.dtype]
        step.num_threads = torch.get_num_threads()
        step.num_tokens, step.hidden = t, geo.hidden
        step.num_heads, step.num_kv_heads, step.head_dim = geo.heads, geo.kv_heads, geo.head_dim
        step.intermediate, step.eps, step.scale = geo.inter, geo.eps, geo.scale
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        step.positions, step.max_position = positions.data_ptr(), geo.max_position
        # Keeps the int64 / int32 copies alive until the call returns.
        keep = [_slots_and_tables(step, md, "")]
        if md.sliding is not None:
            keep.append(_slots_and_tables(step, md.sliding, "sliding_"))
        starts, lens = native._int32(md.query_start_loc), native._int32(md.seq_lens)
        # [blocks, block_size, ...]: the latent cache itself, or the K cache
        cache = kv0 if geo.mla else kv0.data[0] if isinstance(kv0, QuantizedKVCache) else kv0[0]
        block_size = cache.shape[1]
        step.query_start_loc, step.seq_lens = starts.data_ptr(), lens.data_ptr()
        step.num_seqs, step.block_size = lens.shape[0], block_size
        step.kv_format = native._KV_FORMATS[cache.dtype]
        step.norm_min_work = layer_ops.MIN_ELEMENTS_PER_THREAD
        step.attn_min_work = native.MIN_WORK_PER_THREAD
        step.hidden_in = hidden.data_ptr()
        if lora_slots is not None:
            lora_slots = lora_slots.contiguous()  # alive until the calls return (`del` below)
            step.lora_slots = lora_slots.data_ptr()
        for name in _BUFFERS:
            setattr(step, name, base + offsets[name] * esize)
        moe_scratch = None
        if any(layer.moe is not None for layer in self.layers):
            lib = self.kernels.lib
            moe_bytes = max(lib.wick_stack_moe_bytes(ctypes.addressof(step), ctypes.addressof(s))
                            for s in plan)  # fmt: skip
            moe_scratch = torch.empty(moe_bytes, dtype=torch.uint8)
            step.moe_scratch = moe_scratch.data_ptr()
        mla_scratch = None
        if geo.mla:
            lib = self.kernels.lib
            mla_bytes = max(lib.wick_stack_mla_bytes(ctypes.addressof(step), ctypes.addressof(s))
                            for s in plan)  # fmt: skip
            mla_scratch = torch.empty(mla_bytes, dtype=torch.uint8)
            step.mla_scratch = mla_scratch.data_ptr()

        def view(name: str) -> torch.Tensor:
            return arena[offsets[name] : offsets[name] + t * geo.hidden].view(t, geo.hidden)

        which = ctypes.c_int(0)
        last = len(plan) - 1
        if self.all_reduce is None:
            self._call(step, plan, (0, 0, last, 1), which, geo)
        else:
            # One call per half layer; each half's partial sum is all-reduced between calls,
            # then its bias added and (MLP) its sandwich norm, as RowParallelLinear and the
            # layer's modules do. An MoE layer with a shared expert: the routed experts' sum
            # (`sandwich`, FusedMoE's all-reduce), then the shared expert's (its down
            # projection's), then their gated add in C. A parallel layer (Phi-2): the MLP's sum,
            # then attn + mlp.
            proj, out = view("proj"), view("hidden_out")
            for i, layer in enumerate(self.layers):
                self._call(step, plan, (i, 0, i, 0), which, geo)
                self.all_reduce(proj)
                if layer.o.bias is not None:
                    proj += layer.o.bias
                self._call(step, plan, (i, 1, i, 1), which, geo)
                split = plan[i].moe.split_shared_add
                if split:
                    self.all_reduce(view("sandwich"))
                self.all_reduce(out)
                if layer.down is not None and layer.down.bias is not None:
                    out += layer.down.bias
                if split:
                    self._shared_add(step, plan, i)
                if layer.parallel_residual:  # attn + mlp, the modules' order
                    torch.add(proj, out, out=out)
                if layer.mlp_out_norm is not None:
                    out.copy_(layer_ops.rms_norm(self.kernels, out, layer.mlp_out_norm, geo.eps))
        # alive until here: the calls read them
        del keep, positions, starts, lens, lora_slots, moe_scratch, mla_scratch
        return view("hidden_out"), view("residual_a" if which.value == 0 else "residual_b")

    def _shared_add(self, step: Any, plan: ctypes.Array[Any], i: int) -> None:
        """hidden_out = routed + sigmoid(gate) * shared of layer i's reduced partial sums."""
        status = self.kernels.lib.wick_stack_moe_shared_add(
            ctypes.addressof(step), ctypes.addressof(plan[i])
        )
        if status != 0:
            raise RuntimeError(f"native decoder stack: layer {i}'s shared expert add failed")

    def _call(
        self,
        step: Any,
        plan: ctypes.Array[Any],
        part: tuple[int, int, int, int],
        which: ctypes.c_int,
        geo: _Geometry,
    ) -> None:
        """Run layers (first, half) to (last, half) of `plan` (wick_stack.h's WickStackStep)."""
        step.first_layer, step.first_half, step.last_layer, step.last_half = part
        # ctypes drops the GIL for the call, so the HTTP event loop keeps running meanwhile.
        status = self.kernels.lib.wick_decoder_stack(
            ctypes.addressof(step), ctypes.addressof(plan), len(plan), ctypes.addressof(which)
        )
        if status != 0:
            layer, stage = (-status) >> 4, (-status) & 15
            if stage == 3:  # the rotary kernel's only refusal
                raise IndexError(
                    f"rotary embedding: a position is outside the cache's {geo.max_position}"
                )
            raise RuntimeError(
                f"native decoder stack: layer {layer}'s {_STAGES.get(stage, stage)} failed "
                f"(kernel status {step.status})"
            )


def _matmuls(layer: StackLayer) -> dict[str, nn.Module]:
    """The layer's linear modules by their WickLayer field (an MoE layer's router and shared
    gate: WickMoE's), those it has."""
    parts = {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down}
    if layer.moe is not None:
        # (a grouped router is no planned linear: moe_routing.c multiplies its fp32 weight)
        router = None if layer.moe.grouped is not None else layer.moe.router
        parts |= {"router": router, "shared_gate": layer.moe.shared_gate}
    if layer.mla is not None:  # WickMLA's (`qkv` is kv_a_proj_with_mqa)
        parts |= {"q_a": layer.mla.q_a, "q_b": layer.mla.q_b}
    return {name: module for name, module in parts.items() if module is not None}


def _describe_moe(out: Any, layer: StackLayer) -> None:
    """WickMoE's fields of the layer's MoE block but its linears (`_plan` fills those)."""
    moe = layer.moe
    assert moe is not None
    w13, w2 = moe.w13, moe.w2
    out.num_experts, out.top_k = int(w13.shape[0]), moe.top_k
    out.renormalize, out.has_shared = int(moe.renormalize), int(layer.gate_up is not None)
    out.shared_kind = abi.constant(_SHARED_KINDS[moe.shared_add])
    if moe.grouped is not None:  # DeepSeek's router (moe_routing.c); the layer holds its tensors
        out.routing = abi.constant("MOE_ROUTING_GROUPED_TOPK")
        out.grouped = grouped_topk_struct(moe.grouped)
    else:
        out.routing = abi.constant("MOE_ROUTING_SOFTMAX_TOPK")
    out.inter = int(w2.shape[2])
    if isinstance(w13, torch.Tensor):
        out.experts_kind = abi.constant("MOE_EXPERTS_FLOAT")
        out.w13, out.w2 = w13.data_ptr(), w2.data_ptr()
    elif isinstance(w13, PanelExperts):  # the experts' plan packed them (moe.c)
        out.experts_kind = abi.constant("MOE_EXPERTS_PANELS")
        out.w13_panels, out.w2_panels = w13.struct(), w2.struct()
    else:  # GPTQ / AWQ codes, their layout checked by `_moe_reason`: moe_wna16.c
        out.experts_kind = abi.constant("MOE_EXPERTS_WNA16")
        out.w13_wna16, out.w2_wna16 = experts_struct(w13), experts_struct(w2)
    out.gemm_min_work = GEMM_MIN_WORK


def _describe_mla(out: Any, mla: StackMLA) -> None:
    """WickMLA's fields of `mla` but its linears (`_plan` fills those)."""
    out.kv_lora_rank = mla.kv_lora_rank
    out.q_lora_rank = 0 if mla.q_a is None else int(mla.q_a.weight.shape[0])
    out.qk_nope_head_dim, out.qk_rope_head_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim
    out.v_head_dim = mla.v_head_dim
    out.q_a_eps, out.kv_a_eps = mla.q_a_eps, mla.kv_a_eps
    out.q_a_norm, out.kv_a_norm = _ptr(mla.q_a_norm), mla.kv_a_norm.data_ptr()
    out.w_kv_b = mla.w_kv_b.data_ptr()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _slots_and_tables(step: Any, md: AttentionMetadata, prefix: str) -> tuple[torch.Tensor, ...]:
    """Set the step's slot mapping and block tables of one KV cache group (`prefix` "" or
    "sliding_"); returns the tensors the pointers point into."""
    slots = md.slot_mapping
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        slots = slots.to(torch.int64).contiguous()
    tables = native._int32(md.block_tables)
    setattr(step, f"{prefix}slot_mapping", slots.data_ptr())
    setattr(step, f"{prefix}block_tables", tables.data_ptr())
    setattr(step, f"{prefix}bt_stride", tables.stride(0))
    return slots, tables


def _native_reason(
    layers: Sequence[StackLayer],
    dtype: torch.dtype,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> str | None:
    """Why decoder_stack.c cannot run these layers (naming the first layer and what it has), or
    None."""
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (the kernels take float32 and bfloat16)"
    if not layers:
        return "no layers"
    for i, layer in enumerate(layers):
        if layer.attention_backend != "cpu":
            backend = layer.attention_backend
            return f"layer {i}: the {backend} attention backend (not the native cpu one)"
        if layer.tp_size != 1 and all_reduce is None:
            return f"layer {i}: tensor parallelism without an all-reduce to run between calls"
        if layer.mla is not None:
            reason = _mla_reason(layer, dtype)
            if reason is not None:
                return f"layer {i}: {reason}"
        reason = _layer_kind_reason(layer) if layer.moe is None else _moe_reason(layer, dtype)
        if reason is not None:
            return f"layer {i}: {reason}"
        if (layer.q_norm is None) != (layer.k_norm is None):
            return f"layer {i}: a q norm without a k norm"
        rotary_dim = layer.rotary_dim or layer.head_dim
        if rotary_dim % 2 or rotary_dim > layer.head_dim or layer.cos_sin_cache.dim() != 2:
            return f"layer {i}: a rotary over {rotary_dim} of {layer.head_dim} dims"
        cache_dims = layer.cos_sin_cache.shape[1]
        if cache_dims != rotary_dim:
            return f"layer {i}: a rotary cache of {cache_dims} dims, not {rotary_dim}"
        tensors = [layer.input_norm, layer.cos_sin_cache]
        tensors += [t for t in (layer.post_attention_norm, layer.attn_out_norm,
                                layer.mlp_out_norm, layer.q_norm, layer.k_norm,
                                layer.input_norm_bias, layer.post_attention_norm_bias)
                    if t is not None]  # fmt: skip
        if any(t.dtype != dtype or not t.is_contiguous() or not t.is_cpu for t in tensors):
            return f"layer {i}: norms or rotary cache that are not contiguous {dtype} CPU tensors"
    return None


def _mla_reason(layer: StackLayer, dtype: torch.dtype) -> str | None:
    """What of the layer's latent attention decoder_stack.c (mla_attention.c) lacks, or None."""
    mla = layer.mla
    assert mla is not None
    lora, rope = mla.kv_lora_rank, mla.qk_rope_head_dim
    heads, per_head = layer.num_heads, mla.qk_nope_head_dim + mla.v_head_dim
    if tuple(mla.w_kv_b.shape) != (heads * per_head, lora):
        return f"latent attention's kv_b_proj of shape {tuple(mla.w_kv_b.shape)}"
    if (layer.rotary_dim or layer.head_dim) != rope or layer.head_dim != lora + rope:
        return "latent attention with a rotary over other than its rope dims"
    if (mla.q_a is None) != (mla.q_a_norm is None):
        return "latent attention's q LoRA without its norm, or a norm without it"
    if int(layer.qkv.weight.shape[0]) != lora + rope:
        return "latent attention's kv_a_proj_with_mqa of another width than L + R"
    if int(mla.q_b.weight.shape[0]) != heads * (mla.qk_nope_head_dim + rope):
        return "latent attention's q projection of another width than H (Dn + R)"
    tensors = [t for t in (mla.w_kv_b, mla.kv_a_norm, mla.q_a_norm) if t is not None]
    if any(t.dtype != dtype or not t.is_contiguous() or not t.is_cpu for t in tensors):
        return f"latent attention's norms or kv_b_proj that are not contiguous {dtype} tensors"
    return None


def _moe_reason(layer: StackLayer, dtype: torch.dtype) -> str | None:
    """What of the layer's MoE block decoder_stack.c (moe.c, moe_wna16.c) lacks, or None."""
    moe = layer.moe
    assert moe is not None
    experts = (moe.w13, moe.w2)
    if all(isinstance(w, PanelExperts) for w in experts):  # the experts' plan packed them
        if any(w.dtype != dtype or w.pairs != moe.w13.pairs for w in experts):
            return f"experts packed as panels of another dtype than {dtype}"
    elif not all(isinstance(w, torch.Tensor) for w in experts):
        reason = experts_reason(moe.w13, moe.w2, dtype)  # GPTQ / AWQ codes (moe_wna16.c)
        if reason is not None:
            return reason
    elif any(
        w.dim() != 3 or w.dtype != dtype or not w.is_contiguous() or not w.is_cpu for w in experts
    ):
        return f"experts that are not contiguous {dtype} CPU tensors"
    router_weight = moe.router.weight if moe.grouped is None else moe.grouped.weight
    if moe.w13.shape[1] != 2 * moe.w2.shape[2] or router_weight.shape[0] != moe.w13.shape[0]:
        return "experts of mismatched shapes"
    if moe.grouped is not None:
        reason = grouped_topk_reason(moe.grouped)
        if reason is not None:
            return f"a grouped top-k router with {reason}"
        if router_weight.shape[1] != layer.input_norm.shape[0]:
            return "a router of another hidden size"
    elif getattr(moe.router, "bias", None) is not None:
        return "a router with a bias"
    if layer.parallel_residual or layer.norm != "rms":
        return "an MoE block after other than an RMSNorm before the MLP"
    if layer.attn_out_norm is not None or layer.mlp_out_norm is not None:
        return "sandwich norms around an MoE block"
    if moe.shared_add not in _SHARED_KINDS:
        return f"a shared expert added {moe.shared_add} (native: {', '.join(_SHARED_KINDS)})"
    if moe.shared_add == "plain" and moe.shared_gate is not None:
        return "a shared expert gate on a plain shared expert add"
    if moe.shared_add == "gated" and (moe.shared_gate is None) != (layer.gate_up is None):
        return "a shared expert without its gate, or a gate without the expert"
    if layer.gate_up is not None:
        if layer.mlp != "gated" or layer.activation != "silu":
            return f"a {layer.mlp} {layer.activation} shared expert (native: gated SiLU)"
        return _layer_kind_reason(layer)
    return None


def _layer_kind_reason(layer: StackLayer) -> str | None:
    """What of the layer's norm, residual and MLP kinds decoder_stack.c lacks, or None."""
    if layer.mlp not in _MLP_KINDS:
        return f"a {layer.mlp} MLP (native: {', '.join(_MLP_KINDS)})"
    native_acts = _MLP_ACTIVATIONS[layer.mlp]
    if layer.activation not in native_acts:
        acts = ", ".join(native_acts)
        return f"the {layer.activation} activation in a {layer.mlp} MLP (native: {acts})"
    if layer.gate_up is None or layer.down is None:
        return "an MLP without gate/up or down"
    inter = int(layer.down.weight.shape[1])
    gate_up_rows = int(layer.gate_up.weight.shape[0])
    if gate_up_rows != (inter if layer.mlp == "plain" else 2 * inter):
        return f"a {layer.mlp} MLP of {gate_up_rows} input rows for {inter}"
    if layer.norm not in _NORM_KINDS:
        return f"{layer.norm} norms (native: {', '.join(_NORM_KINDS)})"
    if (layer.post_attention_norm is None) != layer.parallel_residual:
        return "a parallel residual with a norm before the MLP, or neither"
    biases = (layer.input_norm_bias, layer.post_attention_norm_bias)
    if layer.norm != "layer" and any(b is not None for b in biases):
        return "RMSNorms with biases"
    if layer.norm == "layer" and (
        layer.attn_out_norm is not None or layer.mlp_out_norm is not None
    ):
        return "sandwich norms after LayerNorms"
    return None
