"""logit_bias in the sampler: added to the logits before penalties, temperature and the filters,
per row of a batch; and its checks in SamplingParams. Tiny vocabularies; milliseconds each."""

from __future__ import annotations

import pytest
import torch

from model_server.layers.sampler import Sampler
from model_server.sampling_params import InvalidParamError, SamplingParams
from tests.layers.test_sampler import make_req, sample

LOGITS = torch.tensor([1.0, 5.0, 3.0, 2.0, 0.5])  # argmax 1, then 2


def test_plus_100_forces_a_token_and_minus_100_bans_the_greedy_one() -> None:
    logits = LOGITS.repeat(3, 1)
    reqs = [
        make_req("forced", temperature=0.0, logit_bias={4: 100.0}),
        make_req("banned", temperature=0.0, logit_bias={1: -100.0}),
        make_req("plain", temperature=0.0),
    ]
    out = sample(logits.clone(), reqs)
    assert out.sampled_token_ids.tolist() == [4, 2, 1]


def test_bias_applies_before_temperature_top_k_and_penalties() -> None:
    # A high temperature flattens the distribution, top_k=1 keeps the single best token and a
    # repetition penalty pushes token 0 (in the prompt) down: the bias still decides, because it
    # comes first and +100 dwarfs the rest.
    logits = LOGITS.repeat(64, 1)
    reqs = [
        make_req(f"r{i}", prompt=(0,), temperature=5.0, top_k=1, repetition_penalty=2.0,
                 seed=i, logit_bias={0: 100.0})
        for i in range(64)
    ]  # fmt: skip
    out = sample(logits, reqs)
    assert out.sampled_token_ids.tolist() == [0] * 64


def test_mixed_batch_leaves_unbiased_rows_and_the_input_alone() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    given = logits.clone()
    expected = logits.argmax(-1).tolist()
    reqs = [
        make_req("a", temperature=0.0),
        make_req("b", temperature=0.0, logit_bias={7: 100.0, 8: 3.0}),
        make_req("c", temperature=0.0, logprobs=2),
        make_req("d", temperature=0.0, logit_bias={expected[3]: -100.0}),
    ]
    out = sample(logits, reqs)
    got = out.sampled_token_ids.tolist()
    assert got[0] == expected[0] and got[2] == expected[2]
    assert got[1] == 7
    assert got[3] != expected[3]
    assert torch.equal(logits, given)  # biased copies, never the caller's logits
    # Logprobs are the model's own distribution, as vLLM returns them (before any processing).
    assert out.logprobs is not None
    assert out.logprobs[2].item() == pytest.approx(given[2].log_softmax(-1).max().item())


def test_no_bias_tensors_without_a_bias() -> None:
    md = Sampler("cpu").build_metadata([make_req(temperature=0.0)], 5)
    assert md.logit_bias_rows is None and md.logit_bias_values is None
    md = Sampler("cpu").build_metadata(
        [make_req("a", temperature=0.0), make_req("b", logit_bias={3: -1.5, 1: 2.0})], 5
    )
    assert md.logit_bias_rows.tolist() == [1, 1]
    assert sorted(
        zip(md.logit_bias_token_ids.tolist(), md.logit_bias_values.tolist(), strict=True)
    ) == [
        (1, 2.0),
        (3, -1.5),
    ]


@pytest.mark.parametrize(
    ("bias", "match"),
    [
        ({1: 100.5}, r"logit_bias values must be in \[-100, 100\], got 100.5 for token 1"),
        ({1: -101.0}, "got -101.0 for token 1"),
        ({1: float("nan")}, "got nan"),
        ({-1: 1.0}, "logit_bias keys must be token ids"),
    ],
)
def test_out_of_range_values_and_keys_name_logit_bias(bias: dict, match: str) -> None:
    with pytest.raises(InvalidParamError, match=match) as info:
        SamplingParams(logit_bias=bias)
    assert info.value.param == "logit_bias"


def test_vocabulary_check() -> None:
    params = SamplingParams(logit_bias={4: 1.0, 5: 1.0})
    with pytest.raises(InvalidParamError, match=r"token id 5 is out of range.*\(0-4\)"):
        params.check_vocabulary(5)
    params.check_vocabulary(6)
    assert SamplingParams(logit_bias={}).logit_bias is None
