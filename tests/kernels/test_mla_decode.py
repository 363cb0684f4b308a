"""The Triton latent-cache decode of multi-head latent attention (kernels/mla_decode.py), through
`MLAAttention(decode_kernel="triton")`, against the PyTorch MLA: same outputs for decodes (at and
across block boundaries, head counts below and above one program's 16 heads) next to prefills
and chunks after a cached prefix, the same latent cache written; padding rows of a graph batch
read nothing."""

from __future__ import annotations

import pytest
import torch

from model_server.kernels.mla_decode import mla_decode_attention
from model_server.layers.attention.mla import MLAAttention
from tests.kernels.helpers import make_batch

pytestmark = pytest.mark.kernels

DN, R, DV, L = 16, 8, 12, 32  # nope, rope, value dims, kv_lora_rank
# (num_cached, num_new): decodes of 1 to 70 context tokens, a prompt, a chunk after a prefix.
REQUESTS = [(0, 1), (3, 1), (4, 1), (9, 1), (69, 1), (0, 11), (6, 9)]
TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}


def _inputs(num_heads: int, dtype: torch.dtype, device: str):
    b = make_batch(
        REQUESTS,
        num_heads=num_heads,
        num_kv_heads=1,
        head_dim=L + R,
        block_size=4,
        dtype=dtype,
        device=device,
        # Random, not NaN, past each context: the PyTorch path multiplies masked (zero)
        # probabilities by them; a kernel reading them would differ from it.
        seed=num_heads,
    )
    gen = torch.Generator().manual_seed(1)
    t = b.q.shape[0]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    parts = (rand(t, num_heads, DN), rand(t, num_heads, R), rand(t, L), rand(t, R))
    w_kv_b = (rand(num_heads * (DN + DV), L) * L**-0.5).to(dtype)
    return b, parts, w_kv_b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_heads", [3, 20])
def test_triton_mla_matches_torch(dtype, num_heads, device) -> None:
    b, parts, w_kv_b = _inputs(num_heads, dtype, device)
    outs, caches = {}, {}
    for kernel in ("torch", "triton"):
        mla = MLAAttention(num_heads, DN, R, DV, L, scale=0.3, decode_kernel=kernel)
        cache = b.k_cache[:, :, 0].clone()  # [num_blocks, block_size, L + R]
        outs[kernel] = mla(*parts, w_kv_b, cache, b.metadata)
        caches[kernel] = cache
    assert outs["triton"].shape == (b.q.shape[0], num_heads * DV)
    assert not outs["torch"].isnan().any()
    torch.testing.assert_close(outs["triton"].float(), outs["torch"].float(), **TOL[dtype])
    torch.testing.assert_close(caches["triton"], caches["torch"], atol=0, rtol=0)


def test_padding_rows_read_nothing_and_get_zeros(device) -> None:
    """A CUDA-graph batch's padding rows: seq_len 0, slot -1."""
    cache = torch.full((4, 4, L + R), float("nan"), device=device)
    query = torch.randn(2, 3, L + R, device=device)
    seq_lens = torch.zeros(2, dtype=torch.int32, device=device)
    tables = torch.zeros(2, 1, dtype=torch.int32, device=device)
    out = mla_decode_attention(query, cache, seq_lens, tables, L, 0.3)
    assert out.shape == (2, 3, L) and out.dtype == torch.float32
    assert torch.equal(out, torch.zeros_like(out))


def test_unknown_decode_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match="MLA decode kernel 'cuda'"):
        MLAAttention(2, DN, R, DV, L, scale=0.3, decode_kernel="cuda")
