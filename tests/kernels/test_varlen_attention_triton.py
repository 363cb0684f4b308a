"""The Triton varlen attention of pooling steps (kernels/varlen_attention_triton.py, the CUDA
table's `varlen_attention`) against SDPA per sequence (`varlen_attention_torch`): fp32, bf16 and
fp16, bidirectional and causal, GQA (a group of 3 included: not a power of two) and MHA, head dims
32 and the non-powers of two 24 and 80, q/k/v as strided views of one fused qkv tensor, empty and
one-token sequences, query and key tiles crossed by short sequences (small tiles) and by one
longer than the default 64-row tile; each sequence sees only its own tokens; bad arguments
refused; tiny BERT and Qwen3 encoders give the portable table's hidden states.

Tolerances against the fp32 reference computed from the same (rounded) inputs:
  - fp32: 2e-5: exact fp32 dots, only the order of the sums and exp2 differ.
  - bf16 / fp16: the output is rounded once to the dtype (bf16 2^-8 relative; the interpreter
    truncates instead of rounding, up to 2^-7) and, compiled, P is rounded to the dtype before
    the P @ V dot as every flash attention does.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from model_server.kernels.table import TORCH_KERNELS, triton_kernels
from model_server.kernels.varlen_attention import varlen_attention_torch
from model_server.kernels.varlen_attention_triton import default_block_m, varlen_attention_triton

pytestmark = pytest.mark.kernels

TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1e-2},
    torch.float16: {"atol": 4e-3, "rtol": 2e-3},
}
LENGTHS = [1, 7, 0, 33, 20]  # 61 tokens: interpreter-sized


def _case(lengths, heads, kv_heads, d, dtype, device, seed=0):
    """q, k, v as column slices of one [T, width + 3] tensor (rows not contiguous), cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * d
    qkv = torch.randn(sum(lengths), width + 3, generator=gen).to(dtype=dtype, device=device)
    q = qkv[:, : heads * d]
    k = qkv[:, heads * d : (heads + kv_heads) * d]
    v = qkv[:, (heads + kv_heads) * d : width]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return q, k, v, cu


def _expected(q, k, v, cu, heads, kv_heads, scale, causal) -> torch.Tensor:
    f = [t.float().cpu() for t in (q, k, v)]
    return varlen_attention_torch(*f, cu, heads, kv_heads, scale, causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(4, 4, 32), (6, 2, 24), (2, 1, 80)])
def test_matches_sdpa_per_sequence(dtype, causal, heads, kv_heads, d, device) -> None:
    q, k, v, cu = _case(LENGTHS, heads, kv_heads, d, dtype, device)
    before = [t.clone() for t in (q, k, v)]
    scale = d**-0.5
    # 16-row and 16-key tiles: the 33- and 20-token sequences span several of each.
    got = varlen_attention_triton(
        q, k, v, cu, heads, kv_heads, scale, causal, block_m=16, tile_n=16
    )
    assert got.dtype == dtype and got.shape == (q.shape[0], heads * d) and got.is_contiguous()
    expected = _expected(q, k, v, cu, heads, kv_heads, scale, causal)
    torch.testing.assert_close(got.float().cpu(), expected, **TOL[dtype])
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v), strict=True))


@pytest.mark.parametrize("causal", [False, True])
def test_default_tiles_with_a_sequence_past_one_query_tile(causal, device) -> None:
    """The slot's own launch (64-row tiles, the default key tile): 70 tokens take two query
    tiles; causal, the second sees an unmasked first key tile, then the diagonal ones."""
    q, k, v, cu = _case([70, 3], 2, 1, 32, torch.float32, device, seed=1)
    got = varlen_attention_triton(q, k, v, cu, 2, 1, 0.3, causal)
    expected = _expected(q, k, v, cu, 2, 1, 0.3, causal)
    torch.testing.assert_close(got.cpu(), expected, **TOL[torch.float32])


def test_each_sequence_sees_only_its_own_tokens(device) -> None:
    """Changing one sequence's K/V leaves the others' outputs bit for bit (no leak across the
    packed boundaries, which a tile reaching into the next sequence's rows would make)."""
    q, k, v, cu = _case([5, 40, 9], 2, 2, 32, torch.float32, device)
    before = varlen_attention_triton(q, k, v, cu, 2, 2, 0.2, block_m=16, tile_n=16)
    k[5:45] += 3.0
    v[5:45] -= 1.0
    after = varlen_attention_triton(q, k, v, cu, 2, 2, 0.2, block_m=16, tile_n=16)
    assert torch.equal(before[:5], after[:5]) and torch.equal(before[45:], after[45:])
    assert not torch.allclose(before[5:45], after[5:45])


