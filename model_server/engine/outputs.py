"""The engine's plain result types, passed up from the runner to the HTTP layer. No torch.

ModelRunnerOutput (runner -> scheduler) -> EngineCoreOutput (scheduler -> output processor) ->
RequestOutput with one CompletionOutput per sample (output processor -> the fronts).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of one token (generated, or a prompt token given the tokens before it): its
    own and the `top` most likely alternatives (most likely first). `rank` (prompt tokens only):
    1 + how many tokens the model found more likely than it."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


@dataclass(slots=True)
class ModelRunnerOutput:
    # Parallel to SchedulerOutput.scheduled_requests; None where the request did not sample
    # (a prefill chunk that does not reach the end of the prompt).
    sampled_token_ids: list[int | None]
    logprobs: list[TokenLogprobs | None]
    # Parallel too, for requests that asked for prompt logprobs and computed prompt positions
    # this step: one entry per prompt token this chunk's rows predict (the token at position
    # chunk start + 1 onwards); None elsewhere.
    prompt_logprobs: list[list[TokenLogprobs] | None] | None = None
    # Speculative decoding, parallel too (None when no request verified drafts). Request i
    # verified drafts d and the first a were accepted: its step emits t_0..t_a, the target's
    # token after each accepted prefix (t_j == d_j for j < a); `sampled_token_ids[i]` is t_0
    # and this holds t_1..t_a with their logprobs ([] for requests without drafts).
    spec_token_ids: list[list[int]] | None = None
    spec_logprobs: list[list[TokenLogprobs | None]] | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request (the sampled token, and why it finished)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None
    # Prompt tokens whose K/V came from the prefix cache (set on every output).
    num_cached_tokens: int = 0
    # Requests with prompt_logprobs, on their first output only: the logprobs of prompt tokens
    # 1 .. P-1 (token 0 has none).
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request. `text` is cumulative; so are `token_ids` and `logprobs` in every
    output of a CUMULATIVE request and in the last one of a DELTA request (empty before; see
    `RequestOutputKind`). The `*_delta` fields hold only what is new since the previous
    RequestOutput of this request; `num_token_ids` counts every token so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[TokenLogprobs] | None = None
    num_token_ids: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Prompt tokens served from the prefix cache (for n > 1: the most over the samples).
    num_cached_tokens: int = 0
    # vLLM's: with `prompt_logprobs`, one entry per prompt token, None for the first (nothing
    # comes before it); set on every output once the prompt is done (never changed after).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
