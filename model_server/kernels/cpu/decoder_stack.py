"""`KernelTable.decoder_stack` on CPUs: a model's decoder layers in one native call
(kernels/cpu/decoder_stack.c) instead of ~10 Python module calls per layer.

A batch-1 decode of SmolLM2-135M (30 layers) spent ~4.5 of its ~13.5 ms per step between the
kernels (module calls, allocations, argument marshalling; 2-core Zen 4). The native stack calls
the very kernels the per-module path calls, with the same arguments in the same order, so its
outputs are the same bits; the Python between them is gone.

It runs where every layer is the plain pre-norm Llama shape (RMSNorm, fused q/k/v without a
q/k norm, neox rotary over the whole head, full causal attention on the native CPU backend,
o_proj, RMSNorm with the residual add, SwiGLU) on one rank, and every matmul has a native kernel
at the step's row count: panels the tuner chose for every row count (float weights), or the
GGUF kernels it chose for that count (weights kept in their blocks). Anything else, the model's
own modules run: `CpuDecoderStack.__call__` returns None. Why a model does not qualify is logged
once at debug level; that it does, once at info.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from model_server.kernels.cpu import layer_ops, native
from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.cpu.gguf_linear import MIN_WORK_PER_THREAD as GGUF_MIN_WORK
from model_server.kernels.cpu.gguf_linear import gguf_gemm, gguf_q8_gemm
from model_server.kernels.cpu.linear_tuning import CpuGGUFLinear, CpuLinear
from model_server.kernels.cpu.panel_gemm import MIN_WORK_PER_THREAD as PANEL_MIN_WORK
from model_server.kernels.kv_cache_dtype import QuantizedKVCache
from model_server.kernels.stack_layer import StackLayer

if TYPE_CHECKING:
    from model_server.layers.attention.backend import AttentionMetadata

logger = logging.getLogger(__name__)

# decoder_stack.c's LINEAR_* kinds and MAX_SEGMENTS.
LINEAR_PANELS_BF16, LINEAR_PANELS_F32, LINEAR_GGUF = 0, 1, 2
MAX_SEGMENTS = 4
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

_p, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class WickLinear(ctypes.Structure):
    _fields_ = [
        ("kind", _i32),
        ("num_segments", _i32),
        ("n", _i64),
        ("k", _i64),
        ("data", _p),
        ("bias", _p),
        ("min_work_per_thread", _i64),
        ("segment_type", _i32 * MAX_SEGMENTS),
        ("segment_rows", _i64 * MAX_SEGMENTS),
        ("segment_blocks", _p * MAX_SEGMENTS),
        ("segment_q8", _i32 * MAX_SEGMENTS),
    ]


class WickLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _p),
        ("post_attention_norm", _p),
        ("qkv", WickLinear),
        ("o", WickLinear),
        ("gate_up", WickLinear),
        ("down", WickLinear),
        ("fuse_silu", _i32),
        ("k_cache", _p),
        ("v_cache", _p),
        ("k_scales", _p),
        ("v_scales", _p),
    ]


_BUFFERS = (
    "normed",
    "qkv",
    "q_rot",
    "k_rot",
    "attn",
    "proj",
    "residual_a",
    "residual_b",
    "gate_up",
    "mid",
    "segment",
    "hidden_out",
)


class WickStackStep(ctypes.Structure):
    _fields_ = [
        ("dtype", _i32),
        ("num_threads", _i32),
        ("num_tokens", _i64),
        ("hidden", _i64),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("intermediate", _i64),
        ("eps", _f32),
        ("scale", _f32),
        ("positions", _p),
        ("cos_sin", _p),
        ("max_position", _i64),
        ("slot_mapping", _p),
        ("num_slots", _i64),
        ("block_tables", _p),
        ("bt_stride", _i64),
        ("query_start_loc", _p),
        ("seq_lens", _p),
        ("num_seqs", _i32),
        ("block_size", _i32),
        ("kv_format", _i32),
        ("status", _i32),
        ("norm_min_work", _i64),
        ("attn_min_work", _i64),
        ("hidden_in", _p),
        *((name, _p) for name in _BUFFERS),
    ]


class _Geometry:
    """What every layer shares (checked equal across layers when the plan is built)."""

    __slots__ = ("cos_sin", "dtype", "eps", "head_dim", "heads", "hidden", "inter", "kv_heads",
                 "qkv_n", "scale")  # fmt: skip

    def __init__(self, layer: StackLayer, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.hidden = int(layer.input_norm.shape[0])
        self.heads, self.kv_heads = layer.num_heads, layer.num_kv_heads
        self.head_dim = layer.head_dim
        self.inter = int(layer.down.weight.shape[1])
        self.eps = float(layer.eps)
        self.scale = float(layer.scale)
        self.cos_sin: torch.Tensor = layer.cos_sin_cache
        self.qkv_n = (self.heads + 2 * self.kv_heads) * self.head_dim

    def same(self, other: _Geometry) -> bool:
        names = ("hidden", "heads", "kv_heads", "head_dim", "inter", "eps", "scale", "qkv_n")
        return all(getattr(self, n) == getattr(other, n) for n in names) and (
            self.cos_sin is other.cos_sin
        )


class CpuDecoderStack:
    """`KernelTable.decoder_stack` for one model's table: builds the plan on the first call
    (after the tuner ran; rebuilt when the tuner's plans change) and runs the layers in one
    native call where the plan allows it, else returns None."""

    def __init__(self, kernels: native.NativeKernels, linear: CpuLinear, gguf: Any) -> None:
        self.kernels = kernels
        self.linear = linear
        self.gguf = gguf if isinstance(gguf, CpuGGUFLinear) else None
        self._layers_ref: Sequence[StackLayer] | str | None = None
        self._versions: tuple[int, int] = (-1, -1)
        self._geometry: _Geometry | None = None
        # Row bucket key ((T - 1).bit_length()) -> the layers' structs (None: not native there).
        self._plans: dict[int, ctypes.Array[WickLayer] | None] = {}
        self._kv_caches: Sequence[Any] | None = None
        self._logged = False

    # ---- the plan -------------------------------------------------------------------------

    def _versions_now(self) -> tuple[int, int]:
        return self.linear.version, -1 if self.gguf is None else self.gguf.version

    def _reset(self, layers: Sequence[StackLayer] | str, dtype: torch.dtype) -> None:
        self._layers_ref = layers
        self._versions = self._versions_now()
        self._plans = {}
        self._kv_caches = None
        reason = layers if isinstance(layers, str) else _dtype_reason(layers, dtype)
        self._geometry = None
        if reason is None:
            assert not isinstance(layers, str)
            self._geometry = _Geometry(layers[0], dtype)
            for layer in layers:
                if not _Geometry(layer, dtype).same(self._geometry):
                    reason = "the layers differ in shape"
                    self._geometry = None
                    break
        if not self._logged:
            self._logged = True
            if reason is None:
                logger.info(
                    "decoder layers: one native call per step where every matmul has a native "
                    "kernel (kernels/cpu/decoder_stack.c)"
                )
            else:
                logger.debug("decoder layers run module by module: %s", reason)

    def _linear(self, module: nn.Module, key: int, dtype: torch.dtype) -> WickLinear | None:
        """How `module` multiplies at row bucket `key` natively, or None."""
        weight = module.weight
        bias = module.bias
        if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
            return None
        out = WickLinear()
        out.bias = None if bias is None else bias.data_ptr()
        if isinstance(weight, torch.Tensor) and not isinstance(weight, nn.Module):
            panels = self.linear.panels_of(weight)
            if panels is None or panels.dtype != dtype:
                return None
            out.kind = LINEAR_PANELS_BF16 if panels.pairs else LINEAR_PANELS_F32
            out.n, out.k = panels.n, panels.k
            out.data = panels.data.data_ptr()
            out.min_work_per_thread = PANEL_MIN_WORK
            return out
        if self.gguf is None or getattr(weight, "method", "") != "gguf":
            return None
        parts = weight.segments()
        if len(parts) > MAX_SEGMENTS or (len(parts) > 1 and bias is not None):
            return None
        out.kind = LINEAR_GGUF
        out.num_segments = len(parts)
        out.n, out.k = int(weight.shape[0]), int(weight.shape[1])
        out.min_work_per_thread = GGUF_MIN_WORK
        for i, (ggml_type, blocks) in enumerate(parts):
            fns = self.gguf.plan_of((ggml_type, blocks.shape[0], blocks.shape[1]), dtype)
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

    def _plan(
        self, layers: Sequence[StackLayer], key: int, kv_caches: Sequence[Any], dtype: torch.dtype
    ) -> ctypes.Array[WickLayer] | None:
        matmuls = default_kernels()
        if matmuls is None or matmuls.isa != self.kernels.isa:
            # The matmuls run the process's first build (gemm.default_kernels), packed for its
            # ISA; this table's is another (a test switched WICK_CPU_ISA): one call cannot mix.
            return None
        structs = (WickLayer * len(layers))()
        for s, layer, kv in zip(structs, layers, kv_caches, strict=True):
            parts = {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down}
            for name, module in parts.items():
                linear = self._linear(module, key, dtype)
                if linear is None:
                    return None
                setattr(s, name, linear)
            if s.gate_up.kind in (LINEAR_PANELS_BF16, LINEAR_PANELS_F32):
                if not self.linear.fuses_silu(layer.gate_up.weight):
                    return None  # unfused panels: the module path (odd intermediate sizes)
                s.fuse_silu = 1
            s.input_norm = layer.input_norm.data_ptr()
            s.post_attention_norm = layer.post_attention_norm.data_ptr()
            if isinstance(kv, QuantizedKVCache):
                data = kv.data
                s.k_scales, s.v_scales = kv.scales[0].data_ptr(), kv.scales[1].data_ptr()
            else:
                data = kv
            s.k_cache, s.v_cache = data[0].data_ptr(), data[1].data_ptr()
        return structs

    # ---- a step ---------------------------------------------------------------------------

    def __call__(
        self,
        layers: Sequence[StackLayer] | str,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_caches: Sequence[Any],
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the last layer's MLP output, the residual stream before it) as the layers' modules
        return them, or None where the native stack does not apply. `layers`: the model's
        description of its layers, or why it has none (logged once)."""
        dtype = hidden_states.dtype
        if layers is not self._layers_ref or self._versions != self._versions_now():
            self._reset(layers, dtype)
        geo = self._geometry
        num_tokens = hidden_states.shape[0]
        if geo is None or dtype != geo.dtype or num_tokens == 0 or not kv_caches:
            return None
        assert not isinstance(layers, str)
        if hidden_states.dim() != 2 or not hidden_states.is_contiguous():
            return None
        if kv_caches is not self._kv_caches:
            first = kv_caches[0]
            first = first.data if isinstance(first, QuantizedKVCache) else first
            if native.unsupported_reason(hidden_states, first[0], geo.head_dim) is not None:
                return None
            self._plans, self._kv_caches = {}, kv_caches
        key = max(num_tokens - 1, 0).bit_length()
        if key not in self._plans:
            self._plans[key] = self._plan(layers, key, kv_caches, dtype)
        plan = self._plans[key]
        if plan is None:
            return None
        return self._run(plan, geo, positions, hidden_states, kv_caches[0], attn_metadata)

    def _run(
        self,
        plan: ctypes.Array[WickLayer],
        geo: _Geometry,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv0: Any,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t = hidden.shape[0]
        sizes = {
            "normed": geo.hidden,
            "qkv": geo.qkv_n,
            "q_rot": geo.heads * geo.head_dim,
            "k_rot": geo.kv_heads * geo.head_dim,
            "attn": geo.heads * geo.head_dim,
            "proj": geo.hidden,
            "residual_a": geo.hidden,
            "residual_b": geo.hidden,
            "gate_up": 2 * geo.inter,
            "mid": geo.inter,
            "segment": max(geo.qkv_n, 2 * geo.inter, geo.hidden),
            "hidden_out": geo.hidden,
        }
        # One allocation, carved into 64-byte aligned rows of buffers.
        offsets, total = {}, 0
        for name in _BUFFERS:
            offsets[name] = total
            total += -(-t * sizes[name] // 32) * 32
        arena = torch.empty(total, dtype=geo.dtype)
        base, esize = arena.data_ptr(), arena.element_size()
        step = WickStackStep()
        step.dtype = 1 if geo.dtype == torch.bfloat16 else 0
        step.num_threads = torch.get_num_threads()
        step.num_tokens, step.hidden = t, geo.hidden
        step.num_heads, step.num_kv_heads, step.head_dim = geo.heads, geo.kv_heads, geo.head_dim
        step.intermediate, step.eps, step.scale = geo.inter, geo.eps, geo.scale
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        slots = md.slot_mapping
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()
        tables = native._int32(md.block_tables)
        starts, lens = native._int32(md.query_start_loc), native._int32(md.seq_lens)
        step.positions, step.cos_sin = positions.data_ptr(), geo.cos_sin.data_ptr()
        step.max_position = geo.cos_sin.shape[0]
        cache = kv0.data[0] if isinstance(kv0, QuantizedKVCache) else kv0[0]
        num_blocks, block_size = cache.shape[0], cache.shape[1]
        step.slot_mapping, step.num_slots = slots.data_ptr(), num_blocks * block_size
        step.block_tables, step.bt_stride = tables.data_ptr(), tables.stride(0)
        step.query_start_loc, step.seq_lens = starts.data_ptr(), lens.data_ptr()
        step.num_seqs, step.block_size = lens.shape[0], block_size
        step.kv_format = native._KV_FORMATS[cache.dtype]
        step.norm_min_work = layer_ops.MIN_ELEMENTS_PER_THREAD
        step.attn_min_work = native.MIN_WORK_PER_THREAD
        step.hidden_in = hidden.data_ptr()
        for name in _BUFFERS:
            setattr(step, name, base + offsets[name] * esize)
        which = ctypes.c_int(0)
        # ctypes drops the GIL for the call, so the HTTP event loop keeps running meanwhile.
        status = self.kernels.lib.wick_decoder_stack(
            ctypes.addressof(step), ctypes.addressof(plan), len(plan), ctypes.addressof(which)
        )
        if status != 0:
            layer, stage = (-status) >> 4, (-status) & 15
            if stage == 3:  # the rotary kernel's only refusal
                raise IndexError(
                    f"rotary embedding: a position is outside the cache's {geo.cos_sin.shape[0]}"
                )
            raise RuntimeError(
                f"native decoder stack: layer {layer}'s {_STAGES.get(stage, stage)} failed "
                f"(kernel status {step.status})"
            )

        def view(name: str) -> torch.Tensor:
            return arena[offsets[name] : offsets[name] + t * geo.hidden].view(t, geo.hidden)

        return view("hidden_out"), view("residual_a" if which.value == 0 else "residual_b")


def _dtype_reason(layers: Sequence[StackLayer], dtype: torch.dtype) -> str | None:
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (the kernels take float32 and bfloat16)"
    if not layers:
        return "no layers"
    for i, layer in enumerate(layers):
        tensors = (layer.input_norm, layer.post_attention_norm, layer.cos_sin_cache)
        if any(t.dtype != dtype or not t.is_contiguous() or not t.is_cpu for t in tensors):
            return f"layer {i}'s norms or rotary cache are not contiguous {dtype} CPU tensors"
    return None
