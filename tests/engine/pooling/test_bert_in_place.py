"""The encoder's activations and residual adds run in place on the linear layers' new outputs
(models/bert.py): they must give the out-of-place ops' bits and never write into a tensor the
caller still holds (the residual stream, the block's input) or into the weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig

from model_server.kernels.table import TORCH_KERNELS
from model_server.models.bert import BertModel, _DenseNorm, _Intermediate
from model_server.models.pooling_batch import PackedBatch


def _config(hidden_act: str = "gelu") -> BertConfig:
    return BertConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=40, hidden_act=hidden_act,
    )  # fmt: skip


def _randomize(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return module.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_norm_adds_the_residual_into_its_own_output(dtype: torch.dtype) -> None:
    block = _randomize(_DenseNorm(64, _config(), kernels=TORCH_KERNELS), dtype)
    x = torch.randn(7, 64, dtype=dtype)
    residual = torch.randn(7, 32, dtype=dtype)
    x_before, residual_before = x.clone(), residual.clone()
    with torch.no_grad():
        out = block(x, residual)
        expected = block.LayerNorm(F.linear(x, block.dense.weight, block.dense.bias) + residual)
    assert torch.equal(out, expected)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new", "relu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_intermediate_activation_matches_the_out_of_place_op(
    hidden_act: str, dtype: torch.dtype
) -> None:
    block = _randomize(_Intermediate(_config(hidden_act), kernels=TORCH_KERNELS), dtype)
    x = torch.randn(5, 32, dtype=dtype)
    x_before = x.clone()
    with torch.no_grad():
        out = block(x)
        pre = F.linear(x, block.dense.weight, block.dense.bias)
    if hidden_act == "relu":
        expected = F.relu(pre)
    else:
        expected = F.gelu(pre, approximate="none" if hidden_act == "gelu" else "tanh")
    assert torch.equal(out, expected)
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encoder_leaves_weights_alone_and_repeats_its_answer(dtype: torch.dtype) -> None:
    model = _randomize(BertModel(_config(), kernels=TORCH_KERNELS), dtype)
    weights = {name: t.clone() for name, t in model.state_dict().items()}
    batch = PackedBatch.build(
        [[1, 5, 9, 2], [3, 4], [7, 8, 11, 12, 13]], [None, [0, 1], None], torch.device("cpu")
    )
    with torch.no_grad():
        first = model(batch)
        second = model(batch)
    assert first.shape == (11, 32) and torch.isfinite(first.float()).all()
    assert torch.equal(first, second)
    for name, t in model.state_dict().items():
        assert torch.equal(t, weights[name]), name
