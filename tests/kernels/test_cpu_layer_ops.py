"""The native CPU layer ops (kernels/cpu/layer_ops.c through kernels/cpu/layer_ops.py) against
their portable PyTorch references (kernels/portable.py), on every ISA path this machine runs
(lower ones forced on better CPUs), fp32 and bf16, odd sizes, strided views of a fused qkv
projection, GQA, and steps big enough to take the threaded path; the fallbacks (one warning per
kernel and reason, then the portable op) and the CPU platform's table.

Tolerances, and why:
  - The residual sum and the rotary embedding are the same fp32 ops rounded at the same points
    as PyTorch's: bit-identical in both dtypes.
  - RMSNorm sums its squares in another order and SiLU's exp is not PyTorch's: fp32 within a
    few ulps; bf16 within one bf16 ulp, and at least 99% of the elements bit-identical (checks
    that the normalized value / the silu is rounded before the weight / up multiplies it).
  - LayerNorm (two passes, one rounding) and the plain GELU (own erfc and tanh): fp32 within a
    few ulps; bf16 within one bf16 ulp, most elements bit-identical (`_assert_near`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

from model_server.kernels import portable
from model_server.kernels.cpu import isa as isa_mod
from model_server.kernels.cpu import layer_ops, native
from model_server.kernels.cpu.linear_tuning import TUNING_ENV
from model_server.kernels.table import TORCH_KERNELS
from model_server.layers.norm import LayerNorm
from model_server.layers.rotary import RotaryEmbedding, get_rope
from model_server.platforms.cpu import CpuPlatform

RUNNABLE = [i.name for i in isa_mod.supported_isas(isa_mod.cpu_flags())]
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
# (rtol, atol): fp32 a few ulps of the sum order / exp; bf16 one ulp (2^-8 relative, 2^-7 near
# the rounding boundary).
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2**-7, 2**-7)}
# The threaded path needs two threads and calls of at least 2 * MIN_ELEMENTS_PER_THREAD.
THREADS = 2


def _kernels(isa: str) -> native.NativeKernels:
    kernels = native.load_kernels(isa)
    assert kernels is not None and kernels.lib.wick_isa().decode() == isa
    return kernels


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 2.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype)


def _weight(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    # Not all ones: the rounding of the normalized value before the multiply shows.
    return (1.0 + 0.5 * torch.randn(n, generator=torch.Generator().manual_seed(seed))).to(dtype)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert actual.is_contiguous()
    rtol, atol = TOL[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    if expected.dtype == torch.bfloat16:
        exact = (actual == expected).float().mean().item()
        assert exact >= 0.99, f"only {exact:.1%} of the elements are bit-identical"


def _unchanged(*tensors: torch.Tensor) -> Callable[[], bool]:
    """A check that `tensors` still hold what they hold now (kernels never write inputs)."""
    before = [t.clone() for t in tensors]
    return lambda: all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def fresh_warnings():
    layer_ops._warn_fallback.cache_clear()
    yield
    layer_ops._warn_fallback.cache_clear()


# ---- RMSNorm -----------------------------------------------------------------------------------


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (7, 577), (3, 64), (2, 5), (5, 4096)])
def test_rms_norm(isa, dtype, rows, hidden) -> None:
    x = _randn(rows, hidden, dtype=dtype, seed=1)
    weight = _weight(hidden, dtype)
    intact = _unchanged(x, weight)
    out = layer_ops.rms_norm(_kernels(isa), x, weight, 1e-6)
    _assert_close(out, portable.rms_norm_torch(x, weight, 1e-6))
    assert intact()


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (7, 577), (2, 5)])
def test_fused_add_rms_norm(isa, dtype, rows, hidden) -> None:
    x = _randn(rows, hidden, dtype=dtype, seed=2)
    residual = _randn(rows, hidden, dtype=dtype, seed=3)
    weight = _weight(hidden, dtype)
    intact = _unchanged(x, residual, weight)
    out, summed = layer_ops.fused_add_rms_norm(_kernels(isa), x, residual, weight, 1e-6)
    ref_out, ref_summed = portable.fused_add_rms_norm_torch(x, residual, weight, 1e-6)
    assert torch.equal(summed, ref_summed) and summed.is_contiguous()
    _assert_close(out, ref_out)
    assert intact()
    pointers = {x.data_ptr(), residual.data_ptr()}
    assert out.data_ptr() not in pointers and summed.data_ptr() not in pointers
    # The decoder's chain: the next layer adds to the returned sum.
    out2, summed2 = layer_ops.fused_add_rms_norm(_kernels(isa), out, summed, weight, 1e-6)
    ref2, ref_summed2 = portable.fused_add_rms_norm_torch(out, summed, weight, 1e-6)
    assert torch.equal(summed2, ref_summed2)
    _assert_close(out2, ref2)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 1, 32), (3, 2, 80)])
def test_rms_norm_on_qk_head_views(isa, dtype, num_heads, num_kv_heads, head_dim) -> None:
    """Qwen3's q/k norm: [T, H, D] views of the fused qkv (token stride (H + 2 Hkv) D, head
    stride D) are read in place, not copied."""
    qkv, q, k = _qkv_views(5, num_heads, num_kv_heads, head_dim, dtype, seed=4)
    assert not q.is_contiguous()
    weight = _weight(head_dim, dtype)
    intact = _unchanged(qkv)
    for view in (q, k):
        out = layer_ops.rms_norm(_kernels(isa), view, weight, 1e-6)
        _assert_close(out, portable.rms_norm_torch(view, weight, 1e-6))
    assert intact()


@pytest.mark.parametrize("isa", RUNNABLE)
def test_rms_norm_other_layouts(isa) -> None:
    """Rows with a gap (a column slice), a 4-D input, a 1-D input, a strided last dim (copied),
    and x / residual in different layouts."""
    kernels, dtype = _kernels(isa), torch.float32
    weight = _weight(64, dtype)
    wide = _randn(6, 100, dtype=dtype, seed=5)
    for x in (
        wide[:, 16:80],
        _randn(2, 3, 2, 64, dtype=dtype, seed=6),
        _randn(64, dtype=dtype, seed=7),
        _randn(64, 4, dtype=dtype, seed=8).t(),
    ):
        _assert_close(
            layer_ops.rms_norm(kernels, x, weight, 1e-6), portable.rms_norm_torch(x, weight, 1e-6)
        )
    heads = _randn(3, 4 * 64, dtype=dtype, seed=9)[:, : 2 * 64].view(3, 2, 64)
    residual = _randn(3, 2, 64, dtype=dtype, seed=10)
    out, summed = layer_ops.fused_add_rms_norm(kernels, heads, residual, weight, 1e-6)
    ref_out, ref_summed = portable.fused_add_rms_norm_torch(heads, residual, weight, 1e-6)
    assert torch.equal(summed, ref_summed)
    _assert_close(out, ref_out)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm_threaded(isa, dtype, two_threads) -> None:
    """A long prefill's rows (4096 x 577) split over two threads: the same rows as on
    one thread, bit for bit, and PyTorch's numerics."""
    kernels = _kernels(isa)
    x = _randn(4096, 577, dtype=dtype, seed=11)
    residual = _randn(4096, 577, dtype=dtype, seed=12)
    weight = _weight(577, dtype)
    assert x.numel() >= THREADS * layer_ops.MIN_ELEMENTS_PER_THREAD
    out, summed = layer_ops.fused_add_rms_norm(kernels, x, residual, weight, 1e-6)
    one = layer_ops.fused_add_rms_norm(
        kernels, x, residual, weight, 1e-6, min_work_per_thread=1 << 40
    )
    assert torch.equal(out, one[0]) and torch.equal(summed, one[1])
    ref_out, ref_summed = portable.fused_add_rms_norm_torch(x, residual, weight, 1e-6)
    assert torch.equal(summed, ref_summed)
    _assert_close(out, ref_out)
    _assert_close(
        layer_ops.rms_norm(kernels, x, weight, 1e-6), portable.rms_norm_torch(x, weight, 1e-6)
    )


