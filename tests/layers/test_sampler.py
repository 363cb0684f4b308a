"""Sampler: each parameter's effect, exact where the math allows, statistical (fixed seeds,
generous tolerances) where sampling is the point. Tiny vocabularies; milliseconds each."""

from __future__ import annotations

import math

import pytest
import torch

from model_server.engine.core.request import Request
from model_server.layers.sampler import Sampler, SamplerOutput, SamplingMetadata, generator_seed
from model_server.layers.sampling.ops import Candidates, select_candidates
from model_server.layers.sampling.penalties import apply_penalties
from model_server.sampling_params import SamplingParams

NEG_INF = float("-inf")


def make_req(
    rid: str = "r",
    prompt: tuple[int, ...] = (1, 2),
    output: tuple[int, ...] = (),
    eos: int | None = None,
    sample_index: int = 0,
    **params: object,
) -> Request:
    req = Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(**params),
        eos_token_id=eos,
        sample_index=sample_index,
    )
    for t in output:
        req.append_output_token(t)
    return req


def sample(
    logits: torch.Tensor, reqs: list[Request], sampler: Sampler | None = None
) -> SamplerOutput:
    sampler = sampler or Sampler("cpu")
    md = sampler.build_metadata(reqs, logits.shape[-1])
    return sampler(logits, md)


def probs_logits(probs: list[float]) -> torch.Tensor:
    """[V] logits whose softmax is `probs` (zeros become -inf)."""
    return torch.tensor([math.log(p) if p > 0 else NEG_INF for p in probs])


def frequencies(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab_size).float() / tokens.numel()


def filtered(
    logits: torch.Tensor,
    *,
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    min_p: list[float] | None = None,
    temperature: list[float] | None = None,
    all_top_k: bool | None = None,
    all_truncated: bool = False,
) -> Candidates:
    """select_candidates on [B, V] logits with per-row lists (None = feature off)."""
    vocab = logits.shape[-1]
    k = None if top_k is None else torch.tensor([x if x > 0 else vocab for x in top_k])
    active = [x for x in (top_k or []) if 0 < x < vocab]
    return select_candidates(
        logits,
        None if temperature is None else torch.tensor(temperature),
        k,
        None if top_p is None else torch.tensor(top_p),
        None if min_p is None else torch.tensor(min_p),
        max(active, default=0),
        len(active) == logits.shape[0] if all_top_k is None else all_top_k,
        all_truncated,
    )


def kept(c: Candidates, row: int = 0) -> set[int]:
    """Token ids with non-zero weight in a row of the candidates."""
    cols = (c.weights[row] > 0).nonzero().squeeze(1)
    ids = cols if c.token_ids is None else c.token_ids[row, cols]
    return set(ids.tolist())


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# ---------------------------------------------------------------- metadata


def test_defaults_build_no_optional_tensors() -> None:
    md = Sampler("cpu").build_metadata([make_req("a"), make_req("b")], 16)
    assert isinstance(md, SamplingMetadata)
    assert (md.all_greedy, md.all_random, md.greedy_mask) == (False, True, None)
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "prompt_token_ids",
        "output_token_ids",
        "min_tokens_rows",
    ):
        assert getattr(md, name) is None, name
    assert md.generators == {} and md.max_num_logprobs is None


def test_greedy_rows_do_not_enable_random_features() -> None:
    reqs = [make_req("g", temperature=0.0, top_k=3, top_p=0.5, seed=1), make_req("r")]
    md = Sampler("cpu").build_metadata(reqs, 16)
    assert md.top_k is None and md.top_p is None and md.temperature is None
    assert md.generators == {}
    assert md.greedy_mask is not None and md.greedy_mask.tolist() == [True, False]


def test_layout_flags_ignore_greedy_rows() -> None:
    def flags(*reqs: Request) -> tuple[bool, bool, int]:
        md = Sampler("cpu").build_metadata(list(reqs), 16)
        return md.all_top_k, md.all_truncated, md.max_top_k

    greedy = make_req("g", temperature=0.0)
    assert flags(greedy, make_req("a", top_k=3), make_req("b", top_k=99)) == (False, False, 3)
    assert flags(greedy, make_req("a", top_k=3), make_req("b", top_k=5)) == (True, True, 5)
    assert flags(greedy, make_req("a", top_k=3), make_req("b", top_p=0.9)) == (False, True, 3)
    assert flags(greedy, make_req("a", top_p=0.9), make_req("b")) == (False, False, 0)
    assert flags(greedy) == (False, False, 0)


