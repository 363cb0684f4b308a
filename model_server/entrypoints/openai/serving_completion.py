"""`POST /v1/completions`: prompts (text, texts, token ids, lists of token ids) -> completions.

Each prompt is one engine request with all `n` samples; choice `index = prompt_index * n +
sample_index`, as in OpenAI's API and vLLM.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
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
        self.check_model(request.model)
        try:
            params = request.to_sampling_params(self.sampling_defaults)
        except ValueError as exc:
            raise APIError(str(exc), 400, param=getattr(exc, "param", None)) from None
        params.structured_outputs = build_structured_outputs(request_constraints(request))
        if request.echo and request.logprobs is not None:
            raise APIError("echo with logprobs is not supported (no prompt logprobs)", 400)
        request_id = self.request_id(raw_request, "cmpl", request.request_id)
        created = int(time.time())
        if request.stream:
            streams = await self.start_generation(prompts, params, request_id)
            return StreamingResponse(
                self._stream(request, streams, request_id, created),
                media_type="text/event-stream",
            )
        outputs = await self.run_to_completion(prompts, params, request_id)
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
            for sample in out.outputs:
                completion_tokens += len(sample.token_ids)
                logprobs = None
                if request.logprobs is not None and sample.logprobs is not None:
                    logprobs, _ = self.completion_logprobs(
                        sample.logprobs, 0, request.return_tokens_as_token_ids
                    )
                choices.append(
                    {
                        "index": prompt_index * request.n + sample.index,
                        "text": echo + sample.text,
                        "logprobs": logprobs,
                        "finish_reason": sample.finish_reason,
                        "stop_reason": sample.stop_reason,
                    }
                )
        body = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
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
        # echo: the prompt text, sent ahead of each choice's first chunk.
        echo_pending = [""] * num_choices

        chunk = ChunkWriter(
            request_id, "text_completion", created, self.model_name, request.include_usage
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
                for sample in out.outputs:
                    i = prompt_index * n + sample.index
                    if finished[i]:
                        continue
                    num_tokens[i] = sample.num_token_ids
                    choice = self._stream_choice(request, sample, i, echo_pending, text_offsets)
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
    ) -> dict[str, Any] | None:
        """The chunk choice for a sample's delta; None when there is nothing to say yet (text
        held back for a possible stop string, or an incomplete UTF-8 character)."""
        logprobs = None
        if request.logprobs is not None and sample.logprobs_delta:
            logprobs, text_offsets[index] = self.completion_logprobs(
                sample.logprobs_delta, text_offsets[index], request.return_tokens_as_token_ids
            )
        text = echo_pending[index] + sample.text_delta
        if not text and logprobs is None and not sample.finished:
            return None
        echo_pending[index] = ""
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": sample.finish_reason,
            "stop_reason": sample.stop_reason,
        }
