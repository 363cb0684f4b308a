"""The native CPU kernel of multi-head latent attention (kernels/cpu/mla_attention.c), through
`MLAAttention(decode_kernel="cpu")`, against the PyTorch MLA of layers/attention/mla.py (absorbed
decodes, expanded prefills): decode rows at and across block boundaries, a whole prompt, a chunk
after a cached prefix, all in one mixed batch; the same latent cache written. Its bits do not
depend on the thread count, nor on the batch a row is in; what it does not take (a cache of
another dtype) runs the PyTorch path."""

from __future__ import annotations

import pytest
import torch

from model_server.kernels.cpu import native
from model_server.layers.attention.mla import MLAAttention
from tests.kernels.helpers import make_batch

pytestmark = pytest.mark.skipif(
    native.load_kernels() is None, reason="the native CPU kernels need a C compiler"
)

DN, R, DV, L = 16, 8, 12, 32  # nope, rope, value dims, kv_lora_rank
# (num_cached, num_new): decodes of 1 to 70 context tokens, a prompt, a chunk after a prefix.
REQUESTS = [(0, 1), (3, 1), (4, 1), (9, 1), (69, 1), (0, 11), (6, 9)]
TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}


def _inputs(requests, num_heads: int, dtype: torch.dtype, seed: int = 1):
    b = make_batch(
        requests,
        num_heads=num_heads,
        num_kv_heads=1,
        head_dim=L + R,
        block_size=4,
        dtype=dtype,
        device="cpu",
        seed=num_heads,
    )
    gen = torch.Generator().manual_seed(seed)
    t = b.q.shape[0]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    # q_nope as the module path has it: a view of q [T, H, Dn + R] (head stride Dn + R).
    q = rand(t, num_heads, DN + R)
    parts = (q[..., :DN], rand(t, num_heads, R), rand(t, L), rand(t, R))
    w_kv_b = (rand(num_heads * (DN + DV), L) * L**-0.5).to(dtype)
    return b, parts, w_kv_b


def _run(kernel: str, b, parts, w_kv_b, num_heads: int):
    mla = MLAAttention(num_heads, DN, R, DV, L, scale=0.3, decode_kernel=kernel)
    cache = b.k_cache[:, :, 0].clone()  # [num_blocks, block_size, L + R]
    return mla(*parts, w_kv_b, cache, b.metadata), cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_heads", [1, 3, 20])
def test_cpu_mla_matches_torch(dtype: torch.dtype, num_heads: int) -> None:
    b, parts, w_kv_b = _inputs(REQUESTS, num_heads, dtype)
    ref, ref_cache = _run("torch", b, parts, w_kv_b, num_heads)
    out, cache = _run("cpu", b, parts, w_kv_b, num_heads)
    assert out.shape == (b.q.shape[0], num_heads * DV) and out.dtype == dtype
    assert not ref.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bits_do_not_depend_on_threads_or_batch(dtype: torch.dtype) -> None:
    b, parts, w_kv_b = _inputs(REQUESTS, 4, dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = _run("cpu", b, parts, w_kv_b, 4)
        torch.set_num_threads(max(threads, 2))
        many, _ = _run("cpu", b, parts, w_kv_b, 4)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    # The chunk after a cached prefix alone: its rows' bits are the mixed batch's.
    last = REQUESTS[-1:]
    alone_b, _, _ = _inputs(last, 4, dtype)
    rows = slice(b.q.shape[0] - last[0][1], b.q.shape[0])
    cache = alone_b.k_cache[:, :, 0].clone()
    # the prefix the mixed batch's cache holds for it, at this batch's slots
    full = b.k_cache[:, :, 0].reshape(-1, L + R)
    own, theirs = alone_b.block_tables[0], b.block_tables[-1]  # metadata order: prefill last
    for j in range(last[0][0]):
        src = int(theirs[j // 4]) * 4 + j % 4
        cache.view(-1, L + R)[int(own[j // 4]) * 4 + j % 4] = full[src]
    alone_parts = tuple(p[rows] for p in parts)
    mla = MLAAttention(4, DN, R, DV, L, scale=0.3, decode_kernel="cpu")
    alone = mla(*alone_parts, w_kv_b, cache, alone_b.metadata)
    assert torch.equal(alone, many[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_long_decode_splits_its_heads_over_threads_with_the_same_bits(dtype) -> None:
    """One row of enough work for two threads: its heads run in two groups, not one."""
    b, parts, w_kv_b = _inputs([(8000, 1)], 4, dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = _run("cpu", b, parts, w_kv_b, 4)
        torch.set_num_threads(2)
        two, _ = _run("cpu", b, parts, w_kv_b, 4)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    ref, _ = _run("torch", b, parts, w_kv_b, 4)
    torch.testing.assert_close(two.float(), ref.float(), **TOL[dtype])


def test_a_cache_of_another_dtype_runs_the_torch_path() -> None:
    b, parts, w_kv_b = _inputs(REQUESTS, 3, torch.float32)
    mla = MLAAttention(3, DN, R, DV, L, scale=0.3, decode_kernel="cpu")
    cache = b.k_cache[:, :, 0].to(torch.bfloat16)
    ref = MLAAttention(3, DN, R, DV, L, scale=0.3)
    ref_cache = cache.clone()
    out = mla(*parts, w_kv_b, cache, b.metadata)
    assert torch.equal(out, ref(*parts, w_kv_b, ref_cache, b.metadata))
