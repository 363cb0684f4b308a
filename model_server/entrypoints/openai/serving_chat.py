"""`POST /v1/chat/completions`: messages -> the model's chat template -> one engine request."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from model_server.engine.outputs import CompletionOutput, RequestOutput
from model_server.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from model_server.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ChunkWriter,
    OpenAIServing,
    json_response,
    sse_error,
    usage,
)


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Any:
        self.check_model(request.model)
        try:
            params = request.to_sampling_params()
        except ValueError as exc:
            raise APIError(str(exc), 400) from None
        prompt_token_ids = self.chat_prompt(
            request.messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            template_kwargs=request.chat_template_kwargs,
        )
        request_id = self.request_id(raw_request, "chatcmpl", request.request_id)
        created = int(time.time())
        if request.stream:
            (stream,) = await self.start_generation([prompt_token_ids], params, request_id)
            return StreamingResponse(
                self._stream(request, stream, request_id, created),
                media_type="text/event-stream",
            )
        (out,) = await self.run_to_completion([prompt_token_ids], params, request_id)
        return self._response(request, out, request_id, created)

    def _response(
        self, request: ChatCompletionRequest, out: RequestOutput, request_id: str, created: int
    ) -> Response:
        choices = []
        for sample in out.outputs:
            logprobs = None
            if request.logprobs and sample.logprobs is not None:
                logprobs = self.chat_logprobs(sample.logprobs)
            choices.append(
                {
                    "index": sample.index,
                    "message": {"role": "assistant", "content": sample.text},
                    "logprobs": logprobs,
                    "finish_reason": sample.finish_reason,
                    "stop_reason": sample.stop_reason,
                }
            )
        completion_tokens = sum(len(s.token_ids) for s in out.outputs)
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": usage(len(out.prompt_token_ids), completion_tokens),
        }
        return json_response(body)

    async def _stream(
        self,
        request: ChatCompletionRequest,
        stream: AsyncIterator[RequestOutput],
        request_id: str,
        created: int,
    ) -> AsyncGenerator[str, None]:
        n = request.n
        finished = [False] * n
        num_tokens = [0] * n
        prompt_tokens = 0

        chunk = ChunkWriter(
            request_id, "chat.completion.chunk", created, self.model_name, request.include_usage
        )

        try:
            first = True
            async for out in stream:
                if first:
                    # OpenAI's first chunk of each choice names the role, with empty content.
                    first = False
                    prompt_tokens = len(out.prompt_token_ids)
                    yield chunk(
                        [
                            {
                                "index": i,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                            for i in range(n)
                        ]
                    )
                choices = []
                for sample in out.outputs:
                    if finished[sample.index]:
                        continue
                    num_tokens[sample.index] = sample.num_token_ids
                    choice = self._stream_choice(request, sample)
                    if choice is not None:
                        choices.append(choice)
                        finished[sample.index] = sample.finished
                if choices:
                    running = usage(prompt_tokens, sum(num_tokens))
                    yield chunk(choices, running if request.continuous_usage else None)
            if request.include_usage:
                yield chunk([], usage(prompt_tokens, sum(num_tokens)))
        except Exception as exc:
            yield sse_error(exc)
        yield SSE_DONE

    def _stream_choice(
        self, request: ChatCompletionRequest, sample: CompletionOutput
    ) -> dict[str, Any] | None:
        logprobs = None
        if request.logprobs and sample.logprobs_delta:
            logprobs = self.chat_logprobs(sample.logprobs_delta)
        if not sample.text_delta and logprobs is None and not sample.finished:
            return None
        delta = {"content": sample.text_delta} if sample.text_delta else {}
        return {
            "index": sample.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": sample.finish_reason,
            "stop_reason": sample.stop_reason,
        }
