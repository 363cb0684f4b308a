"""The Triton backend with quantized KV caches (store_kv.py, paged_decode.py, paged_prefill.py
through attention_tile.py), compiled on CUDA, else under TRITON_INTERPRET=1: the same checks as
the other backends in test_kv_cache_dtype.py (the store bit for bit, the read against the
dequantized and the unquantized references), on small shapes (the interpreter runs ~1 ms per
program)."""

from __future__ import annotations

import pytest
import torch

from model_server.layers.attention.triton_backend import TritonAttentionBackend
from tests.kernels.test_kv_cache_dtype import FORMATS, check_backend, fixed_scale_of

pytestmark = pytest.mark.kernels

REQUESTS = [(0, 1), (7, 1), (9, 1), (20, 1), (0, 5), (6, 4)]


def _triton(split: bool, fixed_scale: float | None = None):
    def run(b, kc, vc, ks, vs):
        num_heads, head_dim = b.q.shape[1], b.q.shape[2]
        # Tiny split thresholds force the flash-decoding split and its reduce on short contexts.
        extra = {"decode_min_split_tokens": 4, "max_decode_splits": 4} if split else {}
        backend = TritonAttentionBackend(num_heads, b.k.shape[1], head_dim, head_dim**-0.5, **extra)
        return backend.forward(
            b.q, b.k, b.v, kc, vc, b.metadata, k_scales=ks, v_scales=vs, kv_fixed_scale=fixed_scale
        )

    return run


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (3, 3, 40)])
def test_triton_quantized(fmt, dtype, num_heads, num_kv_heads, head_dim, device) -> None:
    check_backend(
        _triton(False), REQUESTS, num_heads, num_kv_heads, head_dim, 8, dtype, fmt, device
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_quantized_split_decode(fmt, device) -> None:
    check_backend(_triton(True), REQUESTS, 4, 1, 32, 4, torch.float32, fmt, device)


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_quantized_with_a_static_scale(fmt, device) -> None:
    """--quantization-param-path's per-layer scale on the Triton store: bit for bit as the
    reference quantizer with that scale."""
    fixed = fixed_scale_of(fmt)
    check_backend(_triton(False, fixed), REQUESTS, 4, 2, 64, 8, torch.float32, fmt, device, fixed)
