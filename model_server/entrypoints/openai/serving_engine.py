"""What the OpenAI endpoints share: model check, request ids, tokenization, error mapping,
running engine requests, logprobs formatting and SSE framing."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from model_server.engine.async_engine import (
    Admission,
    EngineClient,
    EngineDeadError,
    EngineDrainingError,
    EngineNotReadyError,
    EngineOverloadedError,
    RequestAbortedError,
)
from model_server.engine.chat_template import render_chat_text
from model_server.engine.outputs import RequestOutput, TokenLogprobs
from model_server.entrypoints.openai.protocol import APIError, ChatMessage
from model_server.entrypoints.openai.request_limits import (
    RequestLimits,
    max_chars_per_token,
    prompt_too_long,
)
from model_server.entrypoints.openai.sampling_defaults import SamplingDefaults
from model_server.entrypoints.openai.serving_models import OpenAIServingModels
from model_server.entrypoints.openai.unavailable import ServiceUnavailable
from model_server.entrypoints.utils import prepend
from model_server.lora.request import LoRARequest
from model_server.sampling_params import RequestOutputKind, SamplingParams
from model_server.structured_output.params import StructuredOutputError

# JSON has no -inf: a token the model rules out gets this logprob instead (as vLLM does).
MIN_LOGPROB = -9999.0

SSE_DONE = "data: [DONE]\n\n"

T = TypeVar("T")

# Arguments of render_chat / apply_chat_template that the server sets itself: passing them again
# through chat_template_kwargs is a TypeError ("got multiple values"), i.e. a 500, not a 400.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "tokenizer",
        "messages",
        "conversation",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
    }
)


def to_api_error(exc: BaseException) -> APIError:
    """Map engine exceptions to HTTP errors; anything unexpected is re-raised by the caller."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, StructuredOutputError):
        return APIError(str(exc), 400, param=exc.param)
    if isinstance(exc, ValueError):  # InvalidParamError names its field
        return APIError(str(exc), 400, param=getattr(exc, "param", None))
    if isinstance(exc, EngineOverloadedError):
        return ServiceUnavailable(str(exc), code="overloaded")
    if isinstance(exc, EngineNotReadyError | RequestAbortedError):
        return ServiceUnavailable(str(exc), close=isinstance(exc, EngineDrainingError))
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), 500, code="engine_dead")
    raise exc


