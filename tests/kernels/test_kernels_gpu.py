"""Realistic shapes on a CUDA GPU (compiled kernels, half precision, long contexts, many splits).

Skipped without CUDA: these shapes would take far too long under the interpreter.
"""

from __future__ import annotations

import random

import pytest
import torch

from model_server.layers.attention.torch_backend import TorchAttentionBackend
from model_server.layers.attention.triton_backend import TritonAttentionBackend
from tests.kernels.helpers import make_batch

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}


def _requests(num_decodes: int, max_ctx: int, prefills: list[tuple[int, int]], seed: int):
    rng = random.Random(seed)
    decodes = [(rng.randint(0, max_ctx), 1) for _ in range(num_decodes)]
    mixed = decodes + prefills
    rng.shuffle(mixed)
    return mixed


def _compare(requests, num_heads, num_kv_heads, head_dim, block_size, dtype, **backend_kwargs):
    b = make_batch(
        requests,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device="cuda",
    )
    scale = head_dim**-0.5
    triton_be = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, scale, **backend_kwargs)
    torch_be = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale)
    # The reference runs in fp32 on the same (rounded) inputs.
    kc = b.k_cache.to(torch.float32, copy=True)
    vc = b.v_cache.to(torch.float32, copy=True)
    ref = torch_be.forward(b.q.float(), b.k.float(), b.v.float(), kc, vc, b.metadata)
    out = triton_be.forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.metadata)
    torch.cuda.synchronize()
    assert torch.equal(b.k_cache.float(), kc.to(dtype).float())
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
def test_llama_like_mixed_batch(dtype, block_size):
    # 32 query / 8 KV heads, head_dim 128: decodes up to 2k context next to chunked prefills.
    requests = _requests(48, 2048, [(0, 300), (1000, 257), (37, 64), (512, 1)], seed=0)
    _compare(requests, 32, 8, 128, block_size, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_smollm_like_shapes(dtype):
    # 9 query / 3 KV heads (group of 3), head_dim 64.
    requests = _requests(20, 900, [(0, 200), (130, 70)], seed=1)
    _compare(requests, 9, 3, 64, 16, dtype)


def test_long_context_decode_many_splits():
    # Few long decodes: the split-K path with up to 16 splits and uneven lengths.
    requests = [(8000, 1), (3001, 1), (15, 1)]
    _compare(requests, 32, 8, 128, 16, torch.bfloat16)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 1, 256), (16, 16, 64)])
def test_head_dims_and_groups(num_heads, num_kv_heads, head_dim):
    requests = _requests(8, 1500, [(0, 129), (64, 200)], seed=2)
    _compare(requests, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16)
