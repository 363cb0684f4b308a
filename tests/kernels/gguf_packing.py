"""GGUF blocks for the tests: reference quantizers for the K-quants (the `gguf` package only
dequantizes those), written from the block layouts in llama.cpp's ggml-common.h (simple
max-based scales, not llama.cpp's search: any valid block will do), and random valid blocks.

`quantize(x [N, K] float32, type) -> uint8 [N, row_bytes]`: the gguf package's quantizer for the
32-value formats, ours for Q2_K..Q6_K. `gguf.quants.dequantize` reads both back (the tests check
it: an independent decoder of our packing).

Without the `gguf` package (a GPU machine's image has none) a test module importing this one is
skipped at collection instead of failing it.
"""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
K_QUANTS = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)
ALL_TYPES = (2, 3, 6, 7, 8, *K_QUANTS)  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0, then the K-quants
# byte ranges of each type's f16 fields (d, and m / dmin)
_F16_FIELDS = {
    2: [(0, 2)], 3: [(0, 2), (2, 4)], 6: [(0, 2)], 7: [(0, 2), (2, 4)], 8: [(0, 2)],
    Q2_K: [(80, 82), (82, 84)], Q3_K: [(108, 110)], Q4_K: [(0, 2), (2, 4)],
    Q5_K: [(0, 2), (2, 4)], Q6_K: [(208, 210)],
}  # fmt: skip