def _dumps(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def json_response(body: dict[str, Any], status_code: int = 200) -> Response:
    return Response(_dumps(body), status_code=status_code, media_type="application/json")


async def _gather_all(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Await all concurrently. If one fails (or we are cancelled: client gone), cancel the
    others and wait for them, so their engine requests are aborted before this raises."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException as exc:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if isinstance(exc, Exception):
            raise to_api_error(exc) from None
        raise


def sse(payload: dict[str, Any]) -> str:
    return f"data: {_dumps(payload)}\n\n"


def sse_error(exc: BaseException) -> str:
    """An error in the middle of a stream (the status line is long gone): one error event."""
    try:
        err = to_api_error(exc)
    except BaseException:
        err = APIError(f"internal error: {type(exc).__name__}: {exc}", 500)
    return sse(err.to_response().model_dump())


@dataclass(slots=True)
class ChunkWriter:
    """Streamed chunks of one response: `writer(choices, usage_info)` is one SSE line; with
    include_usage every chunk carries `usage` (null until the end)."""

    request_id: str
    obj: str  # "chat.completion.chunk" | "text_completion"
    created: int
    model: str
    include_usage: bool

    def __call__(
        self, choices: list[dict[str, Any]], usage_info: dict[str, int] | None = None
    ) -> str:
        payload: dict[str, Any] = {
            "id": self.request_id,
            "object": self.obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage_info is not None or self.include_usage:
            payload["usage"] = usage_info
        return sse(payload)


def clamp_logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class OpenAIServing:
    """Base of the endpoint handlers; one instance per app, all on the event loop."""

    def __init__(
        self,
        engine_client: EngineClient,
        models: OpenAIServingModels,
        limits: RequestLimits | None = None,
    ) -> None:
        self.engine_client = engine_client
        self.models = models
        self.limits = limits or RequestLimits()
        # What a request's unset sampling fields take (the server's flags, generation config).
        self.sampling_defaults = SamplingDefaults()
        # Token id -> its text, for logprobs (bounded by the vocabulary).
        self._token_text: dict[int, str] = {}

    # -------------------------------------------------------------------- checks

    @property
    def model_name(self) -> str:
        """The name responses report (the first served name)."""
        return self.models.model_name

    def check_model(self, model: str | None) -> None:
        self.models.check_model(model)

    def response_model_name(self, model: str | None) -> str:
        """The name a response reports: the adapter's for a LoRA request (as vLLM), else the
        first served name."""
        return self.models.response_name(model)

    def tokenizer(self) -> Any:
        engine = self.engine_client
        try:
            engine.check_ready()  # 503 while loading or draining, 500 once dead
        except RuntimeError as exc:
            raise to_api_error(exc) from None
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise APIError("this model has no tokenizer: send token ids instead", 400)
        return tokenizer

    @staticmethod
    def request_id(raw_request: Request, prefix: str, requested: str | None = None) -> str:
        """`<prefix>-<id>`: the client's id (body `request_id`, else the X-Request-Id header),
        as vLLM does, so logs and traces line up; a random one otherwise. A client id already
        in flight is refused by the engine (400)."""
        given = requested or raw_request.headers.get("x-request-id")
        return f"{prefix}-{given or uuid.uuid4().hex}"

    # ---------------------------------------------------------------- prompts

    def chat_prompt(
        self,
        messages: Sequence[ChatMessage] | list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any] | None,
    ) -> list[int]:
        text = self.chat_prompt_text(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
        )
        # The template already wrote every special token it wants.
        return self.encode("messages", text, add_special_tokens=False)

    def chat_prompt_text(
        self,
        messages: Sequence[ChatMessage] | list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any] | None,
    ) -> str:
        """The prompt text of `messages` under the chat template (tokenize it without special
        tokens); 400s naming the field."""
        reserved = sorted(set(template_kwargs or ()) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise APIError(
                f"chat_template_kwargs must not set {', '.join(reserved)}: the server sets "
                "(or takes from the request's own fields) those arguments itself",
                400,
                param="chat_template_kwargs",
            )
        tokenizer = self.tokenizer()
        try:
            conversation = [
                m if isinstance(m, dict) else {"role": m.template_role, "content": m.text()}
                for m in messages
            ]
            text = render_chat_text(
                tokenizer,
                conversation,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(template_kwargs or {}),
            )
        except ValueError as exc:
            raise APIError(str(exc), 400, param="messages") from None
        return text

    def encode(self, param: str, text: str, *, add_special_tokens: bool) -> list[int]:
        """`text`'s token ids; 400 for a text the tokenizer cannot take or that is longer than
        any prompt of this model, before tokenizing it (`param` names it in the error)."""
        self.check_prompt_length(param, text)
        try:
            encoded = self.tokenizer()(text, add_special_tokens=add_special_tokens)
        except TypeError as exc:  # the Rust tokenizer refuses what it cannot read as a str
            message = f"{param}: the tokenizer cannot read this text: {exc}"
            raise APIError(message, 400, param=param.split("[")[0]) from None
        return list(encoded.input_ids)

    def check_prompt_length(self, param: str, text: str) -> None:
        """400 for a text with more characters than any prompt of this model can have (the
        context length times the longest token), without tokenizing it."""
        tokenizer, max_len = self.engine_client.tokenizer, self.engine_client.max_model_len
        if tokenizer is None or not max_len or len(text) <= max_len:
            return  # a token stands for at least one character
        per_token = max_chars_per_token(tokenizer)
        if per_token is not None and len(text) > max_len * per_token:
            raise prompt_too_long(param, len(text), max_len, per_token)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer().decode([token_id])
            self._token_text[token_id] = text
        return text

    # ------------------------------------------------------------- generation

    async def start_generation(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> list[AsyncIterator[RequestOutput]]:
        """Submit every prompt and wait for each one's first output, so that a rejected request
        answers 4xx before any response byte. Returns iterators that replay those first outputs.
        On any failure, every submitted request is aborted."""
        admission = self._admit(len(prompts), request_id)
        try:
            gens = self._generators(prompts, params, admission.request_ids, lora_request)
            try:
                firsts = await _gather_all(anext(gen) for gen in gens)
            except BaseException:
                for gen in gens:  # those that did answer are parked at their first output
                    await gen.aclose()
                raise
        finally:
            self.engine_client.release(admission)
        return [prepend(first, gen) for first, gen in zip(firsts, gens, strict=True)]

    async def run_to_completion(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Every prompt's final output (cumulative text, token ids, logprobs)."""

        async def last(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
            out = None
            async for out in gen:  # noqa: B007 - only the last (finished) output matters
                pass
            assert out is not None
            return out

        admission = self._admit(len(prompts), request_id)
        try:
            gens = self._generators(prompts, params, admission.request_ids, lora_request)
            return await _gather_all(last(gen) for gen in gens)
        finally:
            self.engine_client.release(admission)

    def _admit(self, num_prompts: int, request_id: str) -> Admission:
        """Waiting slots for the engine requests of a request's prompts, all at once before any
        is added (503 when the queue lacks room for all of them: nothing is queued then)."""
        request_ids = [f"{request_id}-{i}" for i in range(num_prompts)]
        try:
            return self.engine_client.admit(request_ids)
        except Exception as exc:
            raise to_api_error(exc) from None

    def _generators(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        request_ids: Sequence[str],
        lora_request: LoRARequest | None = None,
    ) -> list[AsyncGenerator[RequestOutput, None]]:
        # One engine request per prompt, each with all n samples. Streams read the deltas and
        # the rest the last output, which holds everything: no step copies the token lists.
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        # Only a LoRA request passes the keyword (engine clients of tests may not take it).
        lora = {} if lora_request is None else {"lora_request": lora_request}
        return [
            self.engine_client.generate(prompt, params, engine_request_id, **lora)
            for prompt, engine_request_id in zip(prompts, request_ids, strict=True)
        ]

    # --------------------------------------------------------------- logprobs

    def completion_logprobs(
        self, entries: Sequence[TokenLogprobs], text_offset: int, as_ids: bool = False
    ) -> tuple[dict[str, Any], int]:
        """The legacy completions `logprobs` object for `entries`; returns it and the text offset
        after the last token. `top_logprobs` holds the sampled token and the k likeliest.
        Offsets count characters of the text whatever `as_ids` makes of the token names."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for entry in entries:
            label = self.token_label(entry.token_id, as_ids)
            tokens.append(label)
            token_logprobs.append(clamp_logprob(entry.logprob))
            top = {self.token_label(t, as_ids): clamp_logprob(lp) for t, lp in entry.top}
            top.setdefault(label, clamp_logprob(entry.logprob))
            top_logprobs.append(top)
            offsets.append(text_offset)
            text_offset += len(self.token_text(entry.token_id))
        return {
            "text_offset": offsets,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": top_logprobs,
        }, text_offset

    def echo_logprobs(
        self,
        prompt_token_ids: Sequence[int],
        prompt_logprobs: Sequence[TokenLogprobs | None],
        k: int,
        as_ids: bool = False,
    ) -> tuple[dict[str, Any], int]:
        """The echoed prompt's part of the legacy completions `logprobs` object (`echo` with
        `logprobs: k`), as OpenAI and vLLM give it: the first token's logprob and top are null
        (nothing comes before it); returns it and the text offset after the prompt."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset = 0
        for token_id, entry in zip(prompt_token_ids, prompt_logprobs, strict=True):
            label = self.token_label(token_id, as_ids)
            tokens.append(label)
            offsets.append(offset)
            offset += len(self.token_text(token_id))
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(clamp_logprob(entry.logprob))
            top = {self.token_label(t, as_ids): clamp_logprob(lp) for t, lp in entry.top[:k]}
            top.setdefault(label, clamp_logprob(entry.logprob))
            top_logprobs.append(top)
        return {
            "text_offset": offsets,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": top_logprobs,
        }, offset

    def vllm_prompt_logprobs(
        self, prompt_logprobs: Sequence[TokenLogprobs | None], k: int, as_ids: bool = False
    ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs` answer: per prompt position, None for the first, else
        {token id: {logprob, rank, decoded_token}} for the prompt token and the k likeliest."""
        out: list[dict[str, dict[str, Any]] | None] = []
        for entry in prompt_logprobs:
            if entry is None:
                out.append(None)
                continue
            position = {
                str(entry.token_id): {
                    "logprob": clamp_logprob(entry.logprob),
                    "rank": entry.rank,
                    "decoded_token": self.token_label(entry.token_id, as_ids),
                }
            }
            for rank, (t, lp) in enumerate(entry.top[:k], start=1):
                position.setdefault(
                    str(t),
                    {
                        "logprob": clamp_logprob(lp),
                        "rank": rank,
                        "decoded_token": self.token_label(t, as_ids),
                    },
                )
            out.append(position)
        return out

    def token_label(self, token_id: int, as_ids: bool) -> str:
        """How logprobs name a token: its text, or vLLM's `token_id:<id>` when the request set
        `return_tokens_as_token_ids` (texts that do not round-trip, such as byte pieces of a
        UTF-8 character, stay identifiable)."""
        return f"token_id:{token_id}" if as_ids else self.token_text(token_id)

    def chat_logprobs(
        self, entries: Sequence[TokenLogprobs], as_ids: bool = False
    ) -> dict[str, Any]:
        """The chat `logprobs` object: per token, its logprob and the top-k alternatives."""
        content = []
        for entry in entries:
            text = self.token_label(entry.token_id, as_ids)
            content.append(
                {
                    "token": text,
                    "logprob": clamp_logprob(entry.logprob),
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": (alt := self.token_label(t, as_ids)),
                            "logprob": clamp_logprob(lp),
                            "bytes": list(alt.encode("utf-8")),
                        }
                        for t, lp in entry.top
                    ],
                }
            )
        return {"content": content}
