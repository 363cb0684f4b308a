"""Turns engine-core outputs into user-facing RequestOutputs: text, stop strings, n > 1 groups."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from model_server.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from model_server.engine.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    RequestOutput,
    TokenLogprobs,
)
from model_server.sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True)
class _SampleState:
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer | None
    # Characters of `output.text` already handed out in a delta.
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_SampleState]
    num_cached_tokens: int = 0
    # With prompt_logprobs, once the first sample's first output brought them: None first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.output.finished for s in self.samples)


def child_request_ids(request_id: str, n: int) -> list[str]:
    """Engine-core ids of a request's samples: the id itself for n == 1, `i_<id>` otherwise."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        # child id -> (parent state, sample index)
        self._children: dict[str, tuple[_RequestState, int]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> list[str]:
        """Track a request; returns the engine-core ids of its samples."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        samples = []
        for i in range(params.n):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            logprobs = [] if params.logprobs is not None else None
            samples.append(_SampleState(CompletionOutput(index=i, logprobs=logprobs), detok))
        state = _RequestState(request_id, prompt, list(prompt_token_ids), params, samples)
        self._requests[request_id] = state
        child_ids = child_request_ids(request_id, params.n)
        for i, cid in enumerate(child_ids):
            self._children[cid] = (state, i)
        return child_ids

    def remove_request(self, request_id: str) -> list[str]:
        """Forget a request (abort); returns the engine-core ids to abort."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return []
        child_ids = child_request_ids(request_id, state.params.n)
        for cid in child_ids:
            self._children.pop(cid, None)
        return child_ids

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs. Returns the RequestOutputs of requests that changed and the
        engine-core ids that hit a stop string (the caller must stop them in the core)."""
        changed: dict[str, _RequestState] = {}
        to_stop: list[str] = []
        for out in outputs:
            entry = self._children.get(out.request_id)
            if entry is None:
                continue  # aborted meanwhile
            state, index = entry
            sample = state.samples[index]
            if sample.output.finished:
                continue
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if out.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = [None, *out.prompt_logprobs]
            for piece in _pieces(out, bool(state.params.stop)):
                if self._apply(state, sample, piece):
                    to_stop.append(out.request_id)
                if sample.output.finished:
                    break  # a stop string: the step's later tokens are not the sample's
            changed[state.request_id] = state
        results = []
        for state in changed.values():
            results.append(self._make_output(state))
            if state.finished:
                self.remove_request(state.request_id)
        return results, to_stop

    def _apply(self, state: _RequestState, sample: _SampleState, out: EngineCoreOutput) -> bool:
        """Returns True when a stop string finished the sample before the core knew it."""
        params = state.params
        o = sample.output
        o.token_ids.extend(out.new_token_ids)
        if o.logprobs is not None and out.new_logprobs:
            o.logprobs.extend(out.new_logprobs)
        stopped_by_string = False
        new_ids = out.new_token_ids
        if out.finish_reason == "stop" and not params.include_stop_str_in_output:
            # The core stopped on the last token (EOS or one of stop_token_ids): as in vLLM, it
            # stays in token_ids but not in the text, unless include_stop_str_in_output.
            new_ids = new_ids[:-1]
        if sample.detokenizer is not None and new_ids:
            delta = sample.detokenizer.add_tokens(new_ids)
            o.text = sample.detokenizer.text
            match = find_stop_string(
                o.text, params.stop, len(delta), params.include_stop_str_in_output
            )
            if match is not None:
                stop_str, truncate_to = match
                o.text = o.text[:truncate_to]
                o.finish_reason, o.stop_reason = "stop", stop_str
                stopped_by_string = out.finish_reason is None
                return stopped_by_string
        if out.finish_reason is not None:
            o.finish_reason, o.stop_reason = out.finish_reason, out.stop_reason
        return stopped_by_string

    def _make_output(self, state: _RequestState) -> RequestOutput:
        hold = max(state.params.max_stop_str_len - 1, 0)
        for sample in state.samples:
            o = sample.output
            visible = len(o.text) if o.finished else max(len(o.text) - hold, sample.num_sent_chars)
            o.text_delta = o.text[sample.num_sent_chars : visible]
            sample.num_sent_chars = max(visible, sample.num_sent_chars)
            o.token_ids_delta = o.token_ids[sample.num_sent_tokens :]
            sample.num_sent_tokens = len(o.token_ids)
            if o.logprobs is not None:
                o.logprobs_delta = o.logprobs[sample.num_sent_logprobs :]
                sample.num_sent_logprobs = len(o.logprobs)
        cumulative = state.params.output_kind is RequestOutputKind.CUMULATIVE
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[_hand_out(s.output, cumulative) for s in state.samples],
            finished=state.finished,
            num_cached_tokens=state.num_cached_tokens,
            prompt_logprobs=state.prompt_logprobs,
        )


def _pieces(out: EngineCoreOutput, has_stop_strings: bool) -> list[EngineCoreOutput]:
    """`out` token by token when a stop string may end the sample inside it (a step of
    speculative decoding emits several tokens): the sample then ends at the token that
    completed the stop string, as without speculation. Else `out` itself."""
    n = len(out.new_token_ids)
    if n <= 1 or not has_stop_strings:
        return [out]
    return [
        dataclasses.replace(
            out,
            new_token_ids=[token_id],
            new_logprobs=None if out.new_logprobs is None else out.new_logprobs[i : i + 1],
            finish_reason=out.finish_reason if i == n - 1 else None,
            stop_reason=out.stop_reason if i == n - 1 else None,
        )
        for i, token_id in enumerate(out.new_token_ids)
    ]


def _hand_out(o: CompletionOutput, cumulative: bool) -> CompletionOutput:
    """What may cross to another thread while the processor goes on appending to `o`'s lists:
    copies of them (CUMULATIVE), the lists themselves once the sample is finished (they no longer
    change), or none (DELTA before the end). `text` is a str: shared as it is."""
    token_ids, logprobs = o.token_ids, o.logprobs
    if cumulative:
        token_ids = list(token_ids)
        logprobs = list(logprobs) if logprobs is not None else None
    elif not o.finished:
        token_ids = []
        logprobs = [] if logprobs is not None else None
    return CompletionOutput(
        index=o.index,
        text=o.text,
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=o.finish_reason,
        stop_reason=o.stop_reason,
        text_delta=o.text_delta,
        token_ids_delta=o.token_ids_delta,
        logprobs_delta=o.logprobs_delta,
        num_token_ids=len(o.token_ids),
    )
