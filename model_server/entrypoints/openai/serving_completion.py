"""`POST /v1/completions`: prompts (text, texts, token ids, lists of token ids) -> completions.

Each prompt is one engine request with all `n` samples; choice `index = prompt_index * n +
sample_index`, as in OpenAI's API and vLLM.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from model_server.engine.outputs import CompletionOutput, RequestOutput
from model_server.entrypoints.openai.protocol import APIError, CompletionRequest
from model_server.entrypoints.openai.request_limits import check_unicode
from model_server.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ChunkWriter,
    OpenAIServing,
    json_response,
    sse_error,
    usage,
)
from model_server.entrypoints.openai.structured_outputs import (
    build_structured_outputs,
    request_constraints,
)
from model_server.entrypoints.utils import merge_async_iterators


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Any:
        prompts = request.prompts()
        self._check_prompts(request, prompts)
        lora_request = self.models.resolve(request.model)  # 404 for an unknown name
        try:
            params = request.to_sampling_params(self.sampling_defaults)
        except ValueError as exc:
            raise APIError(str(exc), 400, param=getattr(exc, "param", None)) from None
        params.structured_outputs = build_structured_outputs(request_constraints(request))
        request_id = self.request_id(raw_request, "cmpl", request.request_id)
        created = int(time.time())
        if request.stream:
            streams = await self.start_generation(prompts, params, request_id, lora_request)
            return StreamingResponse(
                self._stream(request, streams, request_id, created),
                media_type="text/event-stream",
            )
        outputs = await self.run_to_completion(prompts, params, request_id, lora_request)
        return self._response(request, outputs, request_id, created)

    def _check_prompts(self, request: CompletionRequest, prompts: list[str | list[int]]) -> None:
        """What the request may cost, checked before anything is tokenized or queued."""
        self.limits.check_completion(request, len(prompts))
        check_unicode(request)
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):  # token ids need no tokenizing: the engine checks them
                where = "prompt" if isinstance(request.prompt, str) else f"prompt[{i}]"
                self.check_prompt_length(where, prompt)

    def _echo(self, request: CompletionRequest, out: RequestOutput) -> str:
        if not request.echo:
            return ""
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer().decode(out.prompt_token_ids)

    def _prompt_parts(
        self, request: CompletionRequest, out: RequestOutput
    ) -> tuple[dict[str, Any] | None, int, list[Any] | None]:
        """What a choice of `out` starts with: the echoed prompt's logprobs (echo with logprobs)
        and the text offset after them, and vLLM's `prompt_logprobs` (when asked); None while
        the engine has not given the prompt logprobs yet."""
        lps = out.prompt_logprobs
        if lps is None:
            return None, 0, None
        as_ids = request.return_tokens_as_token_ids
        echoed, offset = None, 0
        if request.echo and request.logprobs is not None:
            echoed, offset = self.echo_logprobs(out.prompt_token_ids, lps, request.logprobs, as_ids)
        vllm = None
        if request.prompt_logprobs is not None:
            vllm = self.vllm_prompt_logprobs(lps, request.prompt_logprobs, as_ids)
        return echoed, offset, vllm

    def _response(
        self,
        request: CompletionRequest,
        outputs: list[RequestOutput],
        request_id: str,
        created: int,
    ) -> Response:
        choices = []
        prompt_tokens = completion_tokens = 0
        for prompt_index, out in enumerate(outputs):
            prompt_tokens += len(out.prompt_token_ids)
            echo = self._echo(request, out)
            echoed, offset, prompt_logprobs = self._prompt_parts(request, out)
            for sample in out.outputs:
                completion_tokens += len(sample.token_ids)
                logprobs = None
                if request.logprobs is not None and sample.logprobs is not None:
                    logprobs, _ = self.completion_logprobs(
                        sample.logprobs, offset, request.return_tokens_as_token_ids
                    )
                    logprobs = _join_logprobs(echoed, logprobs)
                choice = {
                    "index": prompt_index * request.n + sample.index,
                    "text": echo + sample.text,
                    "logprobs": logprobs,
                    "finish_reason": sample.finish_reason,
                    "stop_reason": sample.stop_reason,
                }
                if request.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs
                choices.append(choice)
        body = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": self.response_model_name(request.model),
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        }
        return json_response(body)

    async def _stream(
        self,
        request: CompletionRequest,
        streams: list[AsyncIterator[RequestOutput]],
        request_id: str,
        created: int,
    ) -> AsyncGenerator[str, None]:
        n = request.n
        num_choices = n * len(streams)
        finished = [False] * num_choices
        text_offsets = [0] * num_choices
        num_tokens = [0] * num_choices
        prompt_tokens = [0] * len(streams)
        seen_prompt = [False] * len(streams)
        # echo: the prompt text, sent ahead of each choice's first chunk; with logprobs, the
        # prompt's logprobs too, and vLLM's prompt_logprobs when asked (_PromptPending).
        echo_pending = [""] * num_choices
        prompt_pending: list[_PromptPending | None] = [None] * num_choices
        wants_prompt = request.prompt_logprobs is not None or (
            request.echo and request.logprobs is not None
        )

        chunk = ChunkWriter(
            request_id,
            "text_completion",
            created,
            self.response_model_name(request.model),
            request.include_usage,
        )

        try:
            async for prompt_index, out in merge_async_iterators(*streams):
                choices = []
                if not seen_prompt[prompt_index]:
                    seen_prompt[prompt_index] = True
                    prompt_tokens[prompt_index] = len(out.prompt_token_ids)
                    echo = self._echo(request, out)
                    for sample in out.outputs:
                        echo_pending[prompt_index * n + sample.index] = echo
                first = prompt_index * n
                if wants_prompt and prompt_pending[first] is None and out.prompt_logprobs:
                    echoed, offset, vllm = self._prompt_parts(request, out)
                    for i in range(first, first + n):
                        if echoed is not None:  # the generated tokens' offsets follow it
                            text_offsets[i] = offset
                        prompt_pending[i] = _PromptPending(echoed, vllm)
                for sample in out.outputs:
                    i = prompt_index * n + sample.index
                    if finished[i]:
                        continue
                    num_tokens[i] = sample.num_token_ids
                    choice = self._stream_choice(
                        request, sample, i, echo_pending, text_offsets, prompt_pending
                    )
                    if choice is not None:
                        choices.append(choice)
                        finished[i] = sample.finished
                if choices:
                    running = None
                    if request.continuous_usage:
                        running = usage(sum(prompt_tokens), sum(num_tokens))
                    yield chunk(choices, running)
            if request.include_usage:
                yield chunk([], usage(sum(prompt_tokens), sum(num_tokens)))
        except Exception as exc:
            yield sse_error(exc)
        yield SSE_DONE

    def _stream_choice(
        self,
        request: CompletionRequest,
        sample: CompletionOutput,
        index: int,
        echo_pending: list[str],
        text_offsets: list[int],
        prompt_pending: list[_PromptPending | None],
    ) -> dict[str, Any] | None:
        """The chunk choice for a sample's delta; None when there is nothing to say yet (text
        held back for a possible stop string, or an incomplete UTF-8 character). A choice's
        first chunk carries the echoed prompt (and its logprobs) and vLLM's prompt_logprobs."""
        logprobs = None
        if request.logprobs is not None and sample.logprobs_delta:
            logprobs, text_offsets[index] = self.completion_logprobs(
                sample.logprobs_delta, text_offsets[index], request.return_tokens_as_token_ids
            )
        pending = prompt_pending[index]
        if pending is not None and pending.sent:
            pending = None
        if pending is not None and pending.echoed is not None:
            logprobs = _join_logprobs(pending.echoed, logprobs)
        text = echo_pending[index] + sample.text_delta
        if not text and logprobs is None and not sample.finished and pending is None:
            return None
        echo_pending[index] = ""
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": sample.finish_reason,
            "stop_reason": sample.stop_reason,
        }
        if pending is not None:
            pending.sent = True
            if request.prompt_logprobs is not None:
                choice["prompt_logprobs"] = pending.vllm
        return choice


@dataclass(slots=True)
class _PromptPending:
    """A streamed choice's prompt parts, sent with its first chunk (`sent` afterwards)."""

    echoed: dict[str, Any] | None
    vllm: list[Any] | None
    sent: bool = False


def _join_logprobs(
    first: dict[str, Any] | None, then: dict[str, Any] | None
) -> dict[str, Any] | None:
    """Two legacy completions logprobs objects, one after the other (either may be None)."""
    if first is None or then is None:
        return first if then is None else then
    return {key: first[key] + then[key] for key in first}
