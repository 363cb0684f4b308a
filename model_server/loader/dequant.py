"""GGUF tensor bytes -> torch tensors.

The common llama.cpp block formats (Q4_0, Q4_1, Q8_0) are unpacked with torch ops; the rest go
through `gguf.quants.dequantize` (numpy, ~3x slower). Both give float32 in torch shape order;
F32/F16/BF16 tensors keep the dtype they are stored in.

Tensors under SMALL_TENSOR elements are unpacked with one torch thread: each is a handful of
short elementwise ops, and on a busy CPU every multi-threaded op can stall on its OpenMP barrier
for a scheduler tick (measured on a shared 2-core box: 0.3 s for all of SmolLM2 single-threaded,
up to 13 s with two threads).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

# ggml type ids (gguf.GGMLQuantizationType), spelled out so this module needs no gguf import
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
_STORED = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
UNQUANTIZED = frozenset(_STORED)
QK = 32  # elements per block in Q4_0 / Q4_1 / Q8_0
SMALL_TENSOR = 1 << 24


def stored_dtype(ggml_type: int) -> torch.dtype:
    """The dtype `dequantize` returns for this ggml type."""
    return _STORED.get(ggml_type, torch.float32)


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """`raw`: the tensor's bytes (uint8, any shape); returns a contiguous tensor of `shape`."""
    data = torch.from_numpy(raw.reshape(-1))
    if ggml_type in _STORED:
        return data.view(_STORED[ggml_type]).reshape(shape).clone()
    if ggml_type in (Q8_0, Q4_0, Q4_1):
        small = math.prod(shape) < SMALL_TENSOR
        with _threads(1 if small else torch.get_num_threads()):
            if ggml_type == Q8_0:
                return _q8_0(data).reshape(shape)
            return _q4(data, with_min=ggml_type == Q4_1).reshape(shape)
    import gguf

    values = gguf.quants.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


@contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _f16_column(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Bytes [start, start+2) of every block as one float16 per block -> float32 [n_blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _q8_0(data: torch.Tensor) -> torch.Tensor:
    # block (34 bytes): f16 scale d, then 32 int8 quants; x = d * q
    blocks = data.view(-1, 2 + QK)
    scale = _f16_column(blocks, 0)
    quants = blocks[:, 2:].view(torch.int8).float()
    return (quants * scale).reshape(-1)


def _q4(data: torch.Tensor, *, with_min: bool) -> torch.Tensor:
    # Q4_0 block (18 bytes): f16 d, 16 bytes of nibbles; x = d * (q - 8)
    # Q4_1 block (20 bytes): f16 d, f16 m, 16 bytes of nibbles; x = d * q + m
    # Byte j holds element j in its low nibble and element j + 16 in its high nibble.
    header = 4 if with_min else 2
    blocks = data.view(-1, header + QK // 2)
    scale = _f16_column(blocks, 0)
    packed = blocks[:, header:]
    quants = torch.cat((packed & 0x0F, packed >> 4), dim=1).float()
    if with_min:
        return (quants * scale + _f16_column(blocks, 2)).reshape(-1)
    return ((quants - 8.0) * scale).reshape(-1)