# ---- SiLU-and-mul ------------------------------------------------------------------------------


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("rows", "d"), [(1, 1536), (7, 577), (3, 5)])
def test_silu_and_mul(isa, dtype, rows, d) -> None:
    # Scale 8: gates far into both tails (exp(-|g|) tiny, silu ~ g or ~ 0).
    x = _randn(rows, 2 * d, dtype=dtype, seed=13, scale=8.0)
    intact = _unchanged(x)
    _assert_close(layer_ops.silu_and_mul(_kernels(isa), x), portable.silu_and_mul_torch(x))
    assert intact()


@pytest.mark.parametrize("isa", RUNNABLE)
def test_silu_and_mul_layouts_and_extremes(isa) -> None:
    kernels = _kernels(isa)
    wide = _randn(4, 260, dtype=torch.float32, seed=14)
    strided = wide[:, 30:230]  # rows 260 apart
    _assert_close(layer_ops.silu_and_mul(kernels, strided), portable.silu_and_mul_torch(strided))
    x3 = _randn(2, 3, 64, dtype=torch.bfloat16, seed=15)
    _assert_close(layer_ops.silu_and_mul(kernels, x3), portable.silu_and_mul_torch(x3))
    gate = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 80.0, -80.0, 88.0, -86.0])
    x = torch.cat([gate, torch.full_like(gate, 3.0)])[None]
    torch.testing.assert_close(
        layer_ops.silu_and_mul(kernels, x), portable.silu_and_mul_torch(x), rtol=1e-6, atol=1e-30
    )


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_and_mul_threaded(isa, dtype, two_threads) -> None:
    kernels = _kernels(isa)
    x = _randn(1024, 2 * 1536, dtype=dtype, seed=16)
    assert 3 * x.numel() // 2 >= THREADS * layer_ops.MIN_ELEMENTS_PER_THREAD
    out = layer_ops.silu_and_mul(kernels, x)
    assert torch.equal(out, layer_ops.silu_and_mul(kernels, x, min_work_per_thread=1 << 40))
    _assert_close(out, portable.silu_and_mul_torch(x))


