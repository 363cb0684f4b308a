"""Request and response bodies of `POST /v1/chat/completions`.

Two request forms share one model: OPEA's (`messages` is `{"system", "user"}`; OPEA's defaults
apply: `max_new_tokens` 1024, `top_k` 10, `top_p` 0.95, `typical_p` 0.95, `temperature` 0.01,
`repetition_penalty` 1.03, `streaming` true) and OpenAI's (`messages` is a list; what is not given
is not sent, so the model server's defaults apply, and `stream` defaults to false). Both become a
`GenerationRequest`: OpenAI chat messages plus the sampling fields the model server takes.

OPEA's default token limit is "at most 1024", not "exactly 1024 or fail": `sampling_params()`
leaves it out and `default_max_tokens` names it, so that the app can shrink it to what the
model server's context leaves after the prompt (see `ModelServer.completion_room`).

GenAIComps' ServiceOrchestrator merges every `LLMParams` field into the request: `max_tokens`
and `max_new_tokens` both come (both 1024 unless the user set one), with `language`, `id`,
`index_name`, `chat_template`; a reranker before it adds `query` and `documents`. The limit the
caller changed from 1024 wins; `documents` and `chat_template` build the prompt (rag.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from microservice import safe_json
from microservice.errors import ServiceError
from microservice.limits import DEFAULT_LIMITS, RequestLimits, check_request
from microservice.rag import rag_messages, template_fields
from microservice.upstream import checked_tool_calls

OPEA_DEFAULTS: dict[str, Any] = {
    "max_tokens": 1024,
    "top_k": 10,
    "top_p": 0.95,
    "typical_p": 0.95,
    "temperature": 0.01,
    "repetition_penalty": 1.03,
}

# Request fields forwarded to the model server as they are (OpenAI's and vLLM's names).
FORWARDED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "user",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "enable_thinking",
    # Structured outputs and function calling (the model server checks them).
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
# Fields that make a request an OpenAI client's whose answer carries `tool_calls` or JSON: under
# LLM_RESPONSE_FORMAT=auto it gets OpenAI's format (formats.py).
TOOL_FIELDS = ("tools", "response_format")
# Seeds the model server takes (as vLLM does): 64-bit signed integers.
MIN_SEED = -(2**63)
MAX_SEED = 2**63 - 1

# Fields of GenAIComps' protocol (LLMParams, LLMParamsDoc, ChatCompletionRequest) that neither
# OpenAI nor Enterprise-RAG clients send: a body carrying one comes from GenAIComps.
GENAICOMPS_FIELDS = frozenset(
    {"query", "documents", "chat_template", "language", "id", "index_name", "request_type"}
)
# Given fields this service uses itself to build the prompt: not forwarded, not ignored.
PROMPT_FIELDS = ("documents", "chat_template")
TOKEN_LIMITS = ("max_new_tokens", "max_tokens", "max_completion_tokens")

Dialect = Literal["enterprise_rag", "genaicomps", "openai"]

# Sampling fields the model server does not implement: accepted, named in a warning, dropped.
# A value meaning "off" is no loss, so it is not worth a warning.
UNSUPPORTED_NEUTRAL: dict[str, Any] = {"typical_p": 1.0}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OpeaMessages(_Body):
    system: str = ""
    user: str


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Document(_Body):
    """A retrieved document as GenAIComps passes it (`{"title": ..., "text": ...}`)."""

    text: str


class ChatMessage(_Body):
    # "developer" is OpenAI's newer name for the system role.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    # An assistant turn that called tools, and a tool's answer (passed through as they are).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _check_tool_calls(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        # The model server's shape (a name, arguments as a JSON text or an object), checked
        # here so that no connector meets another (langchain's parses them).
        try:
            checked_tool_calls(value, delta=False)
        except TypeError as exc:
            raise ValueError(
                f'{exc}: send {{"id", "type": "function", "function": {{"name", "arguments"}}}}'
            ) from None
        return value

    @model_validator(mode="after")
    def _check_content(self) -> ChatMessage:
        # As OpenAI (and the model server): only an assistant turn may come without content.
        if self.content is None and self.role in ("system", "developer", "user"):
            raise ValueError(f"a {self.role} message must have `content`")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


def _messages_form(value: Any) -> str | None:
    if isinstance(value, dict | OpeaMessages):
        return "opea"
    if isinstance(value, list):
        return "openai"
    return None


Messages = Annotated[
    Annotated[OpeaMessages, Tag("opea")]
    | Annotated[list[ChatMessage], Field(min_length=1), Tag("openai")],
    Discriminator(
        _messages_form,
        custom_error_type="messages_form",
        custom_error_message=(
            'must be {"system": "...", "user": "..."} or a list of {"role", "content"} messages'
        ),
    ),
]


class ChatRequest(BaseModel):
    # Unknown fields are kept (not forwarded) so that a warning can name them.
    model_config = ConfigDict(extra="allow")

    messages: Messages | None = None
    query: str | None = None  # OPEA's older LLMParamsDoc: the user message alone
    model: str | None = None
    max_new_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    streaming: bool | None = None
    stream: bool | None = None
    n: int = Field(1, ge=1, le=1)
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # The model server's shortcut for chat_template_kwargs.enable_thinking (reasoning models).
    enable_thinking: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    data: dict[str, Any] | None = None
    output_guardrail_params: dict[str, Any] | None = None
    # GenAIComps' RAG inputs (rag.py): reranked documents, a {context}/{question} template.
    documents: list[str | Document] | None = None
    chat_template: str | None = None

    @field_validator("chat_template")
    @classmethod
    def _check_chat_template(cls, value: str | None) -> str | None:
        if value is not None:
            template_fields(value)
        return value

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: int | None) -> int | None:
        # Checked here, not only by the model server: a 422 naming the field, like the other
        # range checks of this model, before any upstream request.
        if value is not None and value < -1:
            raise ValueError(f"must be -1 or 0 (disabled) or at least 1, got {value}")
        return value

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, value: int | None) -> int | None:
        if value is not None and not MIN_SEED <= value <= MAX_SEED:
            raise ValueError(
                f"must be a 64-bit signed integer (from -2**63 to 2**63 - 1), got {value}"
            )
        return value

    @model_validator(mode="after")
    def _check(self) -> ChatRequest:
        if self.messages is None and self.query is None:
            raise ValueError(
                'messages is required: {"system": "...", "user": "..."} or a list of '
                '{"role", "content"} messages'
            )
        limits = self._limits()
        changed = {name: v for name, v in limits.items() if v != OPEA_DEFAULTS["max_tokens"]}
        if len(set(changed.values())) > 1:
            raise ValueError(
                f"token limits disagree: {limits}; send one of them (a limit left at OPEA's "
                "default 1024 gives way to the other)"
            )
        if None not in (self.stream, self.streaming) and self.stream != self.streaming:
            raise ValueError("stream and streaming disagree; send one of them")
        return self

    def _limits(self) -> dict[str, int]:
        return {name: v for name in TOKEN_LIMITS if (v := getattr(self, name)) is not None}

    @property
    def is_opea(self) -> bool:
        return not isinstance(self.messages, list)

    @property
    def dialect(self) -> Dialect:
        """Who sent this body: Enterprise-RAG (`messages` as {system, user}, or `streaming`),
        GenAIComps (one of its own fields, e.g. what its orchestrator merges in), else a plain
        OpenAI client."""
        given = self.model_fields_set | set(self.model_extra or {})
        if isinstance(self.messages, OpeaMessages) or "streaming" in given:
            return "enterprise_rag"
        if given & GENAICOMPS_FIELDS:
            return "genaicomps"
        return "openai"

    @property
    def wants_stream(self) -> bool:
        if self.stream is not None:
            return self.stream
        if self.streaming is not None:
            return self.streaming
        return self.is_opea

    @property
    def opea_messages(self) -> OpeaMessages | None:
        if isinstance(self.messages, OpeaMessages):
            return self.messages
        if self.messages is None:
            return OpeaMessages(user=self.query or "")
        return None

    def chat_messages(self) -> list[dict[str, Any]]:
        """OpenAI chat messages with text content (and tool calls / tool call ids)."""
        opea = self.opea_messages
        if opea is not None:
            system = [{"role": "system", "content": opea.system}] if opea.system else []
            return [*system, {"role": "user", "content": opea.user}]
        assert isinstance(self.messages, list)
        messages: list[dict[str, Any]] = []
        for m in self.messages:
            message: dict[str, Any] = {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.text(),
            }
            if m.tool_calls is not None:
                message["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        return messages

    @property
    def uses_tools(self) -> bool:
        """Asks for tool calls or JSON: only OpenAI's answer format can carry those."""
        return any(getattr(self, name) is not None for name in TOOL_FIELDS)

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents or ()]

    @property
    def uses_rag(self) -> bool:
        return self.chat_template is not None or bool(self.documents)

    def prompt_messages(self) -> list[dict[str, str]]:
        """`chat_messages()` with the documents and chat_template applied (rag.py)."""
        return rag_messages(self.chat_messages(), self.document_texts(), self.chat_template)

    def prompt(self) -> str:
        """The user's message, echoed back in the non-streaming answer (as OPEA does)."""
        opea = self.opea_messages
        if opea is not None:
            return opea.user
        users = [m for m in self.chat_messages() if m["role"] == "user"]
        return users[-1]["content"] if users else ""

    def _value(self, name: str) -> Any:
        value = getattr(self, name)
        if value is None and self.is_opea:
            return OPEA_DEFAULTS.get(name)
        return value

    @property
    def _orchestrator_default(self) -> bool:
        """Both of GenAIComps' limits at 1024: LLMParams' defaults, which its orchestrator
        merges into every request, so nobody chose them."""
        limits = self._limits()
        default = OPEA_DEFAULTS["max_tokens"]
        return limits.get("max_tokens") == default and limits.get("max_new_tokens") == default

    @property
    def max_tokens_given(self) -> int | None:
        """The client's own token limit, under whichever of its three names it came; when
        several came, the one changed from OPEA's default (the validator refused two changed
        ones)."""
        if self._orchestrator_default:
            return None
        limits = list(self._limits().values())
        changed = [v for v in limits if v != OPEA_DEFAULTS["max_tokens"]]
        return (changed or limits or [None])[0]

    @property
    def default_max_tokens(self) -> int | None:
        """OPEA's default limit when an OPEA request gave none (an explicit null counts as
        none) or GenAIComps' orchestrator sent its defaults; None otherwise."""
        if self.max_tokens_given is None and (self.is_opea or self._orchestrator_default):
            return int(OPEA_DEFAULTS["max_tokens"])
        return None

    def sampling_params(self) -> dict[str, Any]:
        """The fields sent to the model server besides `model`, `messages` and `stream`. The
        default token limit is not among them: see `default_max_tokens`."""
        params: dict[str, Any] = {}
        if (max_tokens := self.max_tokens_given) is not None:
            params["max_tokens"] = max_tokens
        for name in FORWARDED:
            value = self._value(name)
            if value is not None:
                params[name] = value
        return params

    def unsupported_fields(self) -> list[str]:
        """Fields that were given (or defaulted by OPEA) but are not forwarded: those the
        model server lacks, the prompt-building ones, unknown ones."""
        names = [
            name
            for name, neutral in UNSUPPORTED_NEUTRAL.items()
            if self._value(name) not in (None, neutral)
        ]
        prompt = [name for name in PROMPT_FIELDS if getattr(self, name) is not None]
        return names + sorted([*prompt, *(self.model_extra or {})])

    def ignored_fields(self) -> list[str]:
        """Unsupported fields that this service does not use either (worth a warning)."""
        return [name for name in self.unsupported_fields() if name not in PROMPT_FIELDS]


