"""Which requests speculate, and when (the `auto` policy of issue 35): narrow batches only
(`batch_speculates`), requests whose sampling does not depend on the position in the step
(`request_speculates`), and per request as many drafts as its recent acceptance earns
(`AcceptanceFeedback`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from model_server.sampling_params import SamplingParams


def batch_speculates(num_running: int, disable_by_batch_size: int) -> bool:
    """Speculation pays while the batch is narrow: a step's cost then is the weights' read,
    which k + 1 positions per request share. A wide batch is compute-bound and verifying
    rejected drafts would only slow it, so steps with `disable_by_batch_size` or more running
    requests do not speculate (vLLM's rule)."""
    return num_running < disable_by_batch_size


def request_speculates(params: SamplingParams, num_output_tokens: int, has_grammar: bool) -> bool:
    """Whether a decoding request may verify drafts (greedy or sampled, seeded or not: see
    spec_decode/verify.py): nothing may make the sampler's processing depend on the position
    within the step (penalties count the output so far, min_tokens masks until it is out, a
    grammar would have to advance through the drafts; logit_bias is the same at every
    position, so it stays). The others decode one token per step as before."""
    return not has_grammar and not params.needs_penalties and num_output_tokens >= params.min_tokens


# The acceptance feedback's longest pause, in decode steps: after this many misses in a row a
# request still tries its drafts about every 17th step, so a copy that starts late in an answer
# (a quote, a repeated list item) is found within that many tokens.
MAX_PAUSE_STEPS = 16


@dataclass(slots=True)
class DraftBackoff:
    """One request's state under `AcceptanceFeedback`."""

    limit: int  # the most drafts it proposes next (1..k)
    misses: int = 0  # verifications in a row that accepted no draft
    resume_at: int = 0  # proposals pause until the request has this many output tokens


@dataclass(slots=True)
class AcceptanceFeedback:
    """The `auto` policy's per-request rule: a request stops paying for drafts that do not land.

    A verification costs more than a plain decode step (SmolLM2 bf16, 2-core Zen 5: 5 rows
    1.3-1.6x one row, each verified row attending on the decode path), so one whose drafts are
    all rejected (a *miss*) is a loss, one with any draft accepted a gain. After each
    verification of a request:

    - a miss halves the drafts it proposes next (at least 1); from the second miss in a row
      it also proposes nothing for 1, 2, 4, ... decode steps (at most MAX_PAUSE_STEPS);
    - a verification with every draft accepted doubles the limit again (at most k), one with
      some accepted keeps it; any accepted draft ends the run of misses.

    So a request whose drafts land keeps k drafts a step, and chat, whose n-gram matches are
    mostly chance, verifies ever more rarely while its guesses keep failing. Only how many
    drafts are proposed changes: verification stays exact, output identical. Requests are
    forgotten when they finish (`forget`)."""

    num_speculative_tokens: int
    max_pause: int = MAX_PAUSE_STEPS
    _requests: dict[str, DraftBackoff] = field(default_factory=dict)

    def max_drafts(self, request_id: str, num_output_tokens: int) -> int:
        """How many drafts the request may propose now (0: paused)."""
        state = self._requests.get(request_id)
        if state is None:
            return self.num_speculative_tokens
        return 0 if num_output_tokens < state.resume_at else state.limit

    def observe(
        self, request_id: str, num_drafts: int, num_accepted: int, num_output_tokens: int
    ) -> None:
        """A verification of `num_drafts` drafts accepted the first `num_accepted`; the request
        has `num_output_tokens` output tokens after it."""
        if num_drafts <= 0:
            return
        k = self.num_speculative_tokens
        state = self._requests.setdefault(request_id, DraftBackoff(k))
        if num_accepted == 0:
            state.misses += 1
            state.limit = max(1, state.limit // 2)
            if state.misses >= 2:
                pause = min(self.max_pause, 1 << (state.misses - 2))
                state.resume_at = num_output_tokens + pause
            return
        state.misses = 0
        if num_accepted >= num_drafts:
            state.limit = min(k, 2 * state.limit)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