# ---- LayerNorm and the plain GELU --------------------------------------------------------------


def _assert_near(actual: torch.Tensor, expected: torch.Tensor, exact_share: float) -> None:
    """Within one rounding of the dtype; in bf16 at least `exact_share` of the elements
    bit-identical (the fp32 results differ from PyTorch's in their last ulps, which flips a
    bf16 rounding now and then). fp32: 1e-5 absolute, a few times either's error at a mean of
    30 over a spread of 2 (x - mean keeps ~19 of its 24 bits; both err by ~2e-6)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert actual.is_contiguous()
    rtol, atol = TOL[expected.dtype] if expected.dtype == torch.bfloat16 else (1e-5, 1e-5)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    if expected.dtype == torch.bfloat16:
        exact = (actual == expected).float().mean().item()
        assert exact >= exact_share, f"only {exact:.1%} of the elements are bit-identical"


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (7, 577), (2, 5), (5, 2560)])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_layer_norm(isa, dtype, rows, hidden, with_bias) -> None:
    # A mean far from 0: a one-pass variance (E[x^2] - mean^2) would lose the digits.
    x = _randn(rows, hidden, dtype=dtype, seed=21) + 30.0
    x = x.to(dtype)
    weight = _weight(hidden, dtype, seed=22)
    bias = _randn(hidden, dtype=dtype, seed=23, scale=0.5) if with_bias else None
    intact = _unchanged(x, weight, *([bias] if with_bias else []))
    out = layer_ops.layer_norm(_kernels(isa), x, weight, bias, 1e-5)
    _assert_near(out, portable.layer_norm_torch(x, weight, bias, 1e-5), 0.97)
    assert intact()


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_add_layer_norm_chains(isa, dtype) -> None:
    x = _randn(3, 577, dtype=dtype, seed=24)
    residual = _randn(3, 577, dtype=dtype, seed=25)
    weight, bias = _weight(577, dtype, seed=26), _randn(577, dtype=dtype, seed=27)
    kernels = _kernels(isa)
    intact = _unchanged(x, residual)
    out, summed = layer_ops.fused_add_layer_norm(kernels, x, residual, weight, bias, 1e-5)
    ref_out, ref_summed = portable.fused_add_layer_norm_torch(x, residual, weight, bias, 1e-5)
    assert torch.equal(summed, ref_summed) and summed.is_contiguous() and intact()
    _assert_near(out, ref_out, 0.97)
    # The same kernel without the add, on the sum: the same bits (one arithmetic for both).
    assert torch.equal(out, layer_ops.layer_norm(kernels, summed, weight, bias, 1e-5))


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_layer_norm_threaded_and_on_the_module(isa, dtype, two_threads) -> None:
    """Threads split rows, never a row: the bits do not depend on them. The model's LayerNorm
    module on a table of these kernels runs them (the native decoder step's arithmetic)."""
    kernels = _kernels(isa)
    x = _randn(64, 2560, dtype=dtype, seed=28)
    weight, bias = _weight(2560, dtype, seed=29), _randn(2560, dtype=dtype, seed=30)
    assert x.numel() >= THREADS * layer_ops.MIN_ELEMENTS_PER_THREAD
    out = layer_ops.layer_norm(kernels, x, weight, bias, 1e-5)
    serial = layer_ops.layer_norm(kernels, x, weight, bias, 1e-5, min_work_per_thread=1 << 40)
    assert torch.equal(out, serial)
    table = layer_ops.native_kernel_table(kernels, TORCH_KERNELS)
    norm = LayerNorm(2560, eps=1e-5, kernels=table).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        norm.bias.copy_(bias)
    assert torch.equal(norm(x), out)
    _assert_near(norm(x), torch.nn.LayerNorm.forward(norm, x), 0.97)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(isa, dtype, approximate) -> None:
    kernels = _kernels(isa)
    x = torch.cat([_randn(3, 1000, dtype=dtype, seed=31), torch.linspace(-9, 9, 3000)
                   .to(dtype).view(3, 1000)], dim=1)  # fmt: skip
    intact = _unchanged(x)
    out = layer_ops.gelu(kernels, x, approximate)
    expected = portable.gelu_torch(x, approximate)
    x64 = x.double()
    if approximate == "none":  # x / 2 erfc(-x / sqrt 2): no 1 + erf(x) to cancel
        exact = 0.5 * x64 * torch.special.erfc(-x64 / 2**0.5)
    else:  # 1 + tanh(a) = 2 sigmoid(2 a)
        exact = x64 * torch.sigmoid(2 * 0.7978845608028654 * (x64 + 0.044715 * x64**3))
    # From -3 up, PyTorch's and ours agree to one rounding of the dtype (bf16: every element's
    # bits here); below, PyTorch's 1 + erf(x) cancels (its exact GELU is ~0 past -5): ours keeps
    # the value's relative precision against a float64 reference instead (the tanh form's
    # 1 + tanh cancels in ours too: absolutely there).
    body = x >= -3
    rtol = TOL[dtype][0]
    torch.testing.assert_close(out[body], expected[body], rtol=rtol, atol=TOL[dtype][1])
    if dtype == torch.bfloat16:
        assert torch.equal(out[body], expected[body])
    tail = ~body
    atol = 1e-30 if approximate == "none" else 1e-6
    torch.testing.assert_close(out[tail].double(), exact[tail], rtol=rtol, atol=atol)
    assert intact() and out.is_contiguous()
    # Strided rows are read in place; the erf and tanh forms differ.
    view = x[:, :500]
    assert torch.equal(layer_ops.gelu(kernels, view, approximate), out[:, :500])
    other = layer_ops.gelu(kernels, x, "tanh" if approximate == "none" else "none")
    assert not torch.equal(other, out)
    with pytest.raises(ValueError, match="approximate='sigmoid'"):
        layer_ops.gelu(kernels, x, "sigmoid")


# ---- Rotary embedding --------------------------------------------------------------------------


def _qkv_views(
    tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qkv [T, (H + 2 Hkv) D], q [T, H, D] and k [T, Hkv, D] views of it), as
    `LlamaAttention.forward` splits the fused projection."""
    qkv = _randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=seed)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return qkv, q.view(tokens, num_heads, head_dim), k.view(tokens, num_kv_heads, head_dim)


def _rope(head_dim: int, max_position: int, dtype: torch.dtype) -> torch.Tensor:
    """A real cos/sin cache (llama3 scaling) in `dtype`."""
    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return RotaryEmbedding(head_dim, max_position, params).cos_sin_cache.to(dtype)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 80), (6, 6, 96), (4, 1, 128)]
)
def test_rotary_embedding(isa, dtype, num_heads, num_kv_heads, head_dim) -> None:
    """Strided q/k views of the fused qkv, GQA, positions of a mixed step (decodes deep into
    their context, a prompt from 0, a chunk crossing 16-token blocks, the last position)."""
    max_position = 300
    positions = torch.tensor([0, 17, 255, 299, *range(0, 5), *range(13, 21)])
    qkv, q, k = _qkv_views(len(positions), num_heads, num_kv_heads, head_dim, dtype, seed=17)
    cache = _rope(head_dim, max_position, dtype)
    intact = _unchanged(qkv, positions, cache)
    q_out, k_out = layer_ops.rotary_embedding(_kernels(isa), positions, q, k, cache)
    q_ref, k_ref = portable.rotary_embedding_torch(positions, q, k, cache)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert q_out.dtype == dtype and k_out.dtype == dtype
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert intact()


@pytest.mark.parametrize("isa", RUNNABLE)
def test_rotary_contiguous_and_int32_positions(isa) -> None:
    """Contiguous q/k (Qwen3's, after its q/k norm) and int32 positions."""
    q = _randn(6, 4, 64, dtype=torch.bfloat16, seed=18)
    k = _randn(6, 2, 64, dtype=torch.bfloat16, seed=19)
    positions = torch.tensor([3, 1, 4, 1, 5, 9], dtype=torch.int32)
    cache = _rope(64, 16, torch.bfloat16)
    q_out, k_out = layer_ops.rotary_embedding(_kernels(isa), positions, q, k, cache)
    q_ref, k_ref = portable.rotary_embedding_torch(positions, q, k, cache)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_threaded(isa, dtype, two_threads) -> None:
    tokens = 4096
    positions = torch.arange(tokens).flip(0)
    _, q, k = _qkv_views(tokens, 9, 3, 64, dtype, seed=20)
    assert q.numel() + k.numel() >= THREADS * layer_ops.MIN_ELEMENTS_PER_THREAD
    cache = _rope(64, tokens, dtype)
    kernels = _kernels(isa)
    q_out, k_out = layer_ops.rotary_embedding(kernels, positions, q, k, cache)
    q_ref, k_ref = portable.rotary_embedding_torch(positions, q, k, cache)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def test_rotary_position_outside_the_cache_is_refused() -> None:
    kernels = native.load_kernels()
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    cache = _rope(8, 4, torch.float32)
    for bad in (4, -1):
        with pytest.raises(IndexError, match="outside the cache's 4"):
            layer_ops.rotary_embedding(kernels, torch.tensor([0, bad]), q, k, cache)


# ---- empty steps, fallbacks, the table -------------------------------------------------------


def test_empty_inputs() -> None:
    kernels = native.load_kernels()
    weight = torch.ones(64)
    empty = torch.empty(0, 64)
    assert layer_ops.rms_norm(kernels, empty, weight, 1e-6).shape == (0, 64)
    out, summed = layer_ops.fused_add_rms_norm(kernels, empty, empty, weight, 1e-6)
    assert out.shape == summed.shape == (0, 64)
    assert layer_ops.silu_and_mul(kernels, torch.empty(0, 128)).shape == (0, 64)
    q_out, k_out = layer_ops.rotary_embedding(
        kernels,
        torch.empty(0, dtype=torch.int64),
        torch.empty(0, 2, 8),
        torch.empty(0, 1, 8),
        _rope(8, 4, torch.float32),
    )
    assert q_out.shape == (0, 2, 8) and k_out.shape == (0, 1, 8)


# kernel -> its portable reference
PORTABLE = {
    "rms_norm": portable.rms_norm_torch,
    "fused_add_rms_norm": portable.fused_add_rms_norm_torch,
    "silu_and_mul": portable.silu_and_mul_torch,
    "rotary_embedding": portable.rotary_embedding_torch,
}


@pytest.mark.parametrize(
    ("kernel", "args", "reason"),
    [
        ("rms_norm", lambda: (_f16(3, 8), torch.ones(8).half(), 1e-6), "float16 is not supported"),
        (
            "rms_norm",
            lambda: (_f16(3, 8).bfloat16(), torch.ones(8), 1e-6),
            "weight is torch.float32 while x is torch.bfloat16",
        ),
        (
            "fused_add_rms_norm",  # the portable op broadcasts the residual
            lambda: (torch.randn(3, 8), torch.randn(1, 8), torch.ones(8), 1e-6),
            "differ in shape",
        ),
        ("silu_and_mul", lambda: (_f16(3, 16),), "float16 is not supported"),
        (
            "rotary_embedding",
            lambda: (
                torch.tensor([1]),
                torch.randn(1, 2, 8),
                torch.randn(1, 1, 8),
                _rope(8, 4, torch.bfloat16),
            ),
            "cos_sin_cache is torch.bfloat16 while query is torch.float32",
        ),
    ],
)
def test_unsupported_inputs_fall_back_with_one_warning(
    kernel, args, reason, fresh_warnings, caplog
) -> None:
    kernels = native.load_kernels()
    inputs = args()
    with caplog.at_level(logging.WARNING):
        results = [getattr(layer_ops, kernel)(kernels, *inputs) for _ in range(2)]
    warnings = [r.getMessage() for r in caplog.records if "layer_ops.c" in r.getMessage()]
    assert len(warnings) == 1  # two layers: still one warning
    assert f"native CPU {kernel} " in warnings[0] and reason in warnings[0]
    expected = _as_tuple(PORTABLE[kernel](*inputs))
    for result in results:
        assert all(torch.equal(a, b) for a, b in zip(_as_tuple(result), expected, strict=True))


def _as_tuple(result: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (result,) if isinstance(result, torch.Tensor) else result


def _f16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).half()


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("vocab", [1, 63, 64, 65, 49152, 151_937])
def test_argmax_is_torchs(isa, dtype, vocab, two_threads) -> None:
    """Each row's largest, the first on ties (a bf16 row has many), a NaN the largest; rows
    read in place from a strided view; 64 rows of a big vocabulary take the threaded path."""
    rows = 64 if vocab >= 49152 else 5
    logits = _randn(rows, vocab + 3, dtype=dtype, seed=vocab)[:, 2 : 2 + vocab]
    if vocab > 1:
        logits[1, :] = logits[1, 0]  # all tied: index 0
        logits[2, vocab // 2] = logits[2, vocab - 1] = 1e4  # a tie at the top: the first
        logits[3, vocab - 1] = float("nan")  # NaN wins, even last
        logits[3, vocab // 3] = float("nan") if vocab > 2 else logits[3, 0]
        logits[4, :] = float("-inf")  # all -inf: index 0
    got = layer_ops.argmax(_kernels(isa), logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.argmax(dim=-1))
    assert torch.equal(got, logits.float().argmax(dim=-1))  # what the sampler used to take


def test_argmax_other_inputs_run_torchs() -> None:
    kernels = _kernels(RUNNABLE[0])
    half = torch.randn(3, 10).half()
    assert torch.equal(layer_ops.argmax(kernels, half), half.argmax(dim=-1))
    assert layer_ops.argmax(kernels, torch.empty(0, 10)).shape == (0,)


def test_cpu_platform_table_runs_the_native_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU platform's table: the C kernels of the loaded build in every slot but the
    matmuls, one table for every model when tuning is off (shared, compared with `is`)."""
    monkeypatch.setenv(TUNING_ENV, "0")
    table = CpuPlatform().kernel_table()
    kernels = native.load_kernels()
    assert kernels is not None
    for slot, fn in (
        ("rms_norm", layer_ops.rms_norm),
        ("fused_add_rms_norm", layer_ops.fused_add_rms_norm),
        ("layer_norm", layer_ops.layer_norm),
        ("fused_add_layer_norm", layer_ops.fused_add_layer_norm),
        ("gelu", layer_ops.gelu),
        ("silu_and_mul", layer_ops.silu_and_mul),
        ("rotary_embedding", layer_ops.rotary_embedding),
        ("argmax", layer_ops.argmax),
    ):
        bound = getattr(table, slot)
        assert bound.func is fn and bound.args == (kernels,)
    assert CpuPlatform().kernel_table() is table
    rope = get_rope(64, 32, object(), table)
    assert rope.kernels is table
    positions = torch.tensor([0, 31])
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    reference = RotaryEmbedding(64, 32, {"rope_type": "default", "rope_theta": 10000.0})
    assert reference.kernels is TORCH_KERNELS
    for ours, ref in zip(rope(positions, q, k), reference(positions, q, k), strict=True):
        assert torch.equal(ours, ref)


def test_cpu_platform_without_a_compiler_warns_once(tmp_path, monkeypatch, caplog) -> None:
    from model_server.platforms import cpu as cpu_platform

    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_compiler", lambda: None)
    native.clear_cache()
    cpu_platform._warn_no_layer_ops.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            tables = [CpuPlatform().kernel_table() for _ in range(2)]
        assert all(
            (t.rms_norm, t.fused_add_rms_norm, t.silu_and_mul, t.rotary_embedding)
            == (
                TORCH_KERNELS.rms_norm,
                TORCH_KERNELS.fused_add_rms_norm,
                TORCH_KERNELS.silu_and_mul,
                TORCH_KERNELS.rotary_embedding,
            )
            for t in tables
        )
        warnings = [r.getMessage() for r in caplog.records if "layer_ops.c" in r.getMessage()]
        assert len(warnings) == 1 and "could not be built" in warnings[0]
    finally:
        native.clear_cache()
        cpu_platform._warn_no_layer_ops.cache_clear()
