"""The fused RMSNorm / add + RMSNorm / SiluAndMul Triton kernels vs the PyTorch layers, layers
built with the Triton kernel table (`kernels.table.triton_kernels`, CUDA's), and a whole tiny
model generating the same tokens.

Tolerances (assert_close rtol, atol), and why:
  - fp32: 1e-5, 1e-6: only the order of the fp32 sum of squares and the exp/rsqrt
    implementations differ (a few ulps).
  - fp16: 1e-3 (about one fp16 ulp): both round at the same points; a few-ulp fp32 difference
    can flip a rounding. At least 99% of the elements must be bit-identical (checks that the
    normalised value is rounded before the weight multiply, silu before the up multiply).
  - bf16: 2^-6 (two to four bf16 ulps): the Triton interpreter truncates fp32 -> bf16 casts
    where compiled Triton (and PyTorch) round to nearest even, so under the interpreter each of
    the two roundings may be one ulp low. Compiled (on a GPU), at least 99% bit-identical too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

import model_server.kernels.activation as activation_kernels
import model_server.kernels.rms_norm as rms_norm_kernels
from model_server.kernels import portable
from model_server.kernels.activation import silu_and_mul
from model_server.kernels.int8_linear import int8_linear
from model_server.kernels.rms_norm import fused_add_rms_norm, rms_norm
from model_server.kernels.rotary import rotary_embedding
from model_server.kernels.table import TORCH_KERNELS, KernelTable, triton_kernels
from model_server.layers.activation import SiluAndMul, get_act_and_mul_fn
from model_server.layers.norm import RMSNorm
from model_server.layers.rotary import RotaryEmbedding
from model_server.platforms.cuda import CudaPlatform
from model_server.sampling_params import SamplingParams
from tests.kernels.helpers import MIXED_PROMPTS, TINY_CONFIGS, tiny_llm, use_kernels

pytestmark = pytest.mark.kernels

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (2**-6, 2**-6)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HIDDEN = [64, 96, 1024]  # 96: not a power of two (masked tile)
ROWS = [1, 7]


def _assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    rtol, atol = TOL[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    if expected.dtype == torch.float16 or (expected.dtype == torch.bfloat16 and not INTERPRETED):
        exact = (actual == expected).float().mean().item()
        assert exact >= 0.99, f"only {exact:.1%} of the elements are bit-identical"


def _norm(
    hidden: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    kernels: KernelTable = TORCH_KERNELS,
) -> RMSNorm:
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, eps=1e-6, kernels=kernels).to(device=device, dtype=dtype)
    with torch.no_grad():  # a non-trivial weight: the rounding before the multiply shows
        norm.weight.copy_(1.0 + 0.5 * torch.randn(hidden, generator=gen))
    return norm


def _randn(*shape: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(*shape, generator=gen)).to(dtype=dtype, device=device)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_module(dtype, hidden, rows, device) -> None:
    norm = _norm(hidden, dtype, device)
    x = _randn(rows, hidden, dtype=dtype, device=device, seed=1)
    _assert_matches(rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_matches_module(dtype, hidden, rows, device) -> None:
    norm = _norm(hidden, dtype, device)
    x = _randn(rows, hidden, dtype=dtype, device=device, seed=2)
    residual = _randn(rows, hidden, dtype=dtype, device=device, seed=3)
    out, new_residual = fused_add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
    ref_out, ref_residual = norm(x, residual)
    _assert_matches(new_residual, ref_residual)
    _assert_matches(out, ref_out)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("d", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_module(dtype, d, rows, device) -> None:
    x = _randn(rows, 2 * d, dtype=dtype, device=device, seed=4)
    _assert_matches(silu_and_mul(x), SiluAndMul()(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_fused_add_rms_norm_contract(dtype, device) -> None:
    """(norm(x + r), x + r) in new buffers; x and residual untouched; the sum exactly
    PyTorch's `x + residual` (fp16 casts round to nearest even under the interpreter too)."""
    norm = _norm(96, dtype, device)
    x = _randn(5, 96, dtype=dtype, device=device, seed=5)
    residual = _randn(5, 96, dtype=dtype, device=device, seed=6)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = fused_add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
    pointers = {x.data_ptr(), residual.data_ptr()}
    assert out.data_ptr() not in pointers and new_residual.data_ptr() not in pointers
    assert torch.equal(new_residual, x + residual)
    _assert_matches(out, norm(x + residual))
    # A second layer consuming the outputs (the decoder's chain) sees what PyTorch would.
    out2, residual2 = fused_add_rms_norm(out, new_residual, norm.weight, norm.variance_epsilon)
    ref2, ref_residual2 = norm(out, new_residual)
    assert torch.equal(residual2, ref_residual2)
    _assert_matches(out2, ref2)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 1, 32), (3, 2, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_qk_norm_views(num_heads, num_kv_heads, head_dim, dtype, device) -> None:
    """Qwen3's q/k norm: per-head [T, H, D] views of the fused qkv projection (row stride
    (H + 2 Hkv) * D, head stride D), as `LlamaAttention.forward` passes them."""
    tokens = 5
    qkv = _randn(
        tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device, seed=7
    )
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(-1, num_heads, head_dim)
    k = k.view(-1, num_kv_heads, head_dim)
    assert not q.is_contiguous()
    qkv_before = qkv.clone()
    norm = _norm(head_dim, dtype, device)
    for view in (q, k):
        out = rms_norm(view, norm.weight, norm.variance_epsilon)
        assert out.is_contiguous()
        _assert_matches(out, norm(view))
    assert torch.equal(qkv, qkv_before)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "tokens"),
    [(4, 1, 32, 1), (3, 2, 96, 5), (32, 8, 128, 3)],  # 96: a half of 48, not a power of two
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_matches_the_portable_one(num_heads, num_kv_heads, head_dim, tokens, dtype, device):
    """Neox rotary of the fused qkv projection's q/k views at scattered positions: PyTorch's
    bits (every product and sum rounded to the dtype; no FMA), bf16 within its tolerance under
    the interpreter (which truncates bf16 casts); the inputs are not written."""
    qkv = _randn(
        tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device, seed=11
    )
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(-1, num_heads, head_dim)
    k = k.view(-1, num_kv_heads, head_dim)
    rope = RotaryEmbedding(head_dim, 4096, {"rope_type": "default", "rope_theta": 10000.0})
    cache = rope.cos_sin_cache.to(device=device, dtype=dtype)
    positions = torch.tensor([4095, 0, 17, 1000, 3][:tokens], device=device)
    qkv_before = qkv.clone()
    got_q, got_k = rotary_embedding(positions, q, k, cache)
    want_q, want_k = portable.rotary_embedding_torch(positions, q, k, cache)
    assert torch.equal(qkv, qkv_before)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    for got, want in ((got_q, want_q), (got_k, want_k)):
        if dtype == torch.bfloat16 and INTERPRETED:
            _assert_matches(got, want)
        else:
            assert torch.equal(got, want)


