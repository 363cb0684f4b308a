"""GGUF (llama.cpp) tensor types: block shapes and the portable dequantization and matmul.

A GGUF matrix [N, K] of a block type is stored row by row, each row K / block_elems blocks of
block_bytes (K is a multiple of the block, so rows never share a block); here it is a uint8
tensor [N, row_bytes]. `dequantize_rows` turns such rows into floats with torch ops for the
32-value formats and with the `gguf` package's numpy decoders for the K-quants (256 values per
super-block); `gguf_linear_dequant` is the portable `KernelTable.gguf_linear`: dequantize, then
multiply (correct everywhere, and as slow as a float model plus the decoding: the CPU platform
has a native kernel, kernels/cpu/gguf_gemm.c).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

# ggml type ids (gguf.GGMLQuantizationType), spelled out so that this module needs no gguf
# import for the common formats.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 10, 11, 12, 13, 14, 30

# type -> (name, values per block, bytes per block)
BLOCK_TYPES: dict[int, tuple[str, int, int]] = {
    Q4_0: ("Q4_0", 32, 18),
    Q4_1: ("Q4_1", 32, 20),
    Q5_0: ("Q5_0", 32, 22),
    Q5_1: ("Q5_1", 32, 24),
    Q8_0: ("Q8_0", 32, 34),
    Q2_K: ("Q2_K", 256, 84),
    Q3_K: ("Q3_K", 256, 110),
    Q4_K: ("Q4_K", 256, 144),
    Q5_K: ("Q5_K", 256, 176),
    Q6_K: ("Q6_K", 256, 210),
}
FLOAT_TYPES: dict[int, torch.dtype] = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}


def type_name(ggml_type: int) -> str:
    if ggml_type in BLOCK_TYPES:
        return BLOCK_TYPES[ggml_type][0]
    return {F32: "F32", F16: "F16", BF16: "BF16"}.get(ggml_type, f"type {ggml_type}")


def block_shape(ggml_type: int) -> tuple[int, int]:
    """(values, bytes) of one block; float types count as blocks of one value."""
    if ggml_type in BLOCK_TYPES:
        _, elems, nbytes = BLOCK_TYPES[ggml_type]
        return elems, nbytes
    if ggml_type in FLOAT_TYPES:
        return 1, FLOAT_TYPES[ggml_type].itemsize
    raise ValueError(f"unsupported ggml type {type_name(ggml_type)}")


def row_bytes(ggml_type: int, k: int) -> int:
    elems, nbytes = block_shape(ggml_type)
    if k % elems:
        raise ValueError(f"row length {k} is not a multiple of the {type_name(ggml_type)} block")
    return k // elems * nbytes


def dequantize_rows(
    blocks: torch.Tensor, ggml_type: int, k: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """blocks uint8 [R, row_bytes] (rows of a GGUF matrix with K = `k`) -> [R, k] in `dtype`."""
    rows = blocks.shape[0]
    if blocks.shape[-1] != row_bytes(ggml_type, k):
        raise ValueError(
            f"{type_name(ggml_type)} rows of {k} values take {row_bytes(ggml_type, k)} bytes, "
            f"got {blocks.shape[-1]}"
        )
    data = blocks.contiguous().reshape(-1)
    if ggml_type in FLOAT_TYPES:
        return data.view(FLOAT_TYPES[ggml_type]).reshape(rows, k).to(dtype)
    if ggml_type in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
        return _dequantize_32(data, ggml_type).reshape(rows, k).to(dtype)
    import gguf  # the K-quants: the gguf package's numpy decoders

    values = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType(ggml_type))
    return (
        torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(rows, k).to(dtype)
    )


def _f16_column(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Bytes [start, start+2) of every block as one float16 per block -> float32 [n_blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _dequantize_32(data: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The 32-value formats -> float32 [n_blocks * 32]. In a block, byte j of the nibbles holds
    value j (low nibble) and value j + 16 (high nibble)."""
    _, _, nbytes = BLOCK_TYPES[ggml_type]
    blocks = data.view(-1, nbytes)
    d = _f16_column(blocks, 0)
    if ggml_type == Q8_0:  # f16 d, 32 int8: x = d * q
        return (blocks[:, 2:].view(torch.int8).float() * d).reshape(-1)
    with_min = ggml_type in (Q4_1, Q5_1)
    header = 4 if with_min else 2
    if ggml_type in (Q5_0, Q5_1):  # then a u32 of fifth bits, bit j for value j
        qh = blocks[:, header : header + 4].contiguous().view(torch.int32)  # [n, 1]
        header += 4
        bits = (qh >> torch.arange(32, dtype=torch.int32)) & 1  # [n, 32]
        high = (bits << 4).to(torch.uint8)
    packed = blocks[:, header:]
    q = torch.cat((packed & 0x0F, packed >> 4), dim=1)
    if ggml_type in (Q5_0, Q5_1):
        q = q | high
    values = q.float()
    if with_min:  # x = d * q + m
        return (values * d + _f16_column(blocks, 2)).reshape(-1)
    offset = 8.0 if ggml_type == Q4_0 else 16.0  # x = d * (q - offset)
    return ((values - offset) * d).reshape(-1)


def gguf_linear_dequant(
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] @ dequantize(blocks [N, row_bytes])^T + bias -> [M, N] in x's dtype: the
    portable `KernelTable.gguf_linear` (the whole matrix dequantized on every call)."""
    weight = dequantize_rows(blocks, ggml_type, x.shape[-1], x.dtype)
    return F.linear(x, weight, bias)
