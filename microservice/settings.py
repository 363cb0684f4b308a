"""Microservice settings: the environment (names from DESIGN.md), overridden by CLI flags.

Empty variables count as unset, so a compose file can pass `LLM_MODEL_NAME=` through.
`LLM_API_KEY` is the model server's key (the same variable the model server reads), sent
upstream as `Authorization: Bearer`; `LLM_USVC_API_KEY` protects this service itself.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from microservice.cors import CORSPolicy, check_origins, parse_list
from microservice.limits import (
    DEFAULT_MAX_DOCUMENTS,
    DEFAULT_MAX_DOCUMENTS_SIZE,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_MAX_REQUEST_BODY_SIZE,
    parse_size,
)

ResponseFormatSetting = Literal["auto", "enterprise_rag", "openai", "downstream"]


def _env(*names: str) -> Any:
    return AliasChoices(*names)


class MicroserviceSettings(BaseSettings):
    model_config = SettingsConfigDict(
        populate_by_name=True,  # CLI flags pass field names; the environment uses the aliases
        env_ignore_empty=True,
        extra="ignore",
        case_sensitive=False,
    )

    host: str = Field("0.0.0.0", validation_alias=_env("LLM_USVC_HOST"))
    port: int = Field(9000, validation_alias=_env("LLM_USVC_PORT"))
    model_server_endpoint: str = Field(
        "http://localhost:8008", validation_alias=_env("LLM_MODEL_SERVER_ENDPOINT")
    )
    connector: Literal["generic", "langchain"] = Field(
        "generic", validation_alias=_env("LLM_CONNECTOR")
    )
    # Sent to the model server; unset: the request's `model`, else the model server's first.
    model_name: str | None = Field(None, validation_alias=_env("LLM_MODEL_NAME"))
    disable_streaming: bool = Field(False, validation_alias=_env("LLM_DISABLE_STREAMING"))
    openai_format_streaming: bool = Field(
        False, validation_alias=_env("LLM_OPENAI_FORMAT_STREAMING")
    )
    # auto: by the request (see formats.py); else always that format.
    response_format: ResponseFormatSetting = Field(
        "auto", validation_alias=_env("LLM_RESPONSE_FORMAT")
    )
    # A reasoning model's thinking in OPEA's text answers (between <think> and </think>, before
    # the answer); OpenAI's format always carries it in its own fields.
    include_reasoning: bool = Field(False, validation_alias=_env("LLM_USVC_INCLUDE_REASONING"))
    # true: a request naming a model the model server does not serve gets its 404 (vLLM);
    # false: with one model served, that model answers (OPEA), with a warning per name.
    strict_model_name: bool = Field(False, validation_alias=_env("LLM_STRICT_MODEL_NAME"))
    api_key: SecretStr | None = Field(None, validation_alias=_env("LLM_API_KEY"))
    usvc_api_key: SecretStr | None = Field(None, validation_alias=_env("LLM_USVC_API_KEY"))
    # Connect timeout bounds how fast a dead model server is reported (503); the read timeout
    # is the longest silence allowed from it (504): a whole answer when not streaming.
    connect_timeout: float = Field(
        1.5, gt=0, validation_alias=_env("LLM_MODEL_SERVER_CONNECT_TIMEOUT")
    )
    read_timeout: float = Field(300.0, gt=0, validation_alias=_env("LLM_MODEL_SERVER_READ_TIMEOUT"))
    health_cache_seconds: float = Field(
        3.0, ge=0, validation_alias=_env("LLM_HEALTH_CHECK_CACHE_SECONDS")
    )
    log_level: str = Field("info", validation_alias=_env("LLM_USVC_LOG_LEVEL"))
    # Request limits (limits.py: the defaults and why); 0: no limit; sizes in bytes, given as
    # e.g. 16MiB.
    max_request_body_size: int = Field(
        DEFAULT_MAX_REQUEST_BODY_SIZE, ge=0, validation_alias=_env("LLM_USVC_MAX_REQUEST_BODY_SIZE")
    )
    max_documents: int = Field(
        DEFAULT_MAX_DOCUMENTS, ge=0, validation_alias=_env("LLM_USVC_MAX_DOCUMENTS")
    )
    max_documents_size: int = Field(
        DEFAULT_MAX_DOCUMENTS_SIZE, ge=0, validation_alias=_env("LLM_USVC_MAX_DOCUMENTS_SIZE")
    )
    max_messages: int = Field(
        DEFAULT_MAX_MESSAGES, ge=0, validation_alias=_env("LLM_USVC_MAX_MESSAGES")
    )
    # CORS (cors.py), off unless origins are given. Lists are given with commas, spaces or as
    # a JSON list and kept as comma-joined text (a list field would make pydantic-settings
    # read the variable as JSON only).
    allowed_origins: str = Field("", validation_alias=_env("LLM_USVC_ALLOWED_ORIGINS"))
    allowed_methods: str = Field("*", validation_alias=_env("LLM_USVC_ALLOWED_METHODS"))
    allowed_headers: str = Field("*", validation_alias=_env("LLM_USVC_ALLOWED_HEADERS"))
    allow_credentials: bool = Field(False, validation_alias=_env("LLM_USVC_ALLOW_CREDENTIALS"))

    @field_validator("connector", "response_format", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.strip().lower().replace("-", "_") if isinstance(value, str) else value

    @field_validator("max_request_body_size", "max_documents_size", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return parse_size(value) if isinstance(value, str) else value

    @field_validator("allowed_origins", "allowed_methods", "allowed_headers", mode="before")
    @classmethod
    def _list(cls, value: Any, info: ValidationInfo) -> str:
        items = parse_list(value)
        return ",".join(check_origins(items) if info.field_name == "allowed_origins" else items)

    @model_validator(mode="after")
    def _check_formats(self) -> MicroserviceSettings:
        if self.openai_format_streaming and self.response_format not in ("auto", "openai"):
            raise ValueError(
                "LLM_OPENAI_FORMAT_STREAMING=true asks for OpenAI chunks, but "
                f"LLM_RESPONSE_FORMAT={self.response_format} asks for another format: "
                "set only one of them"
            )
        if self.include_reasoning and self.connector == "langchain":
            raise ValueError(
                "LLM_USVC_INCLUDE_REASONING=true needs LLM_CONNECTOR=generic: the langchain "
                "connector's chain keeps only the answer's text, not a reasoning model's thinking"
            )
        return self

    @field_validator("model_server_endpoint")
    @classmethod
    def _normalize_endpoint(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {value!r}")
        # OpenAI-style base URLs end in /v1; the routes below are added to the server root.
        return value.removesuffix("/v1")

    @field_validator("port")
    @classmethod
    def _check_port(cls, value: int) -> int:
        if not 0 <= value <= 65535:
            raise ValueError(f"port must be in 0-65535, got {value}")
        return value

    @property
    def api_key_value(self) -> str | None:
        return self.api_key.get_secret_value() if self.api_key is not None else None

    @property
    def cors(self) -> CORSPolicy | None:
        """The CORS policy; None (no CORS headers at all) unless origins are given."""
        if not self.allowed_origins:
            return None
        return CORSPolicy(
            tuple(self.allowed_origins.split(",")),
            tuple(self.allowed_methods.split(",") if self.allowed_methods else ()),
            tuple(self.allowed_headers.split(",") if self.allowed_headers else ()),
            self.allow_credentials,
        )

    @property
    def usvc_api_key_value(self) -> str | None:
        return self.usvc_api_key.get_secret_value() if self.usvc_api_key is not None else None