def test_no_sequence_launches_nothing(device) -> None:
    q, k, v, _ = _case([3], 2, 2, 16, torch.float32, device)
    out = varlen_attention_triton(q, k, v, torch.tensor([0, 0, 0], dtype=torch.int32), 2, 2, 0.25)
    assert out.shape == (3, 32)


def test_bad_arguments_are_refused(device) -> None:
    q, k, v, cu = _case([4, 4], 2, 2, 16, torch.float32, device)
    with pytest.raises(ValueError, match="must not decrease"):
        varlen_attention_triton(q, k, v, torch.tensor([0, 6, 5], dtype=torch.int32), 2, 2, 0.25)
    with pytest.raises(ValueError, match="within the 8 rows"):
        varlen_attention_triton(q, k, v, torch.tensor([0, 4, 9], dtype=torch.int32), 2, 2, 0.25)
    with pytest.raises(ValueError, match="int32 CPU"):
        varlen_attention_triton(q, k, v, cu.long(), 2, 2, 0.25)
    with pytest.raises(ValueError, match="heads"):
        varlen_attention_triton(q, k, v, cu, 3, 2, 0.25)
    with pytest.raises(ValueError, match="share a dtype"):
        varlen_attention_triton(q, k.double(), v, cu, 2, 2, 0.25)
    with pytest.raises(ValueError, match="same rows"):
        varlen_attention_triton(q, k[:6], v[:6], cu, 2, 2, 0.25)
    with pytest.raises(ValueError, match="power of two"):
        varlen_attention_triton(q, k, v, cu, 2, 2, 0.25, block_m=24)


def test_default_rows_keep_the_q_tile_within_32_kib() -> None:
    """64 rows up to D 128 in every dtype; fp32 at D 256 (past sm_89's shared memory at 64
    rows) takes 32."""
    assert default_block_m(32, torch.float32) == 64
    assert default_block_m(128, torch.float32) == 64
    assert default_block_m(256, torch.bfloat16) == 64
    assert default_block_m(256, torch.float32) == 32


def test_the_triton_table_carries_it() -> None:
    from model_server.platforms.cuda import CudaPlatform

    assert triton_kernels().varlen_attention is varlen_attention_triton
    assert CudaPlatform().kernel_table().varlen_attention is varlen_attention_triton
    assert TORCH_KERNELS.varlen_attention is varlen_attention_torch


def _tiny_bert():
    from transformers import BertConfig

    from model_server.models.bert import BertModel

    config = BertConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=64,
    )  # fmt: skip
    return BertModel, config


def _tiny_qwen3():
    from transformers import Qwen3Config

    from model_server.models.decoder_embedding import DecoderEmbeddingModel

    config = Qwen3Config(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=64,
    )  # fmt: skip
    return DecoderEmbeddingModel, config


@pytest.mark.parametrize("build", [_tiny_bert, _tiny_qwen3], ids=["bert", "qwen3"])
def test_tiny_pooling_model_matches_the_portable_table(build, device) -> None:
    """A random encoder (bidirectional, fused qkv views) and decoder embedding model (causal,
    GQA, head_dim 24) built with the Triton table: the portable table's hidden states."""
    from model_server.models.pooling_batch import PackedBatch

    cls, config = build()
    portable = cls(config, TORCH_KERNELS).eval()
    gen = torch.Generator().manual_seed(0)
    with (
        torch.no_grad()
    ):  # the layers allocate their weights uninitialised (a checkpoint fills them)
        for param in portable.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    portable = portable.to(device)
    # Only the attention slot differs, whatever else triton_kernels() replaces.
    kernels = replace(TORCH_KERNELS, varlen_attention=triton_kernels().varlen_attention)
    fast = cls(config, kernels).eval().to(device)
    fast.load_state_dict(portable.state_dict())
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(1, 100, (n,), generator=gen).tolist() for n in (9, 1, 30, 17)]
    batch = PackedBatch.build(seqs, [None] * len(seqs), torch.device(device))
    with torch.no_grad():
        expected, got = portable(batch), fast(batch)
    assert got.shape == (57, 64)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
