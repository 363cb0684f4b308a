"""candle-vllm's repeat_last_n: the repetition penalty sees only the last N tokens of prompt +
output, row by row in one batch; checked against a per-row reference in plain Python."""

from __future__ import annotations

import random

import pytest
import torch

from model_server.engine.core.request import Request
from model_server.layers.sampler import Sampler
from model_server.layers.sampling.penalties import apply_penalties
from model_server.sampling_params import SamplingParams

VOCAB = 50


def make_req(rid: str, prompt: list[int], output: list[int], **params: object) -> Request:
    req = Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(temperature=0.0, **params),
        eos_token_id=None,
    )
    for t in output:
        req.append_output_token(t)
    return req


def reference(logits: list[float], req: Request) -> list[float]:
    """HF's repetition penalty over the window, then OpenAI's frequency/presence (output)."""
    sp = req.sampling_params
    seq = [*req.prompt_token_ids, *req.output_token_ids]
    window = seq[-sp.repeat_last_n :] if sp.repeat_last_n else seq
    out = list(logits)
    if sp.repetition_penalty != 1.0:
        for t in set(window):
            x = out[t]
            out[t] = x / sp.repetition_penalty if x > 0 else x * sp.repetition_penalty
    for t in set(req.output_token_ids):
        count = list(req.output_token_ids).count(t)
        out[t] -= sp.frequency_penalty * count + sp.presence_penalty * (count > 0)
    return out


def penalized(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    md = Sampler("cpu").build_metadata(reqs, VOCAB)
    assert md.output_token_ids is not None
    return apply_penalties(
        logits,
        md.prompt_token_ids,
        md.output_token_ids,
        md.repetition_penalty,
        md.presence_penalty,
        md.frequency_penalty,
        repetition_token_ids=md.repetition_token_ids,
    )


def test_window_matches_the_reference_row_by_row() -> None:
    rng = random.Random(0)
    rows = [
        # (prompt len, output len, repeat_last_n, penalty, frequency)
        (12, 6, 3, 1.5, 0.0),  # the window is inside the output
        (12, 6, 10, 1.5, 0.0),  # it reaches back into the prompt
        (5, 3, 64, 2.0, 0.0),  # longer than the sequence: all of it
        (9, 0, 4, 1.3, 0.0),  # no output yet: the prompt's tail
        (10, 7, 0, 1.7, 0.0),  # 0: the whole sequence (vLLM's behaviour)
        (10, 7, 2, 1.0, 0.5),  # no repetition penalty, frequency over the whole output
        (10, 7, 2, 1.4, 0.3),  # window and frequency penalty together
        (8, 4, 0, 1.0, 0.0),  # no penalty at all
    ]
    reqs = []
    for i, (lp, lo, n, rep, freq) in enumerate(rows):
        prompt = [rng.randrange(VOCAB) for _ in range(lp)]
        output = [rng.randrange(VOCAB) for _ in range(lo)]
        reqs.append(
            make_req(
                f"r{i}", prompt, output, repetition_penalty=rep, repeat_last_n=n,
                frequency_penalty=freq,
            )
        )  # fmt: skip
    logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    got = penalized(logits, reqs)
    expected = torch.tensor([reference(logits[i].tolist(), r) for i, r in enumerate(reqs)])
    torch.testing.assert_close(got, expected)
    # The window really narrows what is penalized: row 0 leaves an early prompt token alone.
    early = [t for t in reqs[0].prompt_token_ids if t not in list(reqs[0].output_token_ids)[-3:]]
    assert early and all(got[0, t] == logits[0, t] for t in early)


def test_without_a_window_the_batch_takes_the_prompt_plus_output_path() -> None:
    reqs = [make_req("a", [1, 2, 3], [4], repetition_penalty=1.2)]
    md = Sampler("cpu").build_metadata(reqs, VOCAB)
    assert md.repetition_token_ids is None and md.prompt_token_ids is not None
    windowed = [make_req("a", [1, 2, 3], [4], repetition_penalty=1.2, repeat_last_n=2)]
    md = Sampler("cpu").build_metadata(windowed, VOCAB)
    assert md.prompt_token_ids is None
    assert md.repetition_token_ids is not None and md.repetition_token_ids.tolist() == [[3, 4]]


def test_greedy_sampling_follows_the_window() -> None:
    # Token 7 leads but was seen 5 tokens back: a window of 3 leaves it, a window of 6 sees it.
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 2.0
    logits[:, 8] = 1.5
    reqs = [
        make_req(f"w{n}", [7, 1, 2], [3, 4], repetition_penalty=2.0, repeat_last_n=n)
        for n in (3, 6)
    ]
    sampler = Sampler("cpu")
    out = sampler(logits, sampler.build_metadata(reqs, VOCAB))
    assert out.sampled_token_ids.tolist() == [7, 8]


def test_negative_window_is_refused() -> None:
    with pytest.raises(ValueError, match="repeat_last_n must be non-negative"):
        SamplingParams(repeat_last_n=-1)