@dataclass
class GenerationRequest:
    """What a connector sends: `model` is already resolved, `params` never holds `model`,
    `messages` or `stream`. `opea` is kept for connectors that template OPEA's two parts."""

    model: str
    messages: list[dict[str, Any]]
    params: dict[str, Any] = field(default_factory=dict)
    opea: OpeaMessages | None = None

    def payload(self, stream: bool) -> dict[str, Any]:
        return {"model": self.model, "messages": self.messages, **self.params, "stream": stream}


def parse_chat_request(body: bytes, limits: RequestLimits = DEFAULT_LIMITS) -> ChatRequest:
    """Raises ServiceError: 400 when the body is not UTF-8 JSON (safe_json.loads), 413 past
    `limits`, 422 when a field is wrong."""
    if not body.strip():
        raise ServiceError("the request body is empty: send a JSON object", 400)
    try:
        data = safe_json.loads(body)
    except safe_json.JSONProblem as exc:
        raise ServiceError(f"the request body {exc}", 400) from None
    if not isinstance(data, dict):
        raise ServiceError(
            f"the request body must be a JSON object, got {type(data).__name__}", 400
        )
    check_request(data, limits)
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise ServiceError(message, 422, param=param) from None


_TAGS = frozenset({"opea", "openai"})
# Fields of several shapes: pydantic reports one error per shape; say once what fits.
_UNION_HINTS = {
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts ({'type': 'text', 'text': ...})",
}
_UNION_MEMBERS = frozenset({"str", "list[str]", "list[TextPart]", "none"})


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """One line naming each bad field, and the first bad field."""
    parts: list[str] = []
    param = None
    hinted: set[str] = set()
    for err in exc.errors(include_url=False):
        loc = [str(x) for x in err["loc"] if x not in _TAGS]
        msg = str(err["msg"]).removeprefix("Value error, ")
        shown = err["type"] not in ("missing", "value_error")
        members = [i for i, x in enumerate(loc) if x in _UNION_MEMBERS]
        if members and loc[members[0] - 1] in _UNION_HINTS:
            loc = loc[: members[0]]
            if ".".join(loc) in hinted:
                continue
            hinted.add(".".join(loc))
            msg = f"must be {_UNION_HINTS[loc[-1]]}"
        if shown and len(repr(err["input"])) <= 60:
            msg = f"{msg} (got {err['input']!r})"
        where = ".".join(loc)
        param = param or where or None
        parts.append(f"{where}: {msg}" if where else msg)
    unique = list(dict.fromkeys(parts))
    if len(unique) > 4:
        unique = [*unique[:4], f"... ({len(unique) - 4} more)"]
    return "; ".join(unique) or "invalid request", param


def generated_doc(
    request_id: str,
    text: str,
    request: ChatRequest,
) -> dict[str, Any]:
    """OPEA's GeneratedDoc: the non-streaming answer."""
    return {
        "id": request_id,
        "text": text,
        "prompt": request.prompt(),
        "streaming": False,
        "output_guardrail_params": request.output_guardrail_params,
        "data": request.data,
    }