def test_shape_mismatch_raises() -> None:
    sampler = Sampler("cpu")
    md = sampler.build_metadata([make_req()], 16)
    with pytest.raises(ValueError):
        sampler(torch.zeros(1, 17), md)


# ---------------------------------------------------------------- greedy / temperature


def test_greedy_is_argmax_with_ties_to_lowest_id() -> None:
    logits = torch.randn(4, 16)
    logits[3] = 0.0
    logits[3, 5] = logits[3, 9] = 1.0
    out = sample(logits, [make_req(str(i), temperature=0.0) for i in range(4)])
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.sampled_token_ids[3].item() == 5
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_takes_the_tables_argmax_on_the_logits_as_given() -> None:
    """An all-greedy batch with nothing to apply hands bf16 logits to the kernel table's argmax
    as they are (no float32 copy); a batch that must upcast (logprobs, a penalty) passes the
    float32 logits; both answer what the float32 argmax would."""
    seen: list[torch.dtype] = []

    def argmax(logits: torch.Tensor) -> torch.Tensor:
        seen.append(logits.dtype)
        return logits.argmax(dim=-1)

    sampler = Sampler("cpu", argmax=argmax)
    logits = (torch.randn(3, 40) * 4).bfloat16()
    logits[1, 7] = logits[1, 30] = 100.0  # a tie: the lowest id
    want = logits.float().argmax(dim=-1).tolist()
    greedy = [make_req(str(i), temperature=0.0) for i in range(3)]
    assert sample(logits, greedy, sampler).sampled_token_ids.tolist() == want
    assert seen == [torch.bfloat16] and want[1] == 7
    with_logprobs = [make_req(str(i), temperature=0.0, logprobs=1) for i in range(3)]
    assert sample(logits, with_logprobs, sampler).sampled_token_ids.tolist() == want
    penalized = [make_req(str(i), temperature=0.0, presence_penalty=0.0001) for i in range(3)]
    sample(logits, penalized, sampler)
    assert seen == [torch.bfloat16, torch.float32, torch.float32]


def test_input_logits_not_modified() -> None:
    logits = torch.randn(2, 16)
    before = logits.clone()
    reqs = [
        make_req("a", output=(3,), eos=1, min_tokens=4, repetition_penalty=1.3, top_k=4),
        make_req("b", temperature=0.5, top_p=0.5, min_p=0.1, frequency_penalty=1.0),
    ]
    sample(logits, reqs)
    assert torch.equal(logits, before)


def test_tiny_temperature_equals_greedy() -> None:
    logits = torch.randn(64, 32)
    reqs = [make_req(str(i), temperature=1e-3) for i in range(64)]
    assert torch.equal(sample(logits, reqs).sampled_token_ids, logits.argmax(-1))


@pytest.mark.parametrize(("temperature", "p0"), [(1.0, 0.8), (2.0, 2 / 3), (0.5, 16 / 17)])
def test_temperature_sharpens_or_flattens(temperature: float, p0: float) -> None:
    # p = [0.8, 0.2] at T=1; softmax(logits / T) gives p0 for token 0.
    n = 2000
    logits = probs_logits([0.8, 0.2, 0.0, 0.0]).expand(n, 4)
    reqs = [make_req(str(i), temperature=temperature) for i in range(n)]
    freq = frequencies(sample(logits, reqs).sampled_token_ids, 4)
    assert freq[0].item() == pytest.approx(p0, abs=0.04)
    assert freq[2:].sum().item() == 0.0


def test_exponential_race_matches_distribution() -> None:
    n, probs = 3000, [0.5, 0.3, 0.15, 0.05]
    logits = probs_logits(probs).expand(n, 4)
    freq = frequencies(sample(logits, [make_req(str(i)) for i in range(n)]).sampled_token_ids, 4)
    assert freq.tolist() == pytest.approx(probs, abs=0.035)


