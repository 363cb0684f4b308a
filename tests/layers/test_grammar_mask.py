"""Grammar bitmasks in the sampler: forbidden tokens never sampled on the constrained rows, the
other rows' logits and tokens untouched bit for bit; the CPU kernel and the portable ops agree."""

from __future__ import annotations

import pytest
import torch

from model_server.layers.sampler import Sampler
from model_server.layers.sampling.grammar_mask import apply_grammar_bitmask, unpack_bitmask
from model_server.sampling_params import SamplingParams

V = 100


def bitmask_allowing(allowed: list[list[int]], vocab: int = V) -> torch.Tensor:
    words = -(-vocab // 32)
    mask = torch.zeros((len(allowed), words), dtype=torch.int32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            word = int(mask[row, t // 32]) & 0xFFFFFFFF
            word |= 1 << (t % 32)
            mask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    return mask


def test_unpack_reads_every_bit_including_the_sign_bit() -> None:
    mask = bitmask_allowing([[0, 31, 63, 64, 99]])
    allowed = unpack_bitmask(mask, V)
    assert allowed.shape == (1, V)
    assert torch.nonzero(allowed[0]).flatten().tolist() == [0, 31, 63, 64, 99]


def _full(rows: list[int], allowed: list[list[int]], batch: int) -> torch.Tensor:
    """A [batch, W] bitmask with `rows` allowing `allowed` (other rows left all-forbidding: the
    mask must never read them)."""
    full = torch.zeros((batch, -(-V // 32)), dtype=torch.int32)
    full[rows] = bitmask_allowing(allowed)
    return full


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # CPU kernel, portable ops
def test_only_constrained_rows_change(dtype: torch.dtype) -> None:
    logits = torch.randn(4, V, dtype=dtype)
    before = logits.clone()
    out = apply_grammar_bitmask(logits, torch.tensor([1, 3]), _full([1, 3], [[5, 7], [42]], 4))
    assert out is logits  # in place
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [5, 7]
    assert torch.isfinite(out[3]).nonzero().flatten().tolist() == [42]
    assert torch.equal(out[1, [5, 7]], before[1, [5, 7]])


class _Req:
    def __init__(self, rid: str, params: SamplingParams) -> None:
        self.request_id = rid
        self.sampling_params = params
        self.sample_index = 0
        self.eos_token_id = None
        self.prompt_token_ids = [1, 2]
        self.output_token_ids: list[int] = []

    @property
    def num_output_tokens(self) -> int:
        return 0


def test_sampler_respects_masks_and_leaves_free_rows_alone() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    reqs = [
        _Req("greedy-free", SamplingParams(temperature=0)),
        _Req("greedy-masked", SamplingParams(temperature=0)),
        _Req("random-masked", SamplingParams(temperature=1.0, top_k=5, seed=1)),
    ]
    sampler = Sampler("cpu")
    free = sampler(logits, sampler.build_metadata(reqs, V)).sampled_token_ids
    allowed = [[3, 9], [11, 12, 13]]
    masked_sampler = Sampler("cpu")
    md = masked_sampler.build_metadata(reqs, V, ([1, 2], _full([1, 2], allowed, 3)))
    for _ in range(20):
        out = masked_sampler(logits.clone(), md).sampled_token_ids.tolist()
        assert out[0] == int(free[0])
        assert out[1] == max(allowed[0], key=lambda t: float(logits[1, t]))
        assert out[2] in allowed[1]