def test_rotary_refuses_mismatched_inputs(device) -> None:
    q = torch.zeros(2, 4, 32, device=device)
    k = torch.zeros(2, 2, 32, device=device)
    positions = torch.zeros(2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="even head_dim"):
        rotary_embedding(positions, q, k, torch.zeros(8, 16, device=device))
    with pytest.raises(ValueError, match="share a dtype"):
        rotary_embedding(positions, q, k, torch.zeros(8, 32, device=device, dtype=torch.float16))
    empty_q, empty_k = rotary_embedding(
        positions[:0], q[:0], k[:0], torch.zeros(8, 32, device=device)
    )
    assert empty_q.shape == (0, 4, 32) and empty_k.shape == (0, 2, 32)


def test_rms_norm_strided_rows_and_mixed_layouts(device) -> None:
    """Rows with a gap (a column slice), a 4-D input, and x / residual in different layouts."""
    dtype = torch.float32
    norm = _norm(64, dtype, device)
    wide = _randn(6, 100, dtype=dtype, device=device, seed=8)
    x = wide[:, 16:80]  # [6, 64], row stride 100
    _assert_matches(rms_norm(x, norm.weight, 1e-6), norm(x))
    x4 = _randn(2, 3, 2, 64, dtype=dtype, device=device, seed=9)
    _assert_matches(rms_norm(x4, norm.weight, 1e-6), norm(x4))
    heads = _randn(3, 2 * 2 * 64, dtype=dtype, device=device, seed=10)[:, : 2 * 64].view(3, 2, 64)
    residual = _randn(3, 2, 64, dtype=dtype, device=device, seed=11)
    out, new_residual = fused_add_rms_norm(heads, residual, norm.weight, 1e-6)
    ref_out, ref_residual = norm(heads, residual)
    assert torch.equal(new_residual, ref_residual)
    _assert_matches(out, ref_out)
    # A column-strided last dim is copied, not misread.
    xt = _randn(64, 4, dtype=dtype, device=device, seed=12).t()
    _assert_matches(rms_norm(xt, norm.weight, 1e-6), norm(xt))