# ---------------------------------------------------------------- top-k / top-p / min-p


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(32, 16)
    reqs = [make_req(str(i), top_k=1, temperature=1.5) for i in range(32)]
    assert torch.equal(sample(logits, reqs).sampled_token_ids, logits.argmax(-1))


@pytest.mark.parametrize("with_top_p", [False, True])  # topk-only path vs the sort path
def test_top_k_never_samples_outside_top_k(with_top_p: bool) -> None:
    n, vocab = 300, 16
    # Nearly flat distinct logits: without top-k every token is likely to show up.
    logits = (torch.randperm(vocab).float() * 0.01).expand(n, vocab)
    ks = [3, 0, 5, 100]  # 0 = off, 100 > vocab = off
    top_p = 0.999 if with_top_p else 1.0
    reqs = [make_req(str(i), top_k=ks[i % 4], top_p=top_p) for i in range(n)]
    tokens = sample(logits, reqs).sampled_token_ids
    order = logits[0].argsort(descending=True).tolist()
    for i, k in enumerate(ks):
        got = set(tokens[i::4].tolist())
        if k in (3, 5):
            assert got <= set(order[:k])
            assert len(got) == k  # 75 draws from k near-uniform tokens cover all
        else:
            assert not got <= set(order[:5])


def test_top_k_candidates_are_exact() -> None:
    logits = torch.tensor([[0.25, 0.5, 0.375, 1.0, 0.125], [0.4, 0.3, 0.2, 0.1, 0.0]])
    # Row 1 without top-k: whole-vocabulary layout.
    c = filtered(logits, top_k=[2, 0])
    assert c.token_ids is None
    assert (kept(c, 0), kept(c, 1)) == ({1, 3}, {0, 1, 2, 3, 4})
    assert c.weights[0].tolist() == pytest.approx([0, math.exp(-0.5), 0, 1, 0])
    # Every row with top-k: only the top max_top_k = 3 columns.
    c = filtered(logits, top_k=[2, 3])
    assert c.token_ids is not None and c.token_ids.shape == (2, 3)
    assert (kept(c, 0), kept(c, 1)) == ({1, 3}, {0, 1, 2})
    assert c.weights[:, 0].tolist() == [1.0, 1.0]  # top token weight is exactly 1


@pytest.mark.parametrize(
    ("top_p", "nucleus"), [(0.4, {0}), (0.7, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})]
)
def test_top_p_restricts_to_nucleus(top_p: float, nucleus: set[int]) -> None:
    # Cumulative mass 0.5, 0.8, 0.95, 1.0 in this (shuffled) order: [2, 0, 3, 1].
    perm = [2, 0, 3, 1]
    probs = [0.0] * 4
    for rank, p in zip(perm, [0.5, 0.3, 0.15, 0.05], strict=True):
        probs[rank] = p
    logits = probs_logits(probs).unsqueeze(0)
    expected = {perm[i] for i in nucleus}
    assert kept(filtered(logits, top_p=[top_p])) == expected  # sort layout
    assert kept(filtered(logits, top_p=[top_p], top_k=[3])) == expected - {perm[3]}  # topk
    n = 400
    reqs = [make_req(str(i), top_p=top_p) for i in range(n)]
    assert set(sample(logits.expand(n, 4), reqs).sampled_token_ids.tolist()) == expected


@pytest.mark.parametrize("truncated", [False, True])  # vocabulary vs nucleus layout
def test_top_p_large_nucleus_falls_back_to_a_sort(truncated: bool) -> None:
    # A nucleus of ~1900 tokens does not fit the capped columns: the exact result needs a sort.
    vocab = 2048
    logits = torch.linspace(1.0, 0.0, vocab).unsqueeze(0)  # token 0 most likely
    probs = logits.softmax(-1)[0]
    cum = probs.cumsum(0)
    expected_size = int((cum - probs < 0.93).sum())
    assert expected_size > 1024
    c = filtered(logits, top_p=[0.93], all_truncated=truncated)
    assert kept(c) == set(range(expected_size))
    assert (c.token_ids is None) == (not truncated)


