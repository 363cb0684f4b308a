"""The native varlen attention of pooling steps (kernels/cpu/varlen_attention.c) against SDPA per
sequence, on every ISA path this machine runs: fp32 and bf16, bidirectional and causal, GQA, head
dims below, at and past the vector width, strided q/k/v views of a fused qkv projection, empty
and one-token sequences, several threads; bad arguments refused."""

from __future__ import annotations

import pytest
import torch

from model_server.kernels.cpu import isa as isa_mod
from model_server.kernels.cpu import native
from model_server.kernels.cpu.varlen_attention import MIN_WORK_PER_THREAD, varlen_attention
from model_server.kernels.varlen_attention import varlen_attention_torch

RUNNABLE = [i.name for i in isa_mod.supported_isas(isa_mod.cpu_flags())]
# fp32 sums in another order; bf16 outputs round to 2^-8 relative (the reference's own bf16
# SDPA rounds its intermediate results too, so it is computed in fp32 and compared loosely).
TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 1.6e-2, "rtol": 1e-2}}
LENGTHS = [1, 7, 0, 33, 16, 130, 2, 64]


def _kernels(isa: str) -> native.NativeKernels:
    kernels = native.load_kernels(isa)
    assert kernels is not None and kernels.lib.wick_isa().decode() == isa
    return kernels


def _case(lengths, heads, kv_heads, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    width = (heads + 2 * kv_heads) * d
    qkv = torch.randn(t, width + 3, generator=gen).to(dtype)  # +3: rows not contiguous
    q = qkv[:, : heads * d]
    k = qkv[:, heads * d : (heads + kv_heads) * d]
    v = qkv[:, (heads + kv_heads) * d : width]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return q, k, v, bounds


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "d"), [(4, 4, 32), (4, 2, 64), (2, 1, 80), (3, 3, 8)]
)
def test_varlen_attention_matches_sdpa_per_sequence(isa, dtype, causal, heads, kv_heads, d):
    q, k, v, bounds = _case(LENGTHS, heads, kv_heads, d, dtype)
    scale = d**-0.5
    cu = torch.tensor(bounds, dtype=torch.int32)
    expected = varlen_attention_torch(
        q.float(), k.float(), v.float(), cu, heads, kv_heads, scale, causal
    )
    for min_work in (MIN_WORK_PER_THREAD, 0):  # one thread and all of them
        got = varlen_attention(q, k, v, cu, heads, kv_heads, scale, causal, _kernels(isa), min_work)
        assert got.dtype == dtype and got.shape == (q.shape[0], heads * d)
        torch.testing.assert_close(got.float(), expected, **TOL[dtype])


def test_each_sequence_sees_only_its_own_tokens() -> None:
    """Changing one sequence's K/V leaves the others' outputs bit for bit (no leak across the
    packed boundaries, which a padded or shared softmax would make)."""
    q, k, v, bounds = _case([5, 40, 9], 2, 2, 32, torch.float32)
    cu = torch.tensor(bounds, dtype=torch.int32)
    before = varlen_attention(q, k, v, cu, 2, 2, 0.2)
    k[5:45] += 3.0
    v[5:45] -= 1.0
    after = varlen_attention(q, k, v, cu, 2, 2, 0.2)
    assert torch.equal(before[:5], after[:5]) and torch.equal(before[45:], after[45:])
    assert not torch.allclose(before[5:45], after[5:45])


def test_bad_arguments_are_refused() -> None:
    q, k, v, bounds = _case([4, 4], 2, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="must not decrease"):
        varlen_attention(q, k, v, torch.tensor([0, 6, 5], dtype=torch.int32), 2, 2, 0.25)
    with pytest.raises(ValueError, match="within the 8 rows"):
        varlen_attention(q, k, v, torch.tensor([0, 4, 9], dtype=torch.int32), 2, 2, 0.25)
    with pytest.raises(ValueError, match="int32"):
        varlen_attention(q, k, v, torch.tensor(bounds), 2, 2, 0.25)
    with pytest.raises(ValueError, match="heads"):
        varlen_attention(q, k, v, torch.tensor(bounds, dtype=torch.int32), 3, 2, 0.25)
    with pytest.raises(ValueError, match="share a dtype"):
        varlen_attention(q, k.double(), v, torch.tensor(bounds, dtype=torch.int32), 2, 2, 0.25)


def test_the_cpu_kernel_table_runs_the_native_kernel() -> None:
    """The pooling models call the table's slot: the CPU platform's is this kernel (with its
    build), the portable table's SDPA per sequence."""
    from model_server.kernels.table import TORCH_KERNELS
    from model_server.platforms import get_platform

    slot = get_platform("cpu").kernel_table().varlen_attention
    assert slot.func is varlen_attention and slot.keywords["kernels"] is not None
    assert TORCH_KERNELS.varlen_attention is varlen_attention_torch
