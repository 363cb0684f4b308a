"""Quantized KV caches (kernels/kv_cache_dtype.py): the reference quantizer, then each CPU-side
backend's store and attention with int8 / fp8 caches. The store must write the reference's codes
and scales bit for bit; attention must match the float32 reference run on the dequantized cache
(float tolerances: the same values, summed in another order), and the unquantized reference
within what the format's rounding allows (see FORMAT_TOL). Native C kernel: every ISA path this
machine runs (AVX2 and generic forced on AVX-512 machines), fp32 and bf16 queries, GQA, odd head
dims, block boundaries. The Triton kernels: tests/kernels/test_kv_cache_dtype_triton.py."""

from __future__ import annotations

import pytest
import torch

from model_server.kernels.cpu import isa as isa_mod
from model_server.kernels.cpu import native
from model_server.kernels.kv_cache_dtype import (
    dequantize_kv,
    quantize_kv,
    resolve_kv_cache_dtype,
)
from model_server.kernels.reference import paged_attention_reference, store_kv_reference
from model_server.layers.attention.torch_backend import TorchAttentionBackend
from tests.kernels.helpers import PagedBatch, make_batch

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
RUNNABLE = [i.name for i in isa_mod.supported_isas(isa_mod.cpu_flags())]
# Against the reference on the same dequantized cache: only summation order (and bf16 output
# rounding) differs, as in test_cpu_paged_attention.py.
SAME_VALUES_TOL = {
    torch.float32: {"atol": 3e-5, "rtol": 3e-5},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1e-2},
}
# Against the unquantized cache, outputs of unit-variance K/V (|out| < ~1.5): each cached value
# moves by at most half a step of its row's grid, relative to the row's max |x| (~2.5-3.5 for
# 64-128 normal values): int8 1/254 of it (~0.013), e4m3 2^-4 and e5m2 2^-3 of the value itself
# (3 and 2 mantissa bits). Scores are sums of 64-128 such products (errors partly cancel) and
# outputs are convex mixtures of V rows, so the output error stays within a few steps: bounds of
# 2-3x the largest error measured over these shapes (int8 0.012, e4m3 0.06, e5m2 0.12).
FORMAT_TOL = {"int8": 0.03, "fp8_e4m3": 0.15, "fp8_e5m2": 0.3}
MIXED = [(0, 1), (7, 1), (8, 1), (26, 1), (0, 13), (9, 30), (8, 5), (3, 2), (40, 17)]


def _kv(fmt: str):
    return resolve_kv_cache_dtype(fmt, torch.float32)


# ---- the reference quantizer ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_round_trip_within_half_a_step(fmt) -> None:
    kv = _kv(fmt)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 72, generator=gen) * torch.logspace(-6, 3, 64)[:, None, None]
    x[5, 1] = 0.0  # an all-zero row
    codes, scales = quantize_kv(x, kv)
    assert codes.dtype == kv.storage and scales.dtype == torch.float32
    assert scales.shape == (64, 3)
    assert scales[5, 1] == 0 and torch.all(codes[5, 1].float() == 0)
    assert codes.float().abs().max() <= kv.qmax
    back = dequantize_kv(codes, scales, torch.float32)
    assert torch.all(back[5, 1] == 0)
    # The row's max is a code of its own (scale = amax / qmax): exact up to one rounding.
    amax = x.abs().amax(-1)
    torch.testing.assert_close(back.abs().amax(-1), amax, rtol=1e-6, atol=0)
    err = (back - x).abs()
    if fmt == "int8":
        bound = 0.5 * scales[..., None] * (1 + 1e-5)
    else:
        # Relative half step of the mantissa, plus half the smallest subnormal step (absolute).
        mbits, min_sub = (3, 2.0**-9) if fmt == "fp8_e4m3" else (2, 2.0**-16)
        bound = x.abs() * 2.0 ** -(mbits + 1) + 0.5 * min_sub * scales[..., None]
        bound = bound * (1 + 1e-5)
    assert torch.all(err <= bound)


def test_resolve_names() -> None:
    assert resolve_kv_cache_dtype("auto", torch.bfloat16).storage == torch.bfloat16
    assert resolve_kv_cache_dtype("float16", torch.float32).storage == torch.float16
    assert not resolve_kv_cache_dtype("bfloat16", torch.float32).quantized
    int8 = resolve_kv_cache_dtype("int8", torch.bfloat16)
    assert int8.quantized and int8.storage == torch.int8
    # One token's row of one head: D codes and a float32 scale.
    assert int8.bytes_per_token_head(64) == 68
    assert resolve_kv_cache_dtype("auto", torch.bfloat16).bytes_per_token_head(64) == 128
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        resolve_kv_cache_dtype("fp4", torch.float32)


