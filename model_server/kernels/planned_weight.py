"""`PlannedWeight`: a linear layer's weight together with the kernels the platform planned for
it, per row bucket. The model-preparation stage puts one in `module.weight` of every linear
layer the platform planned (engine/execution/model_preparation.py); the layer calls
`weight.apply(x, bias, kernels)` as it calls a quantized weight's.

Nothing is hollowed: the holder keeps the weight's values, in the checkpoint's layout
(`source`: the float tensor, or the quantized weight) or, where the plan moved them into a
packed layout read by one kernel only (`packed`), there alone; `dequantize()` returns the
float matrix either way (a packed one by multiplying the identity through its own kernel,
exact: each output is one product by 1). `state_dict()` lists `source` or the packed bytes.

Row buckets: a call with M rows runs the kernel of bucket `bucket_index(M, len(kernels))`,
the smallest power of two >= M (the last bucket beyond).

A GGUF weight planned beside its float twin (`--gguf-weights auto`) holds both: its blocks
(`source`) run the buckets below `blocks_buckets`, the twin (`twin`, a float planned weight of
the same matrix) the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from model_server.kernels.table import KernelTable

# (x [M, K] 2-D, bias [N] | None) -> [M, N]: one planned kernel bound to the weight it reads.
BoundLinear = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def bucket_index(rows: int, num_buckets: int) -> int:
    """The bucket of `rows`: the smallest power of two >= rows, the last one beyond."""
    return min(max(rows - 1, 0).bit_length(), num_buckets - 1)


def bucket_ranges(names: Sequence[str], open_end: bool = True) -> str:
    """'rows 1-2 mm_t, 3-64 torch, 65+ native_panels' from one kernel name per bucket (bucket i
    holds up to 2^i rows). `open_end`: the last range reads "65+" (more rows than the last bucket
    run its kernel), else "65-128"."""
    parts: list[str] = []
    first = 0
    for i, name in enumerate(names):
        if i + 1 < len(names) and names[i + 1] == name:
            continue
        lo, hi = (1 << (first - 1)) + 1 if first else 1, 1 << i
        if i == len(names) - 1 and open_end:
            span = f"{lo}+"
        else:
            span = f"{lo}" if lo == hi else f"{lo}-{hi}"
        parts.append(f"{span} {name}")
        first = i + 1
    return "rows " + ", ".join(parts)


@dataclass(slots=True, frozen=True)
class RowBucketDispatch:
    """A kernel-table slot for one weight: the planned function of each row bucket, called with
    the slot's own arguments (x [M, K] first). Immutable: made once by the platform's plan."""

    fns: tuple[Callable[..., torch.Tensor], ...]

    def __call__(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        return self.fns[bucket_index(x.shape[0], len(self.fns))](x, *args)


@dataclass(slots=True, frozen=True)
class GGUFSegmentDispatch:
    """`KernelTable.gguf_linear` for one GGUF weight: per segment (ggml type, rows), the planned
    function of each row bucket; a segment the plan does not name runs `fallback`."""

    by_segment: tuple[tuple[tuple[int, int], tuple[Callable[..., torch.Tensor], ...]], ...]
    fallback: Callable[..., torch.Tensor]

    def __call__(
        self, x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        key = (ggml_type, blocks.shape[0])
        for segment, fns in self.by_segment:
            if segment == key:
                return fns[bucket_index(x.shape[0], len(fns))](x, blocks, ggml_type, bias)
        return self.fallback(x, blocks, ggml_type, bias)


class PlannedWeight(nn.Module):
    """W [N, K] of one linear layer with its planned kernels (see the module docstring).

    Float weights: `calls` holds one bound kernel per row bucket (`BoundLinear`: it reads
    `source` or `packed` itself). Quantized weights (int8, GPTQ/AWQ, GGUF): `source.apply` runs
    with `kernels`, the layer's table with this weight's planned slot in place."""

    def __init__(
        self,
        *,
        shape: tuple[int, int],
        dtype: torch.dtype,
        kernel_names: Sequence[str],
        layout: str,
        source: torch.Tensor | nn.Module | None,
        calls: Sequence[BoundLinear] = (),
        kernels: KernelTable | None = None,
        packed: Any = None,
        packed_data: torch.Tensor | None = None,
        fused_silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None,
        twin: PlannedWeight | None = None,
        blocks_buckets: int = 0,
    ) -> None:
        super().__init__()
        if source is None and packed is None:
            raise ValueError("a planned weight holds its values: give a source or a packed copy")
        if isinstance(source, torch.Tensor):
            # The checkpoint's tensor itself (shared with a tied embedding where there is one).
            self.source = source if isinstance(source, nn.Parameter) else nn.Parameter(source)
            self.source.requires_grad_(False)
        else:
            self.source = source  # a QuantizedWeight module, or None (values only in `packed`)
        if packed_data is not None:
            # The packed copy's bytes, listed by parameters() (bandwidth accounting, memory).
            self.packed_data = nn.Parameter(packed_data, requires_grad=False)
        self.packed = packed  # Panels, a oneDNN packed tensor, or None
        self._shape = torch.Size(shape)
        self._dtype = dtype
        self.kernel_names = tuple(kernel_names)
        self.layout = layout
        self.calls = tuple(calls)
        self.kernels = kernels
        self.fused_silu_and_mul = fused_silu_and_mul
        self.twin = twin  # a submodule: its values are listed by state_dict() too
        self.blocks_buckets = blocks_buckets
        if twin is not None and (
            not isinstance(source, nn.Module) or kernels is None or twin.shape != self._shape
        ):
            raise ValueError("a float twin stands beside a quantized source of its shape")
        if not self.calls and (kernels is None or not isinstance(source, nn.Module)):
            raise ValueError("a planned weight needs bound kernels or a quantized source's table")

    @property
    def shape(self) -> torch.Size:
        """(N, K) of the float matrix."""
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        """The float matrix's dtype (a quantized source's activation dtype)."""
        return self._dtype

    @property
    def method(self) -> str:
        """The source's quantization method ("" for a float weight)."""
        return str(getattr(self.source, "method", ""))

    def apply(
        self, x: torch.Tensor, bias: torch.Tensor | None, kernels: KernelTable | None = None
    ) -> torch.Tensor:
        """x [..., K] @ W^T + bias -> [..., N] with the planned kernel for x's row count."""
        if not self.calls:
            assert isinstance(self.source, nn.Module) and self.kernels is not None
            return self.source.apply(x, bias, self.kernels)  # type: ignore[operator]
        if x.dim() != 2:
            out = self.apply(x.reshape(-1, x.shape[-1]), bias)
            return out.view(*x.shape[:-1], out.shape[-1])
        if x.shape[0] == 0:
            return x.new_empty((0, self._shape[0]))
        return self.calls[bucket_index(x.shape[0], len(self.calls))](x, bias)

    def at_bucket(self, index: int) -> PlannedWeight:
        """The planned weight that runs row bucket `index`: the twin past `blocks_buckets`."""
        if self.twin is not None and index >= self.blocks_buckets:
            return self.twin
        return self

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(x @ gate^T) * (x @ up^T) in one pass where the plan fused it (a merged gate/up
        weight on panels), else None: the layer runs `apply` and its activation."""
        if x.dim() != 2 or x.dtype != self._dtype:
            return None
        weight = self.at_bucket(bucket_index(x.shape[0], len(self.kernel_names)))
        if weight.fused_silu_and_mul is None:
            return None
        return weight.fused_silu_and_mul(x)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float matrix [N, K] (references, tests, slow paths)."""
        dtype = dtype or self._dtype
        if isinstance(self.source, torch.Tensor):
            return self.source.detach().to(dtype)
        if self.source is not None:
            return self.source.dequantize(dtype)  # type: ignore[operator]
        # Only the packed copy holds the values: I [K, K] through the kernel gives W^T exactly.
        k = self._shape[1]
        cols = []
        for start in range(0, k, 256):
            rows = torch.arange(min(256, k - start))
            eye = torch.zeros(rows.shape[0], k, dtype=self._dtype)
            eye[rows, start + rows] = 1
            cols.append(self.apply(eye, None))
        return torch.cat(cols).t().contiguous().to(dtype)

    def extra_repr(self) -> str:
        n, k = self._shape
        kind = self.method or str(self._dtype).removeprefix("torch.")
        layout = self.layout
        if self.twin is not None:
            layout += f" + float twin ({self.twin.layout})"
        return f"{kind} ({n}, {k}), {layout}: {bucket_ranges(self.kernel_names)}"


@dataclass(slots=True, frozen=True)
class LinearPlan:
    """A platform's plan for a model's linear layers (`Platform.plan_linears`): the planned
    weight of each planned module (by name in the model) and one line per (kind, shape) that
    says what was chosen at which row counts and why (timed, cached)."""

    weights: Mapping[str, PlannedWeight] = field(default_factory=dict)
    lines: tuple[str, ...] = ()
