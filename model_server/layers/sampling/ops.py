"""Random sampling: temperature, top-k, min-p and top-p filters, then the exponential race.

The filters turn logits into "candidates": unnormalised probabilities

    weight = exp(logit / T - max_logit / T)   (0 for dropped tokens)

laid out in one of three ways, picked per batch so that no sort over the vocabulary is needed
in the common cases:
  - top-k layout, when every random row has top-k: the batch's `max_top_k` largest logits per
    row (one `torch.topk`), columns sorted descending;
  - nucleus layout, when every random row has top-k or top-p < 1: the `_TOP_P_CAP` largest
    weights per row, sorted descending (all V, by a sort, when some nucleus does not fit);
  - vocabulary layout otherwise: all V columns in token-id order (top-p then masks the weights
    below the nucleus threshold, found in the capped columns or, failing that, by a full sort).
The nucleus checks cost one device->host read per batch (never one per request), and only for
batches with top-p where some row has no top-k.

Invariants: each row's top token has weight exactly 1 and survives every filter (so every row
keeps >= 1 token); a token's weight and its row's filter decisions are computed by the same
float operations in every layout, and each seeded row's noise is indexed by token id, so a
seeded request samples the same token whichever batch (and so whichever layout) it is in
(up to exact float ties).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NEG_INF = float("-inf")
# Columns looked at for a nucleus before falling back to a sort over the whole vocabulary.
_TOP_P_CAP = 1024


@dataclass(slots=True)
class Candidates:
    # [B, C] float32 unnormalised probabilities, 0 for dropped tokens, 1 for each row's top token.
    weights: torch.Tensor
    # [B, C] int64 token id of each column, or None when the columns are the vocabulary (C == V).
    token_ids: torch.Tensor | None


def select_candidates(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    max_top_k: int,
    all_top_k: bool,
    all_truncated: bool,
) -> Candidates:
    """Applies temperature -> min_p -> top_k -> top_p to [B, V] logits (not modified).

    temperature: [B] > 0; top_k: [B] int64 in [1, V] (V = off); top_p: [B] in (0, 1];
    min_p: [B] in [0, 1]. `max_top_k` is the largest top_k below V; `all_top_k` tells that every
    row that matters (random rows) has top-k, `all_truncated` that each has top-k or top-p < 1.
    min_p and top_k commute (min_p's threshold depends only on the row max, which top-k keeps);
    top_p is taken on the distribution left by both, as in vLLM. Tokens tied with the k-th
    largest logit or the nucleus's last weight may be kept.
    """
    if top_k is not None and all_top_k:
        values, token_ids = logits.topk(max_top_k, dim=-1)  # [B, K], descending
        # Dividing after topk is safe: x -> x / T (T > 0) keeps the order.
        if temperature is not None:
            values = values / temperature.unsqueeze(1)
        kth = values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
        values = values.masked_fill(values < kth, _NEG_INF)
        weights = (values - values[:, :1]).exp_()
        if min_p is not None:
            # p < min_p * p_max  <=>  weight < min_p.
            weights.masked_fill_(weights < min_p.unsqueeze(1), 0.0)
        if top_p is not None:
            keep = _nucleus(weights, weights.cumsum(dim=-1), top_p, total=None)
            weights.masked_fill_(~keep, 0.0)
        return Candidates(weights=weights, token_ids=token_ids)

    values = logits / temperature.unsqueeze(1) if temperature is not None else logits
    if top_k is not None:
        values = _mask_top_k_unsorted(values, top_k, max_top_k)
    weights = (values - values.amax(dim=-1, keepdim=True)).exp_()  # new tensor: safe in place
    if min_p is not None:
        weights.masked_fill_(weights < min_p.unsqueeze(1), 0.0)
    if top_p is None:
        return Candidates(weights=weights, token_ids=None)
    return _apply_top_p_unsorted(weights, top_p, top_k, max_top_k, all_truncated)


def _nucleus(
    sorted_weights: torch.Tensor,
    cum: torch.Tensor,
    top_p: torch.Tensor,
    total: torch.Tensor | None,
) -> torch.Tensor:
    """[B, C] bool: the columns (sorted descending, `cum` their running sum) in each row's
    nucleus. The mass strictly above column j is cum[j] - w[j]; the column is out when that mass
    already reaches top_p of the row's total ([B, 1]; the last running sum when None).
    top_p == 1 keeps everything, even a tail lost to rounding in the running sum."""
    if total is None:
        total = cum[:, -1:]
    keep = (cum - sorted_weights) < top_p.unsqueeze(1) * total
    return keep | (top_p >= 1.0).unsqueeze(1)


def _apply_top_p_unsorted(
    weights: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor | None,
    max_top_k: int,
    all_truncated: bool,
) -> Candidates:
    """top-p on [B, V] weights in token-id order (consumed): the nucleus or vocabulary layout."""
    num_rows, vocab_size = weights.shape
    has_top_k = (
        top_k < vocab_size
        if top_k is not None
        else torch.zeros(num_rows, dtype=torch.bool, device=weights.device)
    )
    full_total = weights.sum(dim=-1, keepdim=True)
    cap = min(vocab_size, max(_TOP_P_CAP, max_top_k))
    while True:
        if cap < vocab_size:
            top_w, top_ids = weights.topk(cap, dim=-1)  # [B, cap], descending
        else:
            top_w, top_ids = weights.sort(dim=-1, descending=True)
        cum = top_w.cumsum(dim=-1)
        # A top-k row's weights all sit in its first k <= max_top_k <= cap columns: its total is
        # their running sum, summed in the same order as in the top-k layout.
        total = torch.where(has_top_k.unsqueeze(1), cum[:, -1:], full_total)
        keep = _nucleus(top_w, cum, top_p, total)
        if cap == vocab_size:
            break
        # A nucleus ends inside the cap when the last capped column is out of it.
        open_rows = keep[:, -1] & (top_p < 1.0) & ~has_top_k
        if not bool(open_rows.any()):  # the one device->host read
            break
        cap = vocab_size

    if all_truncated:
        return Candidates(weights=top_w.masked_fill_(~keep, 0.0), token_ids=top_ids)
    # Vocabulary layout: drop the weights below each row's last nucleus column (none for
    # rows with top_p == 1, whose keep is all True).
    last = keep.sum(dim=-1, keepdim=True) - 1  # [B, 1], >= 0: column 0 is always kept
    threshold = top_w.gather(1, last)
    return Candidates(weights=weights.masked_fill_(weights < threshold, 0.0), token_ids=None)


def _mask_top_k_unsorted(values: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """[B, V] values, top_k [B] (V = off) -> values below each row's k-th largest set to -inf."""
    disabled = top_k >= values.shape[1]  # [B]
    top_values = values.topk(max_top_k, dim=-1).values  # [B, max_top_k], descending
    kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    kth.masked_fill_(disabled.unsqueeze(1), _NEG_INF)
    return values.masked_fill(values < kth, _NEG_INF)


def exponential_noise(
    shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Exponential(1) samples as -log(U), U ~ Uniform[0, 1): 3x faster than `exponential_` on
    CPU. U = 0 gives +inf (that token cannot win, a 2^-24 bias); the clamp guards against a
    backend returning U = 1, whose 0 would turn a dropped token's 0 / 0 into a winning NaN."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    noise.uniform_(generator=generator).log_().neg_()
    return noise.clamp_(min=torch.finfo(torch.float32).tiny)


def advance_seeded_row(
    generator: torch.Generator, num_rows: int, vocab_size: int, device: torch.device
) -> None:
    """Advance `generator` as `random_sample` does for `num_rows` rows seeded with it (one
    [vocab_size] draw each), so that a replay from a saved state lands where those draws would
    have left it (speculative decoding keeps only the draws of the tokens it emits)."""
    for _ in range(num_rows):
        exponential_noise((vocab_size,), device, generator)


def random_sample(
    candidates: Candidates, generators: dict[int, torch.Generator], vocab_size: int
) -> torch.Tensor:
    """One token per row drawn from the candidates' weights: argmax(w / q), q ~ Exponential(1)
    i.i.d. (the exponential race). Consumes the weights. Returns [B] int64 token ids.

    Unseeded rows share one batched draw. A seeded row draws a full [V] row from its own
    generator, indexed by token id, so its sample depends only on its generator state and its
    weights, never on the rest of the batch or the candidate layout.
    """
    weights, token_ids = candidates.weights, candidates.token_ids
    num_rows, num_cols = weights.shape
    device = weights.device
    if len(generators) < num_rows:
        noise = exponential_noise((num_rows, num_cols), device)
    else:
        noise = torch.empty_like(weights)
    for row, generator in generators.items():
        row_noise = exponential_noise((vocab_size,), device, generator)
        noise[row] = row_noise if token_ids is None else row_noise[token_ids[row]]
    choice = weights.div_(noise).argmax(dim=-1)  # [B], column index
    if token_ids is None:
        return choice
    return token_ids.gather(1, choice.unsqueeze(1)).squeeze(1)
