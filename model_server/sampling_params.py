"""Per-request sampling parameters, validated at construction (ValueError, never assert)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from model_server.structured_output.params import StructuredOutputsParams

# Temperatures below this are treated as greedy (argmax); dividing by them would overflow.
_GREEDY_EPS = 1e-5
# Hard ceiling on top logprobs per token, like vLLM's default max_logprobs.
MAX_LOGPROBS = 20
# Seeds are 64-bit signed integers, as in vLLM (torch.long); each maps to its own generator
# state (negatives are taken modulo 2**64 by the sampler).
MIN_SEED = -(2**63)
MAX_SEED = 2**63 - 1
# OpenAI's range for logit_bias values: -100 bans a token in practice, 100 forces it.
MAX_LOGIT_BIAS = 100.0


class InvalidParamError(ValueError):
    """A bad value of one request field, named by `param` (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class RequestOutputKind(enum.Enum):
    """What a request's outputs hold while it runs (vLLM's names).

    CUMULATIVE: every output holds the token ids and logprobs so far (copied each step, so the
    engine can go on appending). DELTA: outputs hold the deltas and the cumulative text; the
    token ids and logprobs come whole in the last output only, uncopied (the engine appends no
    more): what the streaming servers and the offline `LLM` use.
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"


@dataclass(slots=True)
class SamplingParams:
    """How to turn a prompt into output tokens.

    Field names and meanings follow vLLM's SamplingParams. `max_tokens=None` means "until the
    context (max_model_len) is full". `top_k` 0 or -1 disables top-k (-1 is stored as 0); below
    -1 is an error, as in vLLM. `seed` is a 64-bit signed integer. `logprobs=None` returns no
    logprobs; `logprobs=k` returns the sampled token's logprob plus the k most likely ones.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # candle-vllm's window of the repetition penalty: only the last N tokens of prompt + output
    # count as seen; 0: all of them (vLLM's and transformers' behaviour).
    repeat_last_n: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Token id -> added to its logit before penalties, temperature and the filters (OpenAI's and
    # vLLM's order); the ids are checked against the vocabulary when the engine takes the request.
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        self.logit_bias = self.logit_bias or None
        self._validate()

    def _validate(self) -> None:
        # JSON bodies may carry NaN/Infinity (Python's json accepts them): a NaN passes every
        # range check below that is written as `x < lo` and poisons the sampler's logits.
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}.")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        prompt_only = self.max_tokens == 0 and self.prompt_logprobs is not None
        if self.max_tokens is not None and self.max_tokens < 1 and not prompt_only:
            raise ValueError(
                f"max_tokens must be at least 1, got {self.max_tokens}"
                + (" (0 only with prompt logprobs or echo)." if self.max_tokens == 0 else ".")
            )
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})."
            )
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}.")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise ValueError(
                f"seed must be a 64-bit signed integer (from -2**63 to 2**63 - 1), got {self.seed}."
            )
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repeat_last_n < 0:
            raise ValueError(f"repeat_last_n must be non-negative, got {self.repeat_last_n}.")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}.")
        k = self.prompt_logprobs
        if k is not None and (
            isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS
        ):
            raise InvalidParamError(
                f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {k!r}.",
                "prompt_logprobs",
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids.")
        self._validate_logit_bias()

    def _validate_logit_bias(self) -> None:
        for token, bias in (self.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidParamError(
                    f"logit_bias keys must be token ids (non-negative integers), got {token!r}.",
                    "logit_bias",
                )
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise InvalidParamError(
                    f"logit_bias values must be in [-100, 100], got {bias} for token {token}.",
                    "logit_bias",
                )

    def check_vocabulary(self, vocab_size: int) -> None:
        """InvalidParamError for a logit_bias token id the model's vocabulary does not have."""
        bad = [t for t in self.logit_bias or () if t >= vocab_size]
        if bad:
            raise InvalidParamError(
                f"logit_bias: token id {bad[0]} is out of range for the vocabulary "
                f"(0-{vocab_size - 1}).",
                "logit_bias",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