# ---- backends ---------------------------------------------------------------------------------


def _quantized_caches(b: PagedBatch, fmt: str):
    """The batch's float caches (cached prefixes filled in) quantized as the store would."""
    kv = _kv(fmt)
    kc, ks = quantize_kv(b.k_cache, kv)
    vc, vs = quantize_kv(b.v_cache, kv)
    return kc, vc, ks, vs


def _expected_store(b: PagedBatch, fmt: str, kc, vc, ks, vs, fixed_scale: float | None = None):
    """The caches after the reference store of the batch's new K/V (rows quantized alone, or
    all with the static `fixed_scale`)."""
    kv = _kv(fmt)
    kc, vc, ks, vs = kc.clone(), vc.clone(), ks.clone(), vs.clone()
    slots = b.metadata.slot_mapping
    hkv, d = b.k.shape[1], b.k.shape[2]
    for cache, scales, x in ((kc, ks, b.k), (vc, vs, b.v)):
        codes, s = quantize_kv(x, kv, fixed_scale)
        cache.view(-1, hkv, d).view(torch.uint8)[slots] = codes.view(torch.uint8)
        scales.view(-1, hkv)[slots] = s
    return kc, vc, ks, vs


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Codes as bytes (fp8 has no equality on CPU), scales as they are."""
    return t if t.dtype == torch.float32 else t.view(torch.uint8)


def check_backend(
    run,
    requests,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype,
    fmt,
    device: str = "cpu",
    fixed_scale: float | None = None,
):
    """`run(b, kc, vc, ks, vs) -> out`, storing b.k, b.v and attending, on quantized caches
    built on `device`; with `fixed_scale`, `run` stores every row with that static scale."""
    b = make_batch(
        requests,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
        seed=3,
    )
    md = b.metadata
    kc, vc, ks, vs = _quantized_caches(b, fmt)
    want = _expected_store(b, fmt, kc, vc, ks, vs, fixed_scale)
    out = run(b, kc, vc, ks, vs)
    if fixed_scale is not None:  # the rows stored with it, no other scale
        stored = ks.view(-1, num_kv_heads)[md.slot_mapping[md.slot_mapping >= 0].to(ks.device)]
        assert bool((stored == fixed_scale).all())
    # The store: the reference's codes and scales, bit for bit, nothing else touched.
    for got, exp in zip((kc, vc, ks, vs), want, strict=True):
        assert torch.equal(_bits(got), _bits(exp))
    assert out.dtype == dtype
    # The read: the reference attention over the dequantized cache.
    k_deq, v_deq = dequantize_kv(kc, ks, torch.float32), dequantize_kv(vc, vs, torch.float32)
    args = (md.query_start_loc_cpu, md.seq_lens_cpu, b.block_tables, head_dim**-0.5)
    expected = paged_attention_reference(b.q, k_deq, v_deq, *args)
    torch.testing.assert_close(out.float(), expected, **SAME_VALUES_TOL[dtype])
    # Against the unquantized cache: within the format's rounding.
    kf, vf = b.k_cache.float().clone(), b.v_cache.float().clone()
    store_kv_reference(b.k.float(), b.v.float(), kf, vf, md.slot_mapping)
    exact = paged_attention_reference(b.q, kf, vf, *args)
    tol = FORMAT_TOL[fmt] + (SAME_VALUES_TOL[dtype]["atol"] if dtype != torch.float32 else 0)
    if fixed_scale is not None:
        # One scale for every row: small rows sit lower on the grid (fp8: in its subnormals)
        # than with their own; measured up to 0.1504 against e4m3's 0.15.
        tol *= 1.5
    assert (out.float() - exact).abs().max().item() <= tol


def _native(isa: str, fixed_scale: float | None = None):
    def run(b, kc, vc, ks, vs):
        kernels = native.load_kernels(isa)
        assert kernels is not None and kernels.lib.wick_isa().decode() == isa
        md = b.metadata
        return native.paged_attention(
            kernels,
            b.q,
            kc,
            vc,
            md.block_tables,
            md.query_start_loc,
            md.seq_lens,
            b.q.shape[2] ** -0.5,
            k=b.k,
            v=b.v,
            slot_mapping=md.slot_mapping,
            k_scales=ks,
            v_scales=vs,
            kv_fixed_scale=fixed_scale,
        )

    return run


def _torch_backend(b, kc, vc, ks, vs):
    num_heads, head_dim = b.q.shape[1], b.q.shape[2]
    backend = TorchAttentionBackend(num_heads, b.k.shape[1], head_dim, head_dim**-0.5)
    return backend.forward(b.q, b.k, b.v, kc, vc, b.metadata, k_scales=ks, v_scales=vs)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (4, 1, 72)]
)
def test_native_quantized(isa, fmt, dtype, num_heads, num_kv_heads, head_dim) -> None:
    check_backend(_native(isa), MIXED, num_heads, num_kv_heads, head_dim, 8, dtype, fmt)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [1, 16])
def test_native_quantized_block_boundaries(isa, fmt, block_size) -> None:
    requests = [(0, 1), (block_size - 1, 1), (block_size, 1), (block_size + 1, 3), (5, 20)]
    check_backend(_native(isa), requests, 6, 2, 36, block_size, torch.float32, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (4, 1, 72)]
)
def test_torch_backend_quantized(fmt, dtype, num_heads, num_kv_heads, head_dim) -> None:
    check_backend(_torch_backend, MIXED, num_heads, num_kv_heads, head_dim, 8, dtype, fmt)


def fixed_scale_of(fmt: str) -> float:
    """A static scale that holds unit-variance K/V (|x| < 4.5) without clamping."""
    return 4.5 / _kv(fmt).qmax


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_quantized_with_a_static_scale(isa, fmt, dtype) -> None:
    """--quantization-param-path's per-layer scale: every stored row takes it, bit for bit as
    the reference quantizer (`quantize_kv(x, kv, fixed_scale)`)."""
    fixed = fixed_scale_of(fmt)
    check_backend(_native(isa, fixed), MIXED, 9, 3, 64, 8, dtype, fmt, fixed_scale=fixed)


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_backend_quantized_with_a_static_scale(fmt) -> None:
    fixed = fixed_scale_of(fmt)

    def run(b, kc, vc, ks, vs):
        num_heads, head_dim = b.q.shape[1], b.q.shape[2]
        backend = TorchAttentionBackend(num_heads, b.k.shape[1], head_dim, head_dim**-0.5)
        return backend.forward(
            b.q, b.k, b.v, kc, vc, b.metadata, k_scales=ks, v_scales=vs, kv_fixed_scale=fixed
        )

    check_backend(run, MIXED, 9, 3, 64, 8, torch.float32, fmt, fixed_scale=fixed)


def test_a_static_scale_clamps_what_it_cannot_hold() -> None:
    kv = _kv("int8")
    codes, scales = quantize_kv(torch.tensor([[1.0, -3.0, 0.5]]), kv, fixed_scale=0.01)
    assert codes.tolist() == [[100, -127, 50]] and scales.tolist() == pytest.approx([0.01])


@pytest.mark.parametrize("isa", RUNNABLE)
def test_native_bf16_cache_under_fp32_queries(isa) -> None:
    """--kv-cache-dtype bfloat16 with an fp32 model: the store rounds to bf16, reads widen."""
    b = make_batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=64, block_size=8, seed=4)
    md = b.metadata
    kc, vc = b.k_cache.to(torch.bfloat16), b.v_cache.to(torch.bfloat16)
    out = native.paged_attention(
        native.load_kernels(isa),
        b.q,
        kc,
        vc,
        md.block_tables,
        md.query_start_loc,
        md.seq_lens,
        0.125,
        k=b.k,
        v=b.v,
        slot_mapping=md.slot_mapping,
    )
    k_ref, v_ref = b.k_cache.to(torch.bfloat16), b.v_cache.to(torch.bfloat16)
    store_kv_reference(b.k, b.v, k_ref, v_ref, md.slot_mapping)
    assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref)
    args = (md.query_start_loc_cpu, md.seq_lens_cpu, b.block_tables, 0.125)
    expected = paged_attention_reference(b.q, k_ref, v_ref, *args)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, **SAME_VALUES_TOL[torch.float32])


def test_native_refuses_quantized_cache_without_scales() -> None:
    b = make_batch([(3, 1)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8)
    kc, vc, _, _ = _quantized_caches(b, "int8")
    md = b.metadata
    with pytest.raises(ValueError, match="needs its scales"):
        native.paged_attention(
            native.load_kernels(),
            b.q,
            kc,
            vc,
            md.block_tables,
            md.query_start_loc,
            md.seq_lens,
            0.125,
        )