def test_nucleus_layout_when_every_row_is_truncated() -> None:
    logits = probs_logits([0.5, 0.3, 0.15, 0.05]).unsqueeze(0).expand(3, 4)
    c = filtered(logits, top_p=[0.7, 0.85, 1.0], top_k=[0, 0, 2], all_truncated=True)
    assert c.token_ids is not None  # only the capped columns, sorted descending
    assert [kept(c, i) for i in range(3)] == [{0, 1}, {0, 1, 2}, {0, 1}]
    c = filtered(logits, top_p=[0.7, 0.85, 1.0], top_k=[0, 0, 2], all_truncated=False)
    assert c.token_ids is None
    assert [kept(c, i) for i in range(3)] == [{0, 1}, {0, 1, 2}, {0, 1}]


def test_top_p_applies_after_top_k_renormalisation() -> None:
    # After top_k=2, [0.5, 0.3] renormalise to [0.625, 0.375]: top_p=0.6 keeps only token 0.
    logits = probs_logits([0.5, 0.3, 0.15, 0.05]).unsqueeze(0).expand(2, 4)
    # Row 1 has no top-k, so both rows go through the whole-vocabulary sort layout.
    c = filtered(logits, top_k=[2, 0], top_p=[0.6, 0.6])
    assert (kept(c, 0), kept(c, 1)) == ({0}, {0, 1})
    assert kept(filtered(logits[:1], top_k=[2], top_p=[0.6])) == {0}


def test_top_p_keeps_at_least_one_token() -> None:
    logits = torch.linspace(0.0, 0.07, 8).unsqueeze(0)  # every token has about 1/8 > top_p
    for truncated in (False, True):
        assert kept(filtered(logits, top_p=[1e-6], all_truncated=truncated)) == {7}
    assert kept(filtered(logits, top_p=[1e-6], top_k=[4])) == {7}
    assert kept(filtered(logits, min_p=[1.0])) == {7}
    # Ties with the last kept weight are kept (threshold semantics).
    assert len(kept(filtered(torch.zeros(1, 8), min_p=[1.0]))) == 8


def test_top_p_one_keeps_tiny_tail() -> None:
    logits = torch.tensor([[0.0, -30.0, -60.0, -90.0]])  # tail far below float rounding
    assert kept(filtered(logits, top_p=[1.0])) == {0, 1, 2, 3}


@pytest.mark.parametrize(("min_p", "expected"), [(0.0, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.7, {0})])
def test_min_p(min_p: float, expected: set[int]) -> None:
    # Threshold min_p * 0.5 against probs [0.5, 0.3, 0.15, 0.05].
    logits = probs_logits([0.5, 0.3, 0.15, 0.05]).unsqueeze(0)
    assert kept(filtered(logits, min_p=[min_p])) == expected
    assert kept(filtered(logits, min_p=[min_p], top_k=[3])) == expected - {3}
    n = 400
    reqs = [make_req(str(i), min_p=min_p) for i in range(n)]
    assert set(sample(logits.expand(n, 4), reqs).sampled_token_ids.tolist()) == expected


def test_min_p_applies_after_temperature() -> None:
    # probs / max: [1, .6, .3, .1] at T=1, their square roots [1, .77, .55, .32] at T=2, so
    # min_p 0.4 keeps tokens {0, 1} at T=1 and {0, 1, 2} at T=2.
    logits = probs_logits([0.5, 0.3, 0.15, 0.05]).unsqueeze(0)
    assert kept(filtered(logits, min_p=[0.4])) == {0, 1}
    assert kept(filtered(logits, min_p=[0.4], temperature=[2.0])) == {0, 1, 2}


# ---------------------------------------------------------------- penalties


