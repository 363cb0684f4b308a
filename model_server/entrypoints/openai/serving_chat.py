"""`POST /v1/chat/completions`: messages -> the model's chat template -> one engine request."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from model_server.engine.async_engine import EngineClient
from model_server.engine.outputs import CompletionOutput, RequestOutput
from model_server.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from model_server.entrypoints.openai.reasoning_parsers import (
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
    single_token_id,
    thinking_disabled,
)
from model_server.entrypoints.openai.request_limits import RequestLimits, check_unicode
from model_server.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ChunkWriter,
    OpenAIServing,
    json_response,
    sse_error,
    usage,
)
from model_server.entrypoints.openai.serving_models import OpenAIServingModels
from model_server.entrypoints.openai.structured_outputs import (
    build_structured_outputs,
    request_constraints,
)
from model_server.entrypoints.openai.tool_calls import (
    ToolDeltas,
    ToolPlan,
    conversation,
    plan_tools,
    tool_call_objects,
)
from model_server.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from model_server.sampling_params import SamplingParams
from model_server.structured_output.params import ReasoningGate

_UNSET: Any = object()


@dataclass(frozen=True, slots=True)
class Reasoning:
    """How one request's answer is split: the parser, and the prompt it continues."""

    parser: ReasoningParser
    prompt_text: str

    def split(self, text: str) -> tuple[str | None, str]:
        return self.parser.split(self.prompt_text, text)

    def stream(self) -> ReasoningStream:
        return self.parser.stream(self.prompt_text)


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine_client: EngineClient,
        models: OpenAIServingModels,
        tool_call_parser: str | None = None,
        limits: RequestLimits | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        super().__init__(engine_client, models, limits)
        self._tool_call_parser_name = tool_call_parser
        self._tool_parser: ToolParser | None = None
        self._reasoning_parser_name = reasoning_parser
        self._reasoning_parser: ReasoningParser | None = _UNSET

    def tool_parser(self) -> ToolParser:
        """`--tool-call-parser`, or the format the model's chat template writes (once loaded)."""
        if self._tool_parser is None:
            template = getattr(self.tokenizer(), "chat_template", None)
            self._tool_parser = get_tool_parser(self._tool_call_parser_name, template)
        return self._tool_parser

    def reasoning_parser(self) -> ReasoningParser | None:
        """`--reasoning-parser`, or (auto) the one the model's chat template implies."""
        if self._reasoning_parser is _UNSET:
            template = getattr(self.tokenizer(), "chat_template", None)
            self._reasoning_parser = get_reasoning_parser(self._reasoning_parser_name, template)
        return self._reasoning_parser

    def _reasoning(
        self, template_kwargs: dict[str, Any], prompt_text: str, params: SamplingParams
    ) -> Reasoning | None:
        """The request's split (None: off, or enable_thinking false); a constraint on the
        output is moved after the thinking."""
        parser = self.reasoning_parser()
        if parser is None or thinking_disabled(template_kwargs):
            return None
        reasoning = Reasoning(parser, prompt_text)
        constraint = params.structured_outputs
        if constraint is not None:
            tokenizer = self.tokenizer()
            end_id = single_token_id(tokenizer, parser.end)
            if end_id is None:
                raise APIError(
                    f"{constraint.param}: structured outputs with --reasoning-parser "
                    f"{parser.name} need a model whose {parser.end} is one token (the grammar "
                    "starts after it); this model has none. Send enable_thinking: false to "
                    "constrain the whole answer instead",
                    400,
                    param=constraint.param,
                )
            constraint.reasoning = ReasoningGate(
                end_id,
                single_token_id(tokenizer, parser.start),
                parser.starts_thinking(prompt_text),
            )
        return reasoning

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Any:
        # What the request may cost, before any templating or tokenizing; lone surrogates
        # before any message (the 404's too) quotes the request's text.
        self.limits.check_chat(request)
        check_unicode(request)
        lora_request = self.models.resolve(request.model)  # 404 for an unknown name
        try:
            params = request.to_sampling_params(self.sampling_defaults)
        except ValueError as exc:
            raise APIError(str(exc), 400, param=getattr(exc, "param", None)) from None
        if request.stream and request.prompt_logprobs is not None:
            raise APIError(
                "prompt_logprobs is not available with stream on /v1/chat/completions (as in "
                "vLLM): send stream false, or use /v1/completions",
                400,
                param="prompt_logprobs",
            )
        plan = plan_tools(request)
        forced = plan.constraint()
        constraints = request_constraints(request) + ([forced] if forced else [])
        params.structured_outputs = build_structured_outputs(constraints)
        parser = self.tool_parser()
        try:
            messages, tool_kwargs = conversation(
                request.messages, plan, parser, getattr(self.tokenizer(), "chat_template", None)
            )
        except ValueError as exc:
            raise APIError(str(exc), 400, param="messages") from None
        template_kwargs = {**request.template_kwargs(), **tool_kwargs}
        prompt_text = self.chat_prompt_text(
            messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            template_kwargs=template_kwargs,
        )
        # The template already wrote every special token it wants.
        prompt_token_ids = self.encode("messages", prompt_text, add_special_tokens=False)
        reasoning = self._reasoning(template_kwargs, prompt_text, params)
        request_id = self.request_id(raw_request, "chatcmpl", request.request_id)
        created = int(time.time())
        if request.stream:
            (stream,) = await self.start_generation(
                [prompt_token_ids], params, request_id, lora_request
            )
            return StreamingResponse(
                self._stream(request, stream, request_id, created, plan, parser, reasoning),
                media_type="text/event-stream",
            )
        (out,) = await self.run_to_completion([prompt_token_ids], params, request_id, lora_request)
        return self._response(request, out, request_id, created, plan, parser, reasoning)

    def _response(
        self,
        request: ChatCompletionRequest,
        out: RequestOutput,
        request_id: str,
        created: int,
        plan: ToolPlan,
        parser: ToolParser,
        reasoning: Reasoning | None = None,
    ) -> Response:
        choices = []
        for sample in out.outputs:
            logprobs = None
            if request.logprobs and sample.logprobs is not None:
                logprobs = self.chat_logprobs(sample.logprobs, request.return_tokens_as_token_ids)
            text = sample.text
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning is not None:
                # vLLM's field and its newer name, the same text; the answer after the thinking.
                thought, text = reasoning.split(text)
                message["content"] = text if text or thought is None else None
                message["reasoning_content"] = message["reasoning"] = thought
            finish_reason = sample.finish_reason
            if plan.parses_output:
                extracted = plan.extract(parser, text)
                if extracted.calls:
                    message["content"] = extracted.content
                    message["tool_calls"] = tool_call_objects(extracted.calls)
                finish_reason = plan.finish_reason(finish_reason, bool(extracted.calls))
            choices.append(
                {
                    "index": sample.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": sample.stop_reason,
                }
            )
        completion_tokens = sum(len(s.token_ids) for s in out.outputs)
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": self.response_model_name(request.model),
            "choices": choices,
            "usage": usage(len(out.prompt_token_ids), completion_tokens),
        }
        if request.prompt_logprobs is not None:
            # vLLM's: beside the choices, the templated prompt's logprobs.
            body["prompt_logprobs"] = self.vllm_prompt_logprobs(
                out.prompt_logprobs or [],
                request.prompt_logprobs,
                request.return_tokens_as_token_ids,
            )
        return json_response(body)

    async def _stream(
        self,
        request: ChatCompletionRequest,
        stream: AsyncIterator[RequestOutput],
        request_id: str,
        created: int,
        plan: ToolPlan,
        parser: ToolParser,
        reasoning: Reasoning | None = None,
    ) -> AsyncGenerator[str, None]:
        n = request.n
        finished = [False] * n
        tools = [plan.stream(parser) for _ in range(n)] if plan.parses_output else None
        thoughts = [reasoning.stream() for _ in range(n)] if reasoning is not None else None
        num_tokens = [0] * n
        prompt_tokens = 0

        chunk = ChunkWriter(
            request_id,
            "chat.completion.chunk",
            created,
            self.response_model_name(request.model),
            request.include_usage,
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
                        ],
                        # vLLM: with continuous usage, every chunk has it, this one too.
                        usage(prompt_tokens, 0) if request.continuous_usage else None,
                    )
                choices = []
                for sample in out.outputs:
                    if finished[sample.index]:
                        continue
                    num_tokens[sample.index] = sample.num_token_ids
                    deltas = tools[sample.index] if tools is not None else None
                    thought = thoughts[sample.index] if thoughts is not None else None
                    choice = self._stream_choice(request, sample, deltas, plan, thought)
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
        self,
        request: ChatCompletionRequest,
        sample: CompletionOutput,
        tools: ToolDeltas | None,
        plan: ToolPlan,
        thought: ReasoningStream | None = None,
    ) -> dict[str, Any] | None:
        logprobs = None
        if request.logprobs and sample.logprobs_delta:
            logprobs = self.chat_logprobs(sample.logprobs_delta, request.return_tokens_as_token_ids)
        content = sample.text_delta
        reasoning = ""
        if thought is not None:
            reasoning, content = thought.feed(content)
            if sample.finished:
                more_reasoning, more_content = thought.finish()
                reasoning += more_reasoning
                content += more_content
        tool_calls: list[dict[str, Any]] = []
        finish_reason = sample.finish_reason
        if tools is not None:
            content, tool_calls = tools.feed(content)
            if sample.finished:
                rest, more = tools.finish()
                content += rest
                tool_calls += more
                finish_reason = plan.finish_reason(finish_reason, tools.num_calls > 0)
        if not (content or reasoning or tool_calls) and logprobs is None and not sample.finished:
            return None
        delta: dict[str, Any] = {"content": content} if content else {}
        if reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {
            "index": sample.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": sample.stop_reason,
        }
