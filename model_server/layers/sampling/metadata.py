"""Per-step sampling metadata: the batch's SamplingParams turned into tensors on the device.

Built once per step on the host from plain Python values (no device reads), then copied to the
device in a handful of small transfers. A tensor is `None` when no row uses that feature, so the
sampler skips the work entirely (the common all-defaults batch does only argmax or one softmax).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from model_server.sampling_params import SamplingParams


class SamplingRequest(Protocol):
    """What sampling reads of a request (the engine's `Request` has all of it).

    Layers sit below the engine, so they name this shape instead of importing the engine's class.
    """

    @property
    def request_id(self) -> str: ...
    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def sample_index(self) -> int: ...  # added to the seed (n > 1 siblings differ)
    @property
    def eos_token_id(self) -> int | None: ...
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def output_token_ids(self) -> Sequence[int]: ...
    @property
    def num_output_tokens(self) -> int: ...


@dataclass(slots=True)
class SamplingMetadata:
    """Batched sampling inputs; row i describes `requests[i]` of the step.

    Neutral values fill the rows that do not use a feature (temperature 1.0, top_p 1.0,
    top_k = vocab_size, min_p 0.0, penalties 1.0 / 0.0), so every op is a no-op on those rows.
    Greedy rows also hold neutral temperature/top-k/top-p/min-p: their sample is the argmax,
    taken before any of those apply.
    """

    num_reqs: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    # [B] bool, True on greedy rows; only set when the batch mixes greedy and random rows.
    greedy_mask: torch.Tensor | None
    # [B] float32, strictly positive (greedy rows hold 1.0).
    temperature: torch.Tensor | None
    # [B] float32 in (0, 1].
    top_p: torch.Tensor | None
    # [B] int64 in [1, vocab_size]; vocab_size means "off".
    top_k: torch.Tensor | None
    # Host copy of the largest top_k below vocab_size, so `torch.topk` needs no device read.
    max_top_k: int
    # Every random row has top-k on: sampling then only looks at the top `max_top_k` logits.
    all_top_k: bool
    # Every random row has top-k or top-p < 1: no row needs the whole vocabulary's tail.
    all_truncated: bool
    # [B] float32 in [0, 1].
    min_p: torch.Tensor | None
    # [B] float32 each; penalties are applied only when at least one is set.
    repetition_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    # [B, Lp] int64 prompt token ids padded with `vocab_size`; set only when some row has a
    # repetition penalty (rows without one are left all padding).
    prompt_token_ids: torch.Tensor | None
    # [B, L] int64 padded with `vocab_size`: the ids the repetition penalty sees, set (and
    # `prompt_token_ids` left None) only when some penalized row has a `repeat_last_n` window:
    # the window's ids on those rows, prompt + output on the other penalized ones.
    repetition_token_ids: torch.Tensor | None
    # [B, Lo] int64 output token ids padded with `vocab_size`; set only when some row has a
    # penalty (rows without any penalty are left all padding).
    output_token_ids: torch.Tensor | None
    # [M] int64 each: logits[min_tokens_rows[j], min_tokens_token_ids[j]] is set to -inf, the
    # stop tokens of rows that have not yet produced `min_tokens` tokens.
    min_tokens_rows: torch.Tensor | None
    min_tokens_token_ids: torch.Tensor | None
    # [K] int64, int64, float32: logits[logit_bias_rows[j], logit_bias_token_ids[j]] +=
    # logit_bias_values[j], every (row, token) pair of the rows' `logit_bias`; None when no row
    # has one.
    logit_bias_rows: torch.Tensor | None = None
    logit_bias_token_ids: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None
    # Row -> generator for seeded random rows (greedy rows never draw noise).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Largest `logprobs` asked by any row; None when no row asked for logprobs.
    max_num_logprobs: int | None = None
    # [R] int64 rows with a grammar, and the [B, ceil(V / 32)] int32 token bitmask whose rows
    # `grammar_rows` are filled (grammar_mask.py); None when no row is constrained, so free
    # batches pay nothing.
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None


def build_sampling_metadata(
    requests: Sequence[SamplingRequest],
    vocab_size: int,
    device: torch.device,
    get_generator: Callable[[SamplingRequest], torch.Generator],
    grammar_bitmask: tuple[list[int], torch.Tensor] | None = None,
) -> SamplingMetadata:
    """Turns the step's requests (one row each, in order) into a SamplingMetadata on `device`.

    `get_generator(request)` is called only for seeded random rows and must return that
    request's persistent generator. `grammar_bitmask` is (rows with a grammar, [B, W] int32
    bitmask with those rows filled) (structured_output/bitmask.py), or None.
    """
    num_reqs = len(requests)
    greedy = [r.sampling_params.greedy for r in requests]
    num_greedy = sum(greedy)

    temperature: list[float] = []
    top_p: list[float] = []
    top_k: list[int] = []
    min_p: list[float] = []
    generators: dict[int, torch.Generator] = {}
    # Random rows that never need the vocabulary's tail (top-k on or top-p < 1).
    num_truncated = 0
    for i, req in enumerate(requests):
        sp = req.sampling_params
        if greedy[i]:
            temperature.append(1.0)
            top_p.append(1.0)
            top_k.append(vocab_size)
            min_p.append(0.0)
            continue
        temperature.append(sp.temperature)
        top_p.append(sp.top_p)
        top_k.append(min(sp.top_k, vocab_size) if sp.top_k > 0 else vocab_size)
        min_p.append(sp.min_p)
        num_truncated += top_k[-1] < vocab_size or sp.top_p < 1.0
        if sp.seed is not None:
            generators[i] = get_generator(req)

    def floats(values: list[float], neutral: float) -> torch.Tensor | None:
        if all(v == neutral for v in values):
            return None
        return torch.tensor(values, dtype=torch.float32, device=device)

    active_top_k = [k for k in top_k if k < vocab_size]

    rep = [r.sampling_params.repetition_penalty for r in requests]
    pres = [r.sampling_params.presence_penalty for r in requests]
    freq = [r.sampling_params.frequency_penalty for r in requests]
    repetition_penalty = floats(rep, 1.0)
    presence_penalty = floats(pres, 0.0)
    frequency_penalty = floats(freq, 0.0)

    prompt_token_ids = output_token_ids = repetition_token_ids = None
    windowed = repetition_penalty is not None and any(
        r.sampling_params.repeat_last_n > 0 and r.sampling_params.repetition_penalty != 1.0
        for r in requests
    )
    if windowed:
        repetition_token_ids = _pad([_repetition_window(r) for r in requests], vocab_size, device)
    elif repetition_penalty is not None:
        prompt_token_ids = _pad(
            [
                r.prompt_token_ids if r.sampling_params.repetition_penalty != 1.0 else []
                for r in requests
            ],
            vocab_size,
            device,
        )
    any_penalty = any(
        t is not None for t in (repetition_penalty, presence_penalty, frequency_penalty)
    )
    if any_penalty:
        output_token_ids = _pad(
            [r.output_token_ids if r.sampling_params.needs_penalties else [] for r in requests],
            vocab_size,
            device,
        )

    mask_rows: list[int] = []
    mask_ids: list[int] = []
    for i, req in enumerate(requests):
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            continue
        stop_ids = set(sp.stop_token_ids)
        if not sp.ignore_eos and req.eos_token_id is not None:
            stop_ids.add(req.eos_token_id)
        for t in sorted(stop_ids):
            if t < vocab_size:
                mask_rows.append(i)
                mask_ids.append(t)

    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    for i, req in enumerate(requests):
        for token, bias in (req.sampling_params.logit_bias or {}).items():
            bias_rows.append(i)
            bias_ids.append(token)
            bias_values.append(bias)

    logprobs = [r.sampling_params.logprobs for r in requests]
    asked = [k for k in logprobs if k is not None]

    return SamplingMetadata(
        num_reqs=num_reqs,
        vocab_size=vocab_size,
        all_greedy=num_greedy == num_reqs,
        all_random=num_greedy == 0,
        greedy_mask=(
            torch.tensor(greedy, dtype=torch.bool, device=device)
            if 0 < num_greedy < num_reqs
            else None
        ),
        temperature=floats(temperature, 1.0),
        top_p=floats(top_p, 1.0),
        top_k=(torch.tensor(top_k, dtype=torch.int64, device=device) if active_top_k else None),
        max_top_k=max(active_top_k, default=0),
        all_top_k=bool(active_top_k) and len(active_top_k) == num_reqs - num_greedy,
        all_truncated=num_greedy < num_reqs and num_truncated == num_reqs - num_greedy,
        min_p=floats(min_p, 0.0),
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        prompt_token_ids=prompt_token_ids,
        repetition_token_ids=repetition_token_ids,
        output_token_ids=output_token_ids,
        min_tokens_rows=(
            torch.tensor(mask_rows, dtype=torch.int64, device=device) if mask_rows else None
        ),
        min_tokens_token_ids=(
            torch.tensor(mask_ids, dtype=torch.int64, device=device) if mask_rows else None
        ),
        logit_bias_rows=(
            torch.tensor(bias_rows, dtype=torch.int64, device=device) if bias_rows else None
        ),
        logit_bias_token_ids=(
            torch.tensor(bias_ids, dtype=torch.int64, device=device) if bias_rows else None
        ),
        logit_bias_values=(
            torch.tensor(bias_values, dtype=torch.float32, device=device) if bias_rows else None
        ),
        generators=generators,
        max_num_logprobs=max(asked) if asked else None,
        grammar_rows=(
            torch.tensor(grammar_bitmask[0], dtype=torch.int64, device=device)
            if grammar_bitmask is not None
            else None
        ),
        grammar_bitmask=(
            grammar_bitmask[1].to(device, non_blocking=True)
            if grammar_bitmask is not None
            else None
        ),
    )


def _repetition_window(request: SamplingRequest) -> Sequence[int]:
    """The ids a row's repetition penalty sees: the last `repeat_last_n` of prompt + output
    (all of them for 0), none without a penalty."""
    sp = request.sampling_params
    if sp.repetition_penalty == 1.0:
        return []
    n = sp.repeat_last_n
    output = list(request.output_token_ids)
    if n == 0:
        return [*request.prompt_token_ids, *output]
    if n <= len(output):
        return output[len(output) - n :]
    prompt = request.prompt_token_ids
    return [*prompt[max(0, len(prompt) - (n - len(output))) :], *output]


def _pad(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[len(rows), max_len] int64, each row right-padded with `pad`."""
    width = max((len(r) for r in rows), default=0)
    padded = [list(r) + [pad] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(rows), width)