def hf_repetition_penalty(
    input_ids: torch.Tensor, scores: torch.Tensor, penalty: float
) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor.__call__, restated."""
    score = torch.gather(scores, 1, input_ids)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return scores.scatter(1, input_ids, score)


def penalized(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    md = Sampler("cpu").build_metadata(reqs, logits.shape[-1])
    assert md.output_token_ids is not None
    return apply_penalties(
        logits,
        md.prompt_token_ids,
        md.output_token_ids,
        md.repetition_penalty,
        md.presence_penalty,
        md.frequency_penalty,
    )


def test_repetition_penalty_matches_hf() -> None:
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.5, 1.0, 0.0, 4.0]])
    req = make_req(prompt=(1, 3, 6), output=(3, 5, 5), repetition_penalty=2.0)
    got = penalized(logits, [req])
    expected = hf_repetition_penalty(torch.tensor([req.all_token_ids]), logits, 2.0)
    assert torch.equal(got, expected)
    assert got[0].tolist() == [2.0, -4.0, 3.0, -2.0, 0.5, 0.5, 0.0, 4.0]


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    req = make_req(prompt=(1,), temperature=0.0, repetition_penalty=2.0)
    assert sample(logits, [req]).sampled_token_ids.tolist() == [2]


def test_presence_and_frequency_penalties_exact() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    req = make_req(prompt=(0, 1), output=(2, 2, 4), presence_penalty=0.25, frequency_penalty=0.5)
    got = penalized(logits, [req])
    # token 2: 1 - 0.5 * 2 - 0.25; token 4: 1 - 0.5 - 0.25; prompt-only tokens 0, 1 untouched.
    assert got[0].tolist() == [1.0, 1.0, -0.25, 1.0, 0.25, 1.0]


def test_negative_presence_penalty_encourages() -> None:
    logits = torch.zeros(1, 4)
    req = make_req(output=(3,), presence_penalty=-1.0)
    assert penalized(logits, [req])[0].tolist() == [0.0, 0.0, 0.0, 1.0]


def test_rows_without_penalties_are_untouched() -> None:
    logits = torch.randn(3, 16)
    reqs = [
        make_req("plain", prompt=(1, 2, 3), output=(4, 5)),
        make_req("rep", prompt=(1, 2, 3), output=(4, 5), repetition_penalty=1.7),
        make_req("freq", prompt=(6, 7), output=(4, 4), frequency_penalty=1.0),
    ]
    got = penalized(logits, reqs)
    assert torch.equal(got[0], logits[0])
    changed = (got != logits).nonzero().tolist()
    assert {tuple(x) for x in changed} == {(1, t) for t in (1, 2, 3, 4, 5)} | {(2, 4)}


def dense_penalties(
    logits: torch.Tensor, reqs: list[Request]
) -> torch.Tensor:  # the textbook [B, V] formulation (vLLM's), row by row
    out = logits.clone()
    for i, r in enumerate(reqs):
        sp = r.sampling_params
        seen = torch.zeros(logits.shape[-1], dtype=torch.bool)
        seen[r.all_token_ids] = True
        penalty = torch.where(seen, sp.repetition_penalty, 1.0)
        row = torch.where(out[i] > 0, out[i] / penalty, out[i] * penalty)
        counts = torch.bincount(
            torch.tensor(r.output_token_ids, dtype=torch.int64), minlength=logits.shape[-1]
        ).float()
        row = row - sp.frequency_penalty * counts
        out[i] = row - sp.presence_penalty * (counts > 0).float()
    return out


def test_penalties_match_dense_reference_on_ragged_batch() -> None:
    vocab = 40
    gen = torch.Generator().manual_seed(3)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, vocab, (n,), generator=gen).tolist())

    reqs = [
        make_req("a", prompt=ids(7), output=ids(12), repetition_penalty=1.3),
        make_req("b", prompt=ids(3), output=(), repetition_penalty=0.7, frequency_penalty=0.4),
        make_req("c", prompt=ids(9), output=ids(5), presence_penalty=-0.6),
        make_req("d", prompt=ids(2), output=ids(20), frequency_penalty=1.1, presence_penalty=0.3),
        make_req("e", prompt=ids(15), output=ids(4)),  # no penalty
        make_req("f", prompt=ids(1), output=(), presence_penalty=2.0),  # nothing to penalize yet
        make_req(
            "g",
            prompt=(5, 5, 5),
            output=(5, 5),
            repetition_penalty=1.9,
            frequency_penalty=0.25,
            presence_penalty=0.5,
        ),
    ]
    logits = torch.randn(len(reqs), vocab, generator=gen) * 3
    assert torch.equal(penalized(logits, reqs), dense_penalties(logits, reqs))


# ---------------------------------------------------------------- min_tokens / ignore_eos


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.4, 5.0, 0.0, 4.0]])

    def greedy_token(**kw: object) -> int:
        return sample(logits, [make_req(eos=5, temperature=0.0, **kw)]).sampled_token_ids.item()

    assert greedy_token(output=(1,), min_tokens=2, stop_token_ids=[7]) == 4
    assert greedy_token(output=(1,), min_tokens=2) == 7  # only eos masked
    assert greedy_token(output=(1, 2), min_tokens=2, stop_token_ids=[7]) == 5  # reached
    assert greedy_token(output=(1,), min_tokens=2, ignore_eos=True) == 5  # eos is no stop token
    assert greedy_token(output=(1,), min_tokens=2, ignore_eos=True, stop_token_ids=[5]) == 7
    assert greedy_token(output=(), min_tokens=2, stop_token_ids=[99]) == 7  # out of vocab: skip


def test_min_tokens_masks_only_its_row_and_also_random_rows() -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0, 20.0]]).expand(3, 4)
    reqs = [
        make_req("a", eos=3, min_tokens=1),
        make_req("b", eos=3, temperature=0.0),
        make_req("c", eos=3, temperature=0.0, min_tokens=1),
    ]
    assert sample(logits, reqs).sampled_token_ids.tolist() == [2, 3, 2]


# ---------------------------------------------------------------- seeds


def seeded_run(
    sampler: Sampler, logits_steps: list[torch.Tensor], reqs: list[Request], row: int
) -> list[int]:
    tokens = []
    for logits in logits_steps:
        out = sampler(logits, sampler.build_metadata(reqs, logits.shape[-1]))
        tokens.append(out.sampled_token_ids[row].item())
    return tokens


SEEDED_PARAMS = [
    {"temperature": 1.3, "top_k": 20},
    {"top_k": 10, "top_p": 0.8},
    {"min_p": 0.05},
    {"top_p": 0.9, "temperature": 0.7},
    {},
]
COMPANIONS = [
    {"top_k": 5},  # with a top-k seeded row: the top-k-only layout
    {"top_p": 0.9},  # whole vocabulary, sorted
    {"min_p": 0.1},  # whole vocabulary, unsorted (unless the seeded row has top_p)
]


@pytest.mark.parametrize("params", SEEDED_PARAMS)
@pytest.mark.parametrize("companion", COMPANIONS)
def test_seed_reproducible_across_samplers_and_batches(
    params: dict[str, object], companion: dict[str, object]
) -> None:
    vocab, steps = 50, 6
    rows = [torch.randn(vocab) for _ in range(steps)]

    alone = [make_req("x", seed=1234, **params)]
    tokens_alone = seeded_run(Sampler("cpu"), [r.unsqueeze(0) for r in rows], alone, 0)
    assert len(set(tokens_alone)) > 1

    # The same request at row 2 among greedy, unseeded and other seeded rows.
    batch = [
        make_req("g", temperature=0.0),
        make_req("u", **companion),
        make_req("x2", seed=1234, **params),
        make_req("s", seed=99, **companion),
    ]
    steps_logits = [
        torch.cat([torch.randn(2, vocab), r.unsqueeze(0), torch.randn(1, vocab)]) for r in rows
    ]
    assert seeded_run(Sampler("cpu"), steps_logits, batch, 2) == tokens_alone


@pytest.mark.parametrize("top_p", [0.6, 0.999])  # nucleus inside / beyond the capped columns
def test_seed_reproducible_across_layouts_with_large_vocab(top_p: float) -> None:
    vocab, steps = 1500, 3
    rows = [torch.randn(vocab) * 2 for _ in range(steps)]
    params = {"seed": 5, "top_p": top_p}
    alone = seeded_run(Sampler("cpu"), [r.unsqueeze(0) for r in rows], [make_req("x", **params)], 0)
    # A default row forces the vocabulary layout.
    batch = [make_req("d"), make_req("x", **params)]
    steps_logits = [torch.stack([torch.randn(vocab), r]) for r in rows]
    assert seeded_run(Sampler("cpu"), steps_logits, batch, 1) == alone


def test_different_seeds_and_sample_indices_differ() -> None:
    vocab = 50
    logits = [torch.zeros(1, vocab) for _ in range(8)]

    def run(seed: int, sample_index: int = 0) -> list[int]:
        req = make_req("x", seed=seed, sample_index=sample_index)
        return seeded_run(Sampler("cpu"), logits, [req], 0)

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert run(1, sample_index=1) != run(1)
    assert run(1, sample_index=1) == run(2, sample_index=0)  # seed + sample_index


def test_seeds_that_differ_only_in_high_bits_sample_differently() -> None:
    # torch's CPU generator keeps a seed's low 32 bits only: without generator_seed these
    # pairs (and -1 against 2**63 - 1) sampled identically.
    logits = [torch.zeros(1, 50) for _ in range(8)]

    def run(seed: int) -> list[int]:
        return seeded_run(Sampler("cpu"), logits, [make_req("x", seed=seed)], 0)

    runs = {seed: run(seed) for seed in (5, 2**32 + 5, 2**40 + 5, -1, 2**32 - 1, 2**63 - 1)}
    assert len({tuple(tokens) for tokens in runs.values()}) == len(runs)
    assert run(2**40 + 5) == runs[2**40 + 5]  # still reproducible
    # Seeds below 2**32 seed the generator as they are; the rest map into 32 bits.
    assert generator_seed(5) == 5 and generator_seed(2**32 - 1) == 2**32 - 1
    assert all(0 <= generator_seed(s) < 2**32 for s in (-(2**63), -1, 2**32, 2**63 - 1))


def test_generator_persists_until_release() -> None:
    sampler = Sampler("cpu")
    logits = torch.zeros(1, 50)
    req = make_req("x", seed=7)
    first = seeded_run(sampler, [logits] * 4, [req], 0)
    assert seeded_run(sampler, [logits] * 4, [req], 0) != first  # continues the stream
    sampler.release("x")
    sampler.release("never-seen")
    assert seeded_run(sampler, [logits] * 4, [req], 0) == first  # starts afresh


def test_mixed_batch_greedy_random_seeded() -> None:
    vocab = 24
    logits = torch.randn(4, vocab)
    reqs = [
        make_req("g1", temperature=0.0),
        make_req("r", top_k=3),
        make_req("s", seed=5, temperature=0.8),
        make_req("g2", temperature=0.0, presence_penalty=1.0, output=(0,)),
    ]
    out = sample(logits, reqs).sampled_token_ids.tolist()
    assert out[0] == logits[0].argmax().item()
    assert out[1] in logits[1].topk(3).indices.tolist()
    assert out[2] == sample(logits[2:3], [make_req("s", seed=5, temperature=0.8)]).sampled_token_ids
    pen = logits[3].clone()
    pen[0] -= 1.0
    assert out[3] == pen.argmax().item()


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_top_sorted() -> None:
    vocab = 20
    logits = torch.randn(3, vocab)
    reqs = [
        make_req("a", logprobs=2, temperature=0.0, output=(4,), repetition_penalty=1.5),
        make_req("b", logprobs=5, temperature=0.3, top_k=4, eos=1, min_tokens=3),
        make_req("c"),  # asked for none: still gets a row
    ]
    out = sample(logits, reqs)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.top_logprobs is not None
    assert out.top_logprob_ids is not None
    assert torch.equal(out.logprobs, raw.gather(1, out.sampled_token_ids[:, None]).squeeze(1))
    assert out.top_logprobs.shape == out.top_logprob_ids.shape == (3, 5)
    assert torch.equal(out.top_logprobs, raw.topk(5).values)
    assert torch.equal(out.top_logprob_ids, raw.topk(5).indices)
    assert torch.equal(raw.gather(1, out.top_logprob_ids), out.top_logprobs)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()


def test_logprobs_zero_gives_sampled_only() -> None:
    out = sample(torch.randn(2, 16), [make_req("a", logprobs=0), make_req("b")])
    assert out.logprobs is not None and out.logprobs.shape == (2,)
    assert out.top_logprobs is not None and out.top_logprobs.shape == (2, 0)
