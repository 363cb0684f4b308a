"""Verification of drafts against the target model's own tokens.

The runner samples the target at every verified position as decoding would, one position at a
time: row i is the target's token after the request's tokens and drafts 0..i-1, drawn with the
request's next noise (none when greedy). A draft is accepted iff the target produced it, so
the emitted tokens are exactly what decoding without speculation emits.

Sampled requests: for one-hot drafts (n-gram lookup), this is vLLM's rejection sampling in
distribution. Draft d is accepted with probability p(d) = min(1, p(d) / q(d)) with q = one-hot(d),
and on rejection the emitted token is a draw of p conditioned on not being d, i.e. the
normalized residual max(0, p - q). Seeds are kept exactly, since every emitted token uses the
draw it would have used without speculation (see ModelRunner.sample).
"""

from __future__ import annotations

from collections.abc import Sequence


def accept_drafts(draft_ids: Sequence[int], target_ids: Sequence[int]) -> int:
    """How many drafts the target accepts: drafts are taken while each equals the target's
    token at its position. `target_ids[i]` is the target's token after the prefix that ends
    with draft i - 1 (target_ids[0]: after the request's last token), so
    `len(target_ids) == len(draft_ids) + 1`, and the step emits `target_ids[: accepted + 1]`:
    the accepted drafts, then the target's correction (or, all accepted, its bonus token)."""
    if len(target_ids) != len(draft_ids) + 1:
        raise ValueError(f"{len(target_ids)} target tokens for {len(draft_ids)} drafts")
    accepted = 0
    for draft, target in zip(draft_ids, target_ids, strict=False):
        if draft != target:
            break
        accepted += 1
    return accepted
