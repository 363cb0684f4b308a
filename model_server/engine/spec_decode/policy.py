"""Which requests speculate, and when (the `auto` policy of issue 35)."""

from __future__ import annotations

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