@pytest.mark.parametrize("hidden", [96, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_rms_norm_multi_tile_rows(monkeypatch, hidden, dtype, device) -> None:
    """Rows longer than one tile (> 8192 in production) take the two-pass loop: forced here
    with 32-element tiles, 100 leaving a partial last tile."""
    monkeypatch.setattr(rms_norm_kernels, "_MAX_BLOCK_N", 32)
    norm = _norm(hidden, dtype, device)
    x = _randn(3, hidden, dtype=dtype, device=device, seed=13)
    residual = _randn(3, hidden, dtype=dtype, device=device, seed=14)
    _assert_matches(rms_norm(x, norm.weight, 1e-6), norm(x))
    out, new_residual = fused_add_rms_norm(x, residual, norm.weight, 1e-6)
    ref_out, ref_residual = norm(x, residual)
    assert torch.equal(new_residual, ref_residual)
    _assert_matches(out, ref_out)


def test_silu_and_mul_multi_tile_and_layouts(monkeypatch, device) -> None:
    """Several programs per row (forced 32-wide tiles, d = 100), strided rows, 3-D input."""
    monkeypatch.setattr(activation_kernels, "_MAX_BLOCK_D", 32)
    act = SiluAndMul()
    x = _randn(3, 200, dtype=torch.float32, device=device, seed=15)
    _assert_matches(silu_and_mul(x), act(x))
    wide = _randn(4, 260, dtype=torch.float32, device=device, seed=16)
    strided = wide[:, 30:230]
    before = wide.clone()
    _assert_matches(silu_and_mul(strided), act(strided))
    assert torch.equal(wide, before)
    x3 = _randn(2, 3, 64, dtype=torch.float32, device=device, seed=17)
    _assert_matches(silu_and_mul(x3), act(x3))


def test_empty_and_invalid_inputs(device) -> None:
    weight = torch.ones(64, device=device)
    empty = torch.empty(0, 64, device=device)
    assert rms_norm(empty, weight, 1e-6).shape == (0, 64)
    out, res = fused_add_rms_norm(empty, empty, weight, 1e-6)
    assert out.shape == res.shape == (0, 64)
    assert silu_and_mul(torch.empty(0, 128, device=device)).shape == (0, 64)
    x = torch.randn(2, 64, device=device)
    with pytest.raises(ValueError, match="residual has shape"):
        fused_add_rms_norm(x, torch.randn(1, 64, device=device), weight, 1e-6)
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(x, torch.ones(32, device=device), 1e-6)
    with pytest.raises(ValueError, match="odd"):
        silu_and_mul(torch.randn(2, 63, device=device))


def test_layers_run_the_table_they_were_built_with(device) -> None:
    """Layers built with the Triton table call its kernels; layers built with the default table,
    in the same process and at the same time, still run PyTorch's."""
    table = triton_kernels()
    assert (table.rms_norm, table.fused_add_rms_norm, table.silu_and_mul) == (
        rms_norm,
        fused_add_rms_norm,
        silu_and_mul,
    )
    assert table.int8_linear is int8_linear and table.linear is TORCH_KERNELS.linear
    norm = _norm(96, torch.float32, device, kernels=table)
    plain_norm = _norm(96, torch.float32, device)
    act, plain_act = get_act_and_mul_fn("silu", table), SiluAndMul()
    assert isinstance(act, SiluAndMul) and act.kernels is table
    assert plain_norm.kernels is TORCH_KERNELS and plain_act.kernels is TORCH_KERNELS
    x = _randn(3, 96, dtype=torch.float32, device=device, seed=18)
    residual = _randn(3, 96, dtype=torch.float32, device=device, seed=19)
    gate_up = _randn(3, 192, dtype=torch.float32, device=device, seed=20)
    assert torch.equal(norm(x), rms_norm(x, norm.weight, 1e-6))
    fused = norm(x, residual)
    kernel = fused_add_rms_norm(x, residual, norm.weight, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(fused, kernel, strict=True))
    assert torch.equal(act(gate_up), silu_and_mul(gate_up))
    assert torch.equal(plain_norm(x), portable.rms_norm_torch(x, norm.weight, 1e-6))
    assert torch.equal(plain_act(gate_up), portable.silu_and_mul_torch(gate_up))


def test_cuda_platform_table_is_the_triton_one() -> None:
    # Constructing the platform and its table needs no GPU (the kernels compile on first launch).
    assert CudaPlatform().kernel_table() == triton_kernels()


def _counted(fn: Callable, name: str, calls: dict[str, int]) -> Callable:
    def wrapper(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **kwargs)

    return wrapper


def _generate(tmp_path, name: str) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = tiny_llm(tmp_path, name)
    return [o.outputs[0].token_ids for o in llm.generate(MIXED_PROMPTS, params)]


def _with_norms(table: KernelTable, source: KernelTable | object) -> KernelTable:
    """`table` with the RMSNorm, add + RMSNorm and SiluAndMul of `source` (a table or a module
    defining them)."""
    return replace(
        table,
        rms_norm=source.rms_norm,
        fused_add_rms_norm=source.fused_add_rms_norm,
        silu_and_mul=source.silu_and_mul,
    )


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_model_generates_the_same_with_fused_ops(tmp_path, name, monkeypatch) -> None:
    """Llama (GQA, tied embeddings) and Qwen3 (q/k norm on strided head views): greedy tokens
    with the fused kernels equal the PyTorch layers' (fp32, Triton attention both times; the
    platform's matmuls both times)."""
    # The fixed matmuls: a tuned plan may fuse the MLP's SiLU into the gate/up panels (then
    # silu_and_mul never runs) depending on how the tiny shapes time.
    monkeypatch.setenv("WICK_CPU_LINEAR_TUNING", "0")
    use_kernels(monkeypatch, lambda table: _with_norms(table, TORCH_KERNELS))
    expected = _generate(tmp_path, name)
    calls: dict[str, int] = {}
    for module, kernel in (
        (rms_norm_kernels, "rms_norm"),
        (rms_norm_kernels, "fused_add_rms_norm"),
        (activation_kernels, "silu_and_mul"),
    ):
        monkeypatch.setattr(module, kernel, _counted(getattr(module, kernel), kernel, calls))
    # The counted kernels, as `triton_kernels()` imports them when called.
    use_kernels(monkeypatch, lambda table: _with_norms(table, triton_kernels()))
    actual = _generate(tmp_path, name)
    assert set(calls) == {"rms_norm", "fused_add_rms_norm", "silu_and_mul"}
    assert actual == expected
    assert all(len(t) == 8 for t in expected)