def block_shape(qtype: int) -> tuple[int, int]:
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row_bytes]: random codes and scales, every f16 field a finite small value."""
    rng = np.random.default_rng(seed)
    elems, nbytes = block_shape(qtype)
    blocks = rng.integers(0, 256, size=(n * k // elems, nbytes), dtype=np.uint8)
    for start, end in _F16_FIELDS[qtype]:
        scale = (rng.standard_normal(blocks.shape[0]) * 0.02).astype(np.float16)
        blocks[:, start:end] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, k // elems * nbytes)


def dequantize(blocks: np.ndarray, qtype: int) -> np.ndarray:
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype))


def quantize(x: np.ndarray, qtype: int) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype not in K_QUANTS:
        return gguf.quants.quantize(x, gguf.GGMLQuantizationType(qtype))
    n = x.shape[0]
    sb = x.reshape(-1, 256)
    packer = {Q2_K: _q2_k, Q3_K: _q3_k, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k}[qtype]
    return np.stack([packer(row) for row in sb]).reshape(n, -1)


def _f16(v: float) -> np.ndarray:
    return np.array([v], dtype=np.float16).view(np.uint8)


def _scale_min(
    sub: np.ndarray, qmax: int, bits: int
) -> tuple[float, float, np.ndarray, np.ndarray]:
    """x ~ d * sc * q - dmin * m per sub-block (rows of `sub`), q in 0..qmax, sc and m in
    0..2^bits-1: (d, dmin, sc, m)."""
    lo = np.minimum(sub.min(axis=1), 0.0)
    hi = sub.max(axis=1)
    scale = (hi - lo) / qmax
    top = (1 << bits) - 1
    d = max(scale.max() / top, 1e-8)
    dmin = max((-lo).max() / top, 1e-8)
    d, dmin = float(np.float16(d)), float(np.float16(dmin))
    d, dmin = d or 6e-8, dmin or 6e-8
    sc = np.clip(np.round(scale / d), 1, top).astype(np.int64)
    m = np.clip(np.round(-lo / dmin), 0, top).astype(np.int64)
    return d, dmin, sc, m


def _codes(sub: np.ndarray, d: float, dmin: float, sc: np.ndarray, m: np.ndarray, qmax: int):
    q = np.round((sub + dmin * m[:, None]) / (d * sc[:, None]))
    return np.clip(q, 0, qmax).astype(np.int64)


def _q2_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(16, 16)
    d, dmin, sc, m = _scale_min(sub, 3, 4)
    q = _codes(sub, d, dmin, sc, m, 3).reshape(-1)
    qs = np.zeros(64, dtype=np.int64)
    for v in range(256):  # v = n*128 + j*32 + h*16 + i -> byte n*32 + h*16 + i, bits 2j
        n, j, h, i = v // 128, (v // 32) % 4, (v // 16) % 2, v % 16
        qs[n * 32 + h * 16 + i] |= q[v] << (2 * j)
    scales = (sc | (m << 4)).astype(np.uint8)
    return np.concatenate([scales, qs.astype(np.uint8), _f16(d), _f16(dmin)])


def _q3_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(16, 16)
    scale = np.abs(sub).max(axis=1) / 4
    d = float(np.float16(max(scale.max() / 31, 1e-8))) or 6e-8
    sc = np.clip(np.round(scale / d), 1, 31).astype(np.int64)
    q = np.clip(np.round(sub / (d * sc[:, None])), -4, 3).astype(np.int64).reshape(-1)
    qs = np.zeros(64, dtype=np.int64)
    hm = np.zeros(32, dtype=np.int64)
    for v in range(256):
        n, j, h, i = v // 128, (v // 32) % 4, (v // 16) % 2, v % 16
        low = q[v] if q[v] >= 0 else q[v] + 4
        qs[n * 32 + h * 16 + i] |= low << (2 * j)
        if q[v] >= 0:
            hm[h * 16 + i] |= 1 << (n * 4 + j)
    s = sc + 32  # 6-bit stored scales
    raw = np.zeros(12, dtype=np.int64)
    for i in range(16):
        if i < 8:
            raw[i] |= s[i] & 0xF
        else:
            raw[i - 8] |= (s[i] & 0xF) << 4
        raw[8 + i % 4] |= (s[i] >> 4) << (2 * (i // 4))
    return np.concatenate([hm.astype(np.uint8), qs.astype(np.uint8), raw.astype(np.uint8), _f16(d)])


def _pack_scale_min_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    raw = np.zeros(12, dtype=np.int64)
    for j in range(4):
        raw[j] = sc[j] | ((sc[j + 4] >> 4) << 6)
        raw[j + 4] = m[j] | ((m[j + 4] >> 4) << 6)
        raw[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4)
    return raw.astype(np.uint8)


def _q4_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(8, 32)
    d, dmin, sc, m = _scale_min(sub, 15, 6)
    q = _codes(sub, d, dmin, sc, m, 15)
    qs = np.concatenate([q[2 * i] | (q[2 * i + 1] << 4) for i in range(4)])
    return np.concatenate([_f16(d), _f16(dmin), _pack_scale_min_k4(sc, m), qs.astype(np.uint8)])


def _q5_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(8, 32)
    d, dmin, sc, m = _scale_min(sub, 31, 6)
    q = _codes(sub, d, dmin, sc, m, 31)
    ql = np.concatenate([(q[2 * i] & 0xF) | ((q[2 * i + 1] & 0xF) << 4) for i in range(4)])
    qh = np.zeros(32, dtype=np.int64)
    for i in range(8):
        qh |= (q[i] >> 4) << i
    return np.concatenate(
        [_f16(d), _f16(dmin), _pack_scale_min_k4(sc, m), qh.astype(np.uint8), ql.astype(np.uint8)]
    )


def _q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(16, 16)
    scale = np.abs(sub).max(axis=1) / 31
    d = float(np.float16(max(scale.max() / 127, 1e-8))) or 6e-8
    sc = np.clip(np.round(scale / d), 1, 127).astype(np.int64)
    q = np.clip(np.round(sub / (d * sc[:, None])), -32, 31).astype(np.int64).reshape(-1) + 32
    ql = np.zeros(128, dtype=np.int64)
    qh = np.zeros(64, dtype=np.int64)
    for n in range(2):
        base = n * 128
        for i in range(32):
            q1, q2, q3, q4 = (q[base + i + 32 * t] for t in range(4))
            ql[n * 64 + i] = (q1 & 0xF) | ((q3 & 0xF) << 4)
            ql[n * 64 + i + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4)
            qh[n * 32 + i] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql.astype(np.uint8), qh.astype(np.uint8), scales, _f16(d)])
