"""GGUF weights kept in their block layout (llama.cpp's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the
K-quants Q2_K..Q6_K): no dequantized float copy, the matmul decodes the blocks as it reads them.

A GGUF matrix [N, K] is stored row by row, each row K / block_values blocks (kernels/
gguf_blocks.py has the block shapes), so rows are independent: any set of rows is a valid GGUF
matrix, and a range of columns is one when it starts and ends on block boundaries. That is all
tensor parallelism needs:
  - column-parallel layers (q/k/v, gate/up, the vocabulary of the LM head) take whole rows;
  - row-parallel layers (o_proj, down_proj) take a range of columns, which must be aligned to
    the type's block (32 values, 256 for the K-quants); otherwise loading fails naming the
    tensor and the split.

`GGUFTensor` is a checkpoint matrix as the GGUF loader yields it when weights are kept
quantized; `GGUFWeight` stands in a layer's `weight` (a `QuantizedWeight`: `layers.linear.dense`
dispatches on it) as one or more row segments stacked along N, each of one ggml type (a fused
qkv_proj may hold a Q4_K q/k and a Q6_K v; a float tensor in the file becomes a float segment).
The matmul is the model's `KernelTable.gguf_linear`; embedding lookups dequantize only the
gathered rows (`KernelTable.gguf_dequantize`). `install_gguf_weight` builds one from the parts
the model's `load_weights` hands a layer, with the same shard arithmetic as the layer's float
weight loader.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from model_server.kernels.gguf_blocks import (
    BLOCK_TYPES,
    FLOAT_TYPES,
    block_shape,
    dequantize_rows,
    row_bytes,
    type_name,
)
from model_server.kernels.table import KernelTable
from model_server.layers.quantization.base import QuantizedWeight

# ggml types a weight can be kept in (the block formats, and floats for mixed fused layers).
KEPT_TYPES = frozenset(BLOCK_TYPES)
_FLOAT_CODES = {dtype: code for code, dtype in FLOAT_TYPES.items()}


@dataclass(slots=True, frozen=True)
class GGUFTensor:
    """A checkpoint matrix in its GGUF layout: data uint8 [N, row_bytes] holds `shape` (N, K)
    values of `ggml_type`. `name` is the file's tensor name, for error messages."""

    name: str
    ggml_type: int
    shape: tuple[int, int]
    data: torch.Tensor

    @classmethod
    def from_float(cls, name: str, tensor: torch.Tensor) -> GGUFTensor:
        """A float matrix as a float-typed GGUF tensor (its bytes, row by row)."""
        tensor = tensor.contiguous()
        if tensor.dtype not in _FLOAT_CODES:
            tensor = tensor.float()
        n, k = tensor.shape
        data = tensor.view(torch.uint8).reshape(n, k * tensor.element_size())
        return cls(name, _FLOAT_CODES[tensor.dtype], (n, k), data)

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    def rows(self, start: int, size: int) -> GGUFTensor:
        return GGUFTensor(self.name, self.ggml_type, (size, self.shape[1]),
                          self.data[start : start + size])  # fmt: skip

    def columns(self, start: int, size: int) -> GGUFTensor:
        """Columns [start, start + size): both ends must fall on block boundaries."""
        elems, nbytes = block_shape(self.ggml_type)
        if start % elems or size % elems:
            raise ValueError(
                f"{self.name}: a tensor-parallel split at columns {start}..{start + size} cuts "
                f"through {self.type_name} blocks of {elems} values; choose a "
                "--tensor-parallel-size that splits the input features at multiples of "
                f"{elems}, or load the GGUF dequantized (--gguf-weights dequantized)"
            )
        first = start // elems * nbytes
        return GGUFTensor(self.name, self.ggml_type, (self.shape[0], size),
                          self.data[:, first : first + size // elems * nbytes])  # fmt: skip

    def permute_rows(self, index: torch.Tensor) -> GGUFTensor:
        """Rows reordered: row i of the result is row index[i] of this one."""
        return GGUFTensor(self.name, self.ggml_type, self.shape, self.data[index])

    def padded_rows(self, rows: int) -> GGUFTensor:
        """Zero rows appended up to `rows` (all-zero blocks decode to zeros in every format)."""
        extra = rows - self.shape[0]
        if extra <= 0:
            return self
        pad = self.data.new_zeros((extra, self.data.shape[1]))
        return GGUFTensor(self.name, self.ggml_type, (rows, self.shape[1]),
                          torch.cat((self.data, pad)))  # fmt: skip

    def check(self) -> None:
        """A ValueError naming the tensor when its bytes do not hold its shape."""
        n, k = self.shape
        try:
            expected = (n, row_bytes(self.ggml_type, k))
        except ValueError as exc:
            raise ValueError(f"{self.name}: {exc}") from None
        if tuple(self.data.shape) != expected or self.data.dtype != torch.uint8:
            raise ValueError(
                f"{self.name}: {self.type_name} data of shape {tuple(self.data.shape)} does not "
                f"hold a [{n}, {k}] matrix (expected {expected[0]} rows of {expected[1]} bytes)"
            )


class GGUFWeight(QuantizedWeight):
    """W [N, K] as row segments in GGUF block layouts, stacked along N.

    `dtype` is the model's activation dtype: what embedding lookups and `dequantize()` return
    by default. Segment i's bytes are the parameter `blocks{i}` (uint8 [rows_i, row_bytes_i]).
    """

    method = "gguf"

    def __init__(self, segments: Sequence[GGUFTensor], dtype: torch.dtype) -> None:
        super().__init__()
        if not segments:
            raise ValueError("a GGUF weight needs at least one segment")
        k = segments[0].shape[1]
        for seg in segments:
            seg.check()
            if seg.shape[1] != k:
                raise ValueError(f"{seg.name}: {seg.shape[1]} columns, the other parts have {k}")
        self.k = k
        self.dtype = dtype
        self.types = tuple(seg.ggml_type for seg in segments)
        self.rows = tuple(seg.shape[0] for seg in segments)
        self.names = tuple(seg.name for seg in segments)
        for i, seg in enumerate(segments):
            # A private contiguous copy: not a view of the file's memory map.
            data = seg.data.contiguous().clone()
            self.register_parameter(f"blocks{i}", nn.Parameter(data, requires_grad=False))

    def segments(self) -> list[tuple[int, torch.Tensor]]:
        """(ggml type, blocks [rows, row_bytes]) per segment, in row order."""
        return [(t, getattr(self, f"blocks{i}")) for i, t in enumerate(self.types)]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(self.rows), self.k))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or torch.float32
        return torch.cat([dequantize_rows(b, t, self.k, dtype) for t, b in self.segments()])

    def apply(
        self, x: torch.Tensor, bias: torch.Tensor | None, kernels: KernelTable
    ) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        segments = self.segments()
        if len(segments) == 1:
            out = kernels.gguf_linear(x2, segments[0][1], segments[0][0], bias)
        else:
            out = torch.cat([kernels.gguf_linear(x2, b, t, None) for t, b in segments], dim=1)
            if bias is not None:
                out += bias
        return out.view(*lead, out.shape[-1])

    def lookup(self, ids: torch.Tensor, kernels: KernelTable) -> torch.Tensor:
        """Rows `ids` [T] of W (an embedding lookup) -> [T, K] in `dtype`: only they are
        decoded."""
        flat = ids.reshape(-1)
        if len(self.types) == 1:
            rows = kernels.gguf_dequantize(self.blocks0[flat], self.types[0], self.k, self.dtype)
        else:
            rows = self.dequantize(self.dtype)[flat]  # never for a real embedding (one tensor)
        return rows.view(*ids.shape, self.k)

    def extra_repr(self) -> str:
        pairs = zip(self.types, self.rows, strict=True)
        kinds = ", ".join(f"{type_name(t)} x{r}" for t, r in pairs)
        return f"gguf [{sum(self.rows)}, {self.k}]: {kinds}"


def weight_bytes(weight: GGUFWeight) -> int:
    return sum(b.numel() for _, b in weight.segments())
