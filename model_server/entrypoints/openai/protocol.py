"""OpenAI-compatible request models and errors (pydantic lives here, at the HTTP boundary only).

Field names and defaults follow OpenAI's API and vLLM's extensions (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`, `skip_special_tokens`,
`include_stop_str_in_output`). Unknown request fields are ignored, as vLLM does, so clients that
send newer OpenAI fields keep working. Range checks live in `SamplingParams` (one place, one
message); the models here only check shapes and types.

Completion and chat response bodies are built as plain dicts in `serving_*.py` (once per token
when streaming; OpenAI's exact keys and nulls); the e2e tests check them with the real `openai`
client, whose own models are the reference.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from model_server.entrypoints.openai.sampling_defaults import SamplingDefaults
from model_server.sampling_params import SamplingParams

# Most samples per request: n is multiplied into KV cache and compute, so cap the absurd.
MAX_N = 128


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ------------------------------------------------------------------------------- errors


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` with `status_code`."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type or _error_type(status_code)
        self.param = param
        self.code = code

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )


def _error_type(status_code: int) -> str:
    # OpenAI's own error types: every client error is an invalid_request_error except auth.
    if status_code == 401:
        return "authentication_error"
    if status_code < 500:
        return "invalid_request_error"
    return "server_error"


# ---------------------------------------------------------------------------- common


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    # vLLM: also put the running usage into every chunk.
    continuous_usage_stats: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "wick"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    # Wick's addition: the weights' quantization ("gptq w4 g128", "awq w4 g64", "int8"), None
    # for float weights.
    quantization: str | None = None
    # Wick's addition, named after vLLM's `--kv-cache-dtype`: the KV cache's dtype as resolved
    # ("bfloat16", "float32", "int8", "fp8_e4m3", "fp8_e5m2"; vLLM's `cache_dtype` label).
    kv_cache_dtype: str | None = None
    # Wick's addition: what the model serves: ["generate"] here; a pooling model's server
    # lists ["embed"] or ["score", "rerank"] (pooling_server.py).
    capabilities: list[str] | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's POST /v1/load_lora_adapter body."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's POST /v1/unload_lora_adapter body: the adapter by name."""

    lora_name: str


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` request field: one of its constraints."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    # `json` would shadow pydantic's BaseModel.json: the field is `json_`, `json` on the wire.
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# What `stop` takes: OpenAI's shapes and candle-vllm's (a serde enum: `{"Single": s}`,
# `{"Multiple": [s, ...]}`), which its README's curl sends.
STOP_SHAPES = (
    'a string, a list of strings, {"Single": "<string>"} or {"Multiple": ["<string>", ...]}'
)


def candle_stop(value: Any) -> Any:
    """candle-vllm's `stop` objects -> OpenAI's string / list; other values pass unchanged
    (their types are the field's to check). ValueError for any other object."""
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((key, inner),) = value.items()
        if key == "Single" and isinstance(inner, str):
            return inner
        if key == "Multiple" and isinstance(inner, list) and all(isinstance(s, str) for s in inner):
            return inner
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise ValueError(f"must be {STOP_SHAPES}, got the object {shown}")


def _first(*values: Any) -> Any:
    """The first value that is not None (the last is the built-in default)."""
    return next((v for v in values if v is not None), values[-1])


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM: logprobs name tokens `token_id:<id>` instead of their text.
    return_tokens_as_token_ids: bool = False
    # vLLM: each prompt token's logprob (after the first) and the k likeliest there, returned as
    # `prompt_logprobs` (SamplingParams checks the range).
    prompt_logprobs: int | None = None
    # vLLM: lets the caller pick the request id (also read from the X-Request-Id header).
    request_id: str | None = None
    # Structured outputs (vLLM): the current form, and the older guided_* fields.
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Accepted for vLLM clients and ignored: there is one grammar engine (docs).
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    _candle_stop = field_validator("stop", mode="before")(candle_stop)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        # JSON object keys are strings: each must spell a token id (the range checks are
        # SamplingParams', the vocabulary's the engine's).
        for key in value or {}:
            if not key.strip().isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
        return value

    @model_validator(mode="after")
    def _check_unsupported(self) -> _SamplingRequest:
        if self.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        default_max_tokens: int | None,
        defaults: SamplingDefaults | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Raises ValueError (-> 400) for out-of-range values, with SamplingParams' message.
        A field the request leaves unset takes the server's default (`defaults`), else OpenAI's."""
        d = defaults or SamplingDefaults()
        return SamplingParams(
            n=self.n,
            max_tokens=_first(max_tokens, d.max_tokens, default_max_tokens),
            min_tokens=self.min_tokens,
            temperature=_first(self.temperature, d.temperature, 1.0),
            top_p=_first(self.top_p, d.top_p, 1.0),
            top_k=_first(self.top_k, d.top_k, 0),
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=_first(self.repetition_penalty, d.repetition_penalty, 1.0),
            repeat_last_n=d.repeat_last_n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        # vLLM: only together with include_usage (it adds to the final usage chunk).
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


# ------------------------------------------------------------------------ completions

# A prompt: text, a batch of texts, token ids, or a batch of token-id lists.
CompletionPrompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    prompt: CompletionPrompt
    # OpenAI's default for the legacy completions endpoint.
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    # vLLM's beam search fields: not implemented, so anything but their defaults is a 400
    # (accepted and ignored, they would answer a different question than the one asked).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of is not supported: it must be unset or equal to n")
        return value

    @field_validator("use_beam_search", "length_penalty", "early_stopping")
    @classmethod
    def _no_beam_search(cls, value: Any, info: ValidationInfo) -> Any:
        default = cls.model_fields[str(info.field_name)].default
        if value != default:
            raise ValueError(
                f"beam search is not supported: {info.field_name} must be unset or {default!r}"
            )
        return value

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        return self

    def to_sampling_params(self, defaults: SamplingDefaults | None = None) -> SamplingParams:
        # OpenAI's 16 only where the request says nothing: a server default comes first, and an
        # explicit null still means "to the end of the context".
        unset = "max_tokens" not in self.model_fields_set
        return self._sampling_params(
            None if unset else self.max_tokens,
            self.logprobs,
            default_max_tokens=16 if unset else None,
            defaults=defaults,
            prompt_logprobs=self.engine_prompt_logprobs,
        )

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The prompt logprobs the engine computes: vLLM's `prompt_logprobs`, and with `echo`
        the echoed prompt's `logprobs` (the most of the two top-k's; each answer is cut to its
        own); echo with `max_tokens` 0 and neither still needs the prefill's end (0)."""
        k = self.prompt_logprobs
        if not self.echo or (k is not None and k < 0):
            return k  # a bad value goes on to SamplingParams, which names the field
        prompt_only = self.max_tokens == 0 and "max_tokens" in self.model_fields_set
        given = [v for v in (k, self.logprobs, 0 if prompt_only else None) if v is not None]
        return max(given, default=None)

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, one engine request each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- chat


class ChatTextPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatOtherPart(OpenAIBaseModel):
    """Any non-text part (image_url, input_audio, ...): parsed so the error can name it."""

    model_config = ConfigDict(extra="allow")
    type: str


ChatContentPart = Annotated[ChatTextPart | ChatOtherPart, Field(union_mode="left_to_right")]


class ToolCallFunction(OpenAIBaseModel):
    name: str
    # A JSON text, as OpenAI sends it back (a dict is accepted too).
    arguments: str | dict[str, Any] = "{}"


class ToolCall(OpenAIBaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(OpenAIBaseModel):
    # "developer" is OpenAI's newer name for the system role; templates know only "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    # An assistant turn that called tools, and a tool's answer to one of those calls.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check_content(self) -> ChatMessage:
        # OpenAI rejects these; only an assistant turn may come without content.
        if self.content is None and self.role in ("system", "developer", "user"):
            raise ValueError(f"a {self.role} message must have `content`")
        return self

    @property
    def template_role(self) -> str:
        """The role as chat templates know it."""
        return "system" if self.role == "developer" else self.role

    def text(self) -> str:
        """The content as one string; text parts are joined by newlines, as vLLM does."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if not isinstance(part, ChatTextPart):
                raise ValueError(
                    f"content part type {part.type!r} is not supported: this model takes text only"
                )
            texts.append(part.text)
        return "\n".join(texts)


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    # A JSON schema of the arguments; none means "no arguments".
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(OpenAIBaseModel):
    name: str = "response"
    description: str | None = None
    # OpenAI's field is `schema`; pydantic reserves the name, hence the alias.
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_format(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or self.json_schema.json_schema is None
        ):
            raise ValueError(
                "response_format of type json_schema needs json_schema.schema (the JSON schema)"
            )
        return self


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Chat-template controls (vLLM).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Shortcut for chat_template_kwargs.enable_thinking (Qwen3's switch): false asks the
    # template to close the thinking, and the answer is not split (reasoning_parsers.py).
    enable_thinking: StrictBool | None = None
    # Function calling (entrypoints/openai/tool_calls.py) and structured outputs.
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        template_kwargs(self.chat_template_kwargs, self.enable_thinking)
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs, with the enable_thinking shortcut."""
        return template_kwargs(self.chat_template_kwargs, self.enable_thinking)

    def to_sampling_params(self, defaults: SamplingDefaults | None = None) -> SamplingParams:
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        # Chat has no token limit by default: up to the end of the context (max_tokens=None).
        return self._sampling_params(
            max_tokens, logprobs, None, defaults, prompt_logprobs=self.prompt_logprobs
        )


def template_kwargs(kwargs: dict[str, Any] | None, enable_thinking: bool | None) -> dict[str, Any]:
    """`chat_template_kwargs` with the `enable_thinking` shortcut in it; ValueError (-> 400)
    for a non-boolean enable_thinking in it, or one the shortcut contradicts."""
    merged = dict(kwargs or {})
    given = merged.get("enable_thinking")
    if given is not None and not isinstance(given, bool):
        raise ValueError(
            f"chat_template_kwargs.enable_thinking must be true or false, got {given!r}"
        )
    if given is not None and enable_thinking is not None and given != enable_thinking:
        raise ValueError(
            f"enable_thinking ({enable_thinking}) and chat_template_kwargs.enable_thinking "
            f"({given}) disagree: send one of them"
        )
    if enable_thinking is not None:
        merged["enable_thinking"] = enable_thinking
    return merged


# ----------------------------------------------------------------------- tokenization


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: StrictBool | None = None  # as on chat completions

    @model_validator(mode="after")
    def _check_template_kwargs(self) -> TokenizeChatRequest:
        template_kwargs(self.chat_template_kwargs, self.enable_thinking)
        return self


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# -------------------------------------------------------------------------- responses


class ResponsesFunctionTool(OpenAIBaseModel):
    """A function tool as the Responses API spells it (flat: no `function` object)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(OpenAIBaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # OpenAI's field is `schema`; pydantic reserves the name, hence the alias.
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _check_format(self) -> ResponsesTextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("text.format of type json_schema needs `schema` (the JSON schema)")
        return self


class ResponsesText(OpenAIBaseModel):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(OpenAIBaseModel):
    """`POST /v1/responses` (stateless): served as a chat completion (serving_responses.py).
    `input` items are checked there, one by one, so that an error names `input[i]`."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: bool = True
    text: ResponsesText | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    # vLLM's extras, as on chat completions.
    seed: int | None = None
    top_k: int | None = None
    logit_bias: dict[str, float] | None = None
    enable_thinking: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Stateful or hosted features this server does not have: any value but "off" is a 400
    # naming the field (serving_responses.py), never silently dropped.
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
