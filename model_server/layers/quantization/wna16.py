"""GPTQ and AWQ checkpoints kept quantized: 4- or 8-bit weights with per-group scales and zero
points, served as `WNA16Weight` ("wNa16": N-bit weights, 16-bit or float32 activations).

Both formats are repacked at load into one layout (kernels/portable.py, "wNa16"): codes as uint8
([N, K / 2] nibbles for 4 bits, [N, K] bytes for 8), and float32 scales and offsets [N, G] with
W[n, k] = scale * q + offset (offset = -scale * zero). One set of kernels serves both formats
(the model's `KernelTable.wna16_linear`).

The checkpoints, as the common tools write them (W [N, K] is the HF Linear's weight; the
checkpoint stores its transpose, K rows; pack = 32 / bits codes per int32, low bits first):

GPTQ (AutoGPTQ, GPTQModel, optimum; `quant_method: gptq`, bits 4 or 8):
    qweight [K / pack, N] int32   codes of k = pack * i + j in bits [bits * j, bits * (j + 1))
    qzeros  [G, N / pack] int32   zero points, packed the same way along N
    scales  [G, N] float16
    g_idx   [K] int32             the group of each k (act-order, `desc_act`, permutes it)
    W[n, k] = scales[g, n] * (q[k, n] - zero[g, n]),  g = g_idx[k]
  `checkpoint_format` "gptq" (the default, what AutoGPTQ and most published checkpoints use)
  stores zero - 1 ("v1"): the zero read is the stored value + 1, as the exllama/vLLM kernels read
  it. "gptq_v2" (GPTQModel's internal format) stores the zero itself. Both are read.
  With `desc_act`, K is permuted at load so that groups are contiguous (argsort of g_idx) and
  each matmul gathers x's columns in that order (`WNA16Weight.perm`).

AWQ (AutoAWQ GEMM; `quant_method: awq`, `version: gemm`, bits 4, zero_point true):
    qweight [K, N / 8] int32      codes of n = 8 i + ORDER[j] in bits [4 j, 4 j + 4),
                                  ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
    qzeros  [G, N / 8] int32      zero points, packed the same way
    scales  [G, N] float16
    W[n, k] = scales[g, n] * (q[k, n] - zero[g, n]),  g = k // group_size
Where group_size does not divide K, the last group is short and G = ceil(K / group_size) (as the
tools cut SmolLM2's 576 features: four groups of 128 and one of 64).

Tensor parallelism: column-parallel layers split N (a rank's part of an N-packed tensor must
start on a whole int32: N / tp a multiple of 8 codes); row-parallel layers split K along whole
groups (refused where a group would straddle two ranks, and for act-order checkpoints, whose
groups are scattered over K). The LM head and the embeddings stay float (the tools leave them
unquantized), and so do the MoE routers and the modules a checkpoint lists in
`modules_to_not_convert`. MoE experts: wna16_moe.py, with the same tensors per expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from model_server.kernels.portable import WNA16_BLOCK, dequantize_wna16, pack_int4
from model_server.kernels.table import KernelTable
from model_server.layers.quantization.base import QuantizedWeight

SUPPORTED_METHODS = ("gptq", "awq")
# AWQ's nibble order within an int32: bits [4 j, 4 j + 4) hold column AWQ_ORDER[j] of 8.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Column c of 8 sits in nibble AWQ_REVERSE_ORDER[c] (the inverse permutation).
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


class WNA16Codes(QuantizedWeight):
    """The tensors of the wNa16 layout (kernels/portable.py): 4- or 8-bit `codes` uint8 with
    per-group float32 `scales` and `offsets`, and `perm` int64 for act-order checkpoints (the
    K order the codes are stored in), for one matrix (`WNA16Weight`) or stacked over experts
    (`WNA16Experts`)."""

    def __init__(
        self,
        method: str,
        bits: int,
        group_size: int,
        codes: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor,
        perm: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.method = method
        self.bits = bits
        self.group_size = group_size  # K for per-channel
        self.codes = nn.Parameter(codes, requires_grad=False)
        self.scales = nn.Parameter(scales, requires_grad=False)
        self.offsets = nn.Parameter(offsets, requires_grad=False)
        self.perm = None if perm is None else nn.Parameter(perm, requires_grad=False)


class WNA16Weight(WNA16Codes):
    """W [N, K]: codes [N, K / 2] (4 bits) or [N, K] (8 bits), scales and offsets [N, G];
    `perm` [K] (act-order): the matmul multiplies x[:, perm]."""

    @property
    def shape(self) -> torch.Size:
        n, stored = self.codes.shape
        return torch.Size((n, stored * 8 // self.bits))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = dequantize_wna16(
            self.codes, self.scales, self.offsets, self.bits, self.group_size, dtype
        )
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w  # stored column i is input feature perm[i]
        return out

    def apply(
        self, x: torch.Tensor, bias: torch.Tensor | None, kernels: KernelTable
    ) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        out = kernels.wna16_linear(
            x2, self.codes, self.scales, self.offsets, self.bits, self.group_size, bias
        )
        return out.view(*lead, out.shape[-1])

    def extra_repr(self) -> str:
        n, k = self.shape
        group = "per-channel" if self.group_size == k else f"group {self.group_size}"
        order = ", act-order" if self.perm is not None else ""
        return f"{self.method} w{self.bits} ({n}, {k}), {group}{order}"


# ---- the checkpoint's quantization_config -------------------------------------------------------


def _field(qc: dict[str, Any], name: str, default: Any = None) -> Any:
    return qc.get(name, default)


@dataclass(slots=True, frozen=True)
class WNA16Config:
    """A checkpoint's `quantization_config`, parsed (`from_hf_config`), and the quant method its
    linear layers are built with (layers/quantization/base.py `LinearQuantMethod`)."""

    method: str  # "gptq" | "awq"
    bits: int
    group_size: int  # -1: per channel
    desc_act: bool = False
    # GPTQ "v1": the stored zero is zero - 1 (see the module docstring).
    zeros_minus_one: bool = False
    # Modules the checkpoint keeps in float (transformers' matching: models/quantization.py).
    modules_to_not_convert: tuple[str, ...] = ()

    @property
    def pack(self) -> int:
        return 32 // self.bits

    @property
    def description(self) -> str:
        """For logs and /v1/models: "gptq w4 g128 act-order", "awq w4 g64"."""
        group = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        extra = " act-order" if self.desc_act else ""
        return f"{self.method} w{self.bits} {group}{extra}"

    @staticmethod
    def from_quantization_config(qc: Any) -> WNA16Config:
        """ValueError naming the field for anything this module cannot serve."""
        if not isinstance(qc, dict):
            raise ValueError(f"quantization_config must be an object, got {type(qc).__name__}")
        method = str(_field(qc, "quant_method", "")).lower()
        if method not in SUPPORTED_METHODS:
            raise ValueError(
                f"quantization_config.quant_method {method or None!r} is not supported "
                f"(checkpoints kept quantized: {', '.join(SUPPORTED_METHODS)})"
            )
        bits = _field(qc, "bits", _field(qc, "w_bit"))
        allowed_bits = (4, 8) if method == "gptq" else (4,)
        if bits not in allowed_bits:
            raise ValueError(
                f"quantization_config.bits {bits!r} is not supported for {method} "
                f"({' or '.join(map(str, allowed_bits))})"
            )
        group_size = _field(qc, "group_size", _field(qc, "q_group_size"))
        if not isinstance(group_size, int) or not (
            group_size == -1 or (group_size > 0 and group_size % WNA16_BLOCK == 0)
        ):
            raise ValueError(
                f"quantization_config.group_size {group_size!r} is not supported "
                f"(-1 for per-channel, or a multiple of {WNA16_BLOCK}: 32, 64, 128, ...)"
            )
        skip = _field(qc, "modules_to_not_convert") or []
        if not isinstance(skip, list | tuple) or not all(isinstance(m, str) for m in skip):
            raise ValueError(
                f"quantization_config.modules_to_not_convert {skip!r} is not a list of names"
            )
        skip = tuple(skip)
        if method == "awq":
            version = str(_field(qc, "version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(
                    f"quantization_config.version {version!r} is not supported for awq (gemm)"
                )
            if not _field(qc, "zero_point", True):
                raise ValueError("quantization_config.zero_point false is not supported for awq")
            return WNA16Config("awq", bits, group_size, modules_to_not_convert=skip)
        fmt = str(_field(qc, "checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(
                f"quantization_config.checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)"
            )
        desc_act = bool(_field(qc, "desc_act", False))
        return WNA16Config(
            "gptq", bits, group_size, desc_act, fmt == "gptq", modules_to_not_convert=skip
        )

    # ---- LinearQuantMethod ------------------------------------------------------------------

    def _groups(self, k: int) -> int:
        return 1 if self.group_size == -1 else -(-k // self.group_size)

    def check_split(self, k_start: int, k: int, k_total: int, where: str) -> None:
        """ValueError unless this rank's input features [k_start, k_start + k) of k_total
        start a group (only the last rank may end in a short one) and, for act-order
        checkpoints, are all of them."""
        # Every rank's features start a group; only the last rank may end in a short group.
        last = k_start + k == k_total
        if self.group_size != -1 and (
            k_start % self.group_size or (k % self.group_size and not last)
        ):
            raise ValueError(
                f"{self.description}: a group of {self.group_size} input features would "
                f"straddle two tensor-parallel ranks in {where} (this rank's input features "
                f"{k_start}-{k_start + k} of {k_total}); use fewer ranks"
            )
        if self.desc_act and k != k_total:
            raise ValueError(
                f"{self.description}: act-order (desc_act) checkpoints cannot split a "
                f"row-parallel layer's input features over ranks ({where}); use one rank"
            )

    def checkpoint_shapes(self, n: int, k: int) -> dict[str, tuple[int, ...]]:
        """The checkpoint tensors of a [n, k] matrix (this rank's shard) and their shapes."""
        pack, groups = self.pack, self._groups(k)
        if self.method == "gptq":
            return {
                "qweight": (k // pack, n),
                "qzeros": (groups, n // pack),
                "scales": (groups, n),
                "g_idx": (k,),
            }
        return {"qweight": (k, n // pack), "qzeros": (groups, n // pack), "scales": (groups, n)}

    def create_weights(self, layer: nn.Module) -> None:
        """The checkpoint's tensors for this rank's shard of `layer` (a LinearBase), int32
        codes and float32 scales, each with a loader that slices the whole checkpoint tensor."""
        n, k = layer.output_size, layer.input_size
        for name, shape in self.checkpoint_shapes(n, k).items():
            dtype = torch.float32 if name == "scales" else torch.int32
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            param.weight_loader = partial(self._load, layer, name)  # type: ignore[attr-defined]
            layer.register_parameter(name, param)

    def _units(self, name: str) -> tuple[int, int]:
        """(codes along K, codes along N) per stored element of tensor `name`, 0: no such dim
        (g_idx has no N; per-channel scales and zeros have one group whatever K is)."""
        per_k = {"qweight": self.pack if self.method == "gptq" else 1, "g_idx": 1}.get(
            name, 0 if self.group_size == -1 else self.group_size
        )
        per_n = {"qzeros": self.pack, "scales": 1, "g_idx": 0}.get(
            name, 1 if self.method == "gptq" else self.pack
        )
        return per_k, per_n

    def _load(
        self,
        layer: nn.Module,
        name: str,
        param: nn.Parameter,
        loaded: torch.Tensor,
        shard_id: int | str | None = None,
    ) -> None:
        """Copy this rank's part of a whole checkpoint tensor (of part `shard_id` of a fused
        layer) into `param`; ValueError naming the tensor for a shape that does not fit."""
        label = getattr(param, "checkpoint_name", name) + (
            f" (part {shard_id})" if shard_id is not None else ""
        )
        seen: set[int | str] = layer.__dict__.setdefault("_g_idx_parts", set())
        self.load_tensor(layer, name, param.data, loaded, label, shard_id, seen)

    def load_tensor(
        self,
        geometry: Any,
        name: str,
        target: torch.Tensor,
        loaded: torch.Tensor,
        label: str,
        shard_id: int | str | None,
        g_idx_parts: set[int | str],
    ) -> None:
        """Copy this rank's part of checkpoint tensor `name` ("qweight", "qzeros", "scales",
        "g_idx") of a matrix into `target`. `geometry` says where this rank's shard lies, as a
        LinearBase does (`input_shard()`, `output_shard(shard_id)`); `g_idx_parts`: the parts
        of the fused matrix whose g_idx was loaded (they must agree). ValueError naming `label`
        for a tensor that does not fit."""
        per_k, per_n = self._units(name)
        k_start, k_size, k_total = geometry.input_shard()
        # Checked here, not at construction: the layer may yet be left float
        # (`modules_to_not_convert`, applied once the model is built).
        self.check_split(k_start, k_size, k_total, label)
        expected: list[int] = []
        source = loaded
        grouped = name in ("qzeros", "scales")  # one row per group, the last may be short
        if per_k:
            if k_total % per_k and not grouped:
                raise ValueError(
                    f"{label}: {k_total} input features are not a whole number of "
                    f"{per_k}-feature rows"
                )
            expected.append(-(-k_total // per_k))
        else:
            expected.append(1)
        if per_n:
            offset, size, start, total = geometry.output_shard(shard_id)
            for what, value in (("output features", total), ("this rank's share", size)):
                if value % per_n:
                    raise ValueError(
                        f"{label}: {what} ({value}) are not a multiple of the {per_n} "
                        "codes packed per int32"
                    )
            if start % per_n or offset % per_n:
                raise ValueError(
                    f"{label}: this rank's output features start at {start}, inside a "
                    f"packed int32 of {per_n} codes"
                )
            expected.append(total // per_n)
        if list(loaded.shape) != expected:
            raise ValueError(
                f"{label}: checkpoint tensor has shape {tuple(loaded.shape)}, expected "
                f"{tuple(expected)} for {self.description} with {k_total} input features"
            )
        if per_k and k_size != k_total:
            source = source.narrow(0, k_start // per_k, -(-k_size // per_k))
            if name == "g_idx" and self.group_size != -1:
                # This rank's groups count from its first one (a whole group: create_weights).
                source = source - k_start // self.group_size
        if per_n:
            source = source.narrow(1, start // per_n, size // per_n)
            target = target.narrow(1, offset // per_n, size // per_n)
        if name == "g_idx" and shard_id is not None:
            # One g_idx per fused layer: the parts share their input, so act-order gives them
            # the same order (GPTQ sorts by the input's Hessian diagonal).
            if g_idx_parts and not torch.equal(target, source.to(target.dtype)):
                raise ValueError(
                    f"{label}: differs from the g_idx of the layer's other parts "
                    f"({', '.join(map(str, sorted(g_idx_parts, key=str)))}), which it is fused "
                    "with"
                )
            g_idx_parts.add(shard_id)
        if name != "scales" and source.is_floating_point():
            raise ValueError(f"{label}: expected an int32 tensor, got {source.dtype}")
        if name == "scales" and not source.is_floating_point():
            raise ValueError(f"{label}: expected a float tensor, got {source.dtype}")
        target.copy_(source)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack the loaded checkpoint tensors into `layer.weight`, a WNA16Weight; the
        checkpoint-format tensors are released."""
        tensors = {name: getattr(layer, name).data for name in ("qweight", "qzeros", "scales")}
        g_idx = layer.g_idx.data if self.method == "gptq" else None
        weight = repack(self, tensors["qweight"], tensors["qzeros"], tensors["scales"], g_idx)
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if name in layer._parameters:
                del layer._parameters[name]
        layer.weight = weight


def checkpoint_quantization(hf_config: Any) -> WNA16Config | None:
    """The kept-quantized format of a checkpoint (its config's `quantization_config`), or None
    for a float checkpoint; ValueError for one that cannot be served."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict) and hasattr(qc, "to_dict"):
        qc = qc.to_dict()
    return WNA16Config.from_quantization_config(qc)


def resolve_quantization(requested: str | None, checkpoint: WNA16Config | None) -> str | None:
    """What `--quantization` (parsed) does to a checkpoint: "int8" to quantize at load, or None
    (served as stored). gptq, awq and w8a16 (vLLM-GCU's names) name the checkpoint's own format:
    a match is accepted, anything else a ValueError saying what the checkpoint is."""
    if requested is None:
        return None
    what = "a float checkpoint (no quantization_config in its config.json)"
    if checkpoint is not None:
        what = f"a {checkpoint.description} checkpoint (its quantization_config)"
    if requested == "w8a16" and checkpoint is None:
        return "int8"  # int8 weights, activations in --dtype: W8A16, quantized at load
    if requested == "int8":
        if checkpoint is not None:
            raise ValueError(
                f"--quantization int8 cannot re-quantize a {checkpoint.method} checkpoint "
                f"({checkpoint.description}; it is served as it is quantized): drop the flag"
            )
        return "int8"
    matches = checkpoint is not None and (
        checkpoint.bits == 8 if requested == "w8a16" else checkpoint.method == requested
    )
    if not matches:
        hint = "-q int8 to quantize it at load" if checkpoint is None else "drop the flag"
        raise ValueError(f"--quantization {requested} does not match the model, {what}: {hint}")
    return None


# ---- unpacking ---------------------------------------------------------------------------------


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 codes packed along `dim`, low bits first -> int32 codes, `dim` 32 / bits times
    longer (in bit order; AWQ's order is undone by the caller)."""
    pack = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    moved = packed.movedim(dim, -1)
    codes = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., L, pack]
    return codes.reshape(*moved.shape[:-1], moved.shape[-1] * pack).movedim(-1, dim)


def _awq_columns(codes: torch.Tensor) -> torch.Tensor:
    """AWQ codes unpacked in bit order along the last dim -> in column order."""
    *lead, n = codes.shape
    grouped = codes.reshape(*lead, n // 8, 8)
    return grouped[..., list(AWQ_REVERSE_ORDER)].reshape(*lead, n)


def repack(
    config: WNA16Config,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
) -> WNA16Weight:
    """A layer's checkpoint tensors (this rank's shard) -> WNA16Weight."""
    bits = config.bits
    if config.method == "gptq":
        q = unpack_int32(qweight, bits, 0)  # [K, N]
        zeros = unpack_int32(qzeros, bits, 1)  # [G, N]
        if config.zeros_minus_one:
            zeros = zeros + 1
    else:
        q = _awq_columns(unpack_int32(qweight, bits, 1))
        zeros = _awq_columns(unpack_int32(qzeros, bits, 1))
    k = q.shape[0]
    group_size = k if config.group_size == -1 else config.group_size
    perm = None
    if g_idx is not None and config.group_size != -1:
        g = g_idx.long()
        in_order = torch.arange(k, device=g.device) // group_size
        if not torch.equal(g, in_order):
            # Act-order: the same groups as in order (all full but a short last one), scattered.
            want = torch.bincount(in_order)
            counts = torch.bincount(g.clamp(min=0), minlength=want.numel())
            if g.min() < 0 or not torch.equal(counts, want):
                raise ValueError(
                    f"g_idx: every group must hold {group_size} input features "
                    f"(got group sizes {sorted(set(counts.tolist()))})"
                )
            perm = torch.argsort(g, stable=True)
            q = q.index_select(0, perm)
    if bits == 4 and k % WNA16_BLOCK:
        raise ValueError(f"4-bit weights need input features a multiple of {WNA16_BLOCK}, got {k}")
    s = scales.float().t().contiguous()  # [N, G]
    offsets = (-s * zeros.t().float()).contiguous()
    q_nk = q.t().contiguous()
    codes = pack_int4(q_nk) if bits == 4 else q_nk.to(torch.uint8)
    return WNA16Weight(config.method, bits, group_size, codes, s, offsets, perm)
