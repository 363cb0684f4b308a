"""Model-server settings: the environment (`LLM_*`, plus OPEA's aliases), overridden by CLI flags.

The fields are the declarations of model_server/settings_spec.py (one name per setting
everywhere: native, compose, helm). Where two environment names are given, the `LLM_*` one wins
over the OPEA alias. Empty variables count as unset, so a compose file can pass
`LLM_MAX_MODEL_LEN=` through without breaking anything.
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from model_server.config import EngineConfig
from model_server.settings_spec import (
    DEFAULT_MODEL_NAME,
    SETTINGS,
    SETTINGS_BY_NAME,
    Setting,
    check_device_count,
    parse_device_ids,
    served_model_names,
)

__all__ = ["DEFAULT_MODEL_NAME", "ServerSettings", "env_names"]


def _field(s: Setting) -> tuple[Any, Any]:
    annotation: Any = SecretStr if s.secret else s.type
    if s.default is None:
        annotation = annotation | None
    return annotation, Field(
        s.default, validation_alias=AliasChoices(*s.env_names), description=s.help
    )


_Fields: type[BaseSettings] = create_model(
    "_Fields", __base__=BaseSettings, **{s.name: _field(s) for s in SETTINGS}
)


class ServerSettings(_Fields):
    model_config = SettingsConfigDict(
        populate_by_name=True,  # CLI flags pass field names; the environment uses the aliases
        env_ignore_empty=True,
        extra="ignore",
        case_sensitive=False,
    )

    @field_validator("*", mode="before")
    @classmethod
    def _parse(cls, value: Any, info: ValidationInfo) -> Any:
        setting = SETTINGS_BY_NAME[str(info.field_name)]
        if setting.everywhere and isinstance(value, str):
            # A WICK_* variable's text: read as every command reads it (a negated bool too).
            return setting.from_env_text(value)
        parse = setting.parse
        if parse is None or value is None or isinstance(value, bool):
            return value
        return parse(value)

    @field_validator("*")
    @classmethod
    def _check(cls, value: Any, info: ValidationInfo) -> Any:
        check = SETTINGS_BY_NAME[str(info.field_name)].check
        if check is not None and value is not None:
            check(value)
        return value

    @model_validator(mode="after")
    def _check_device_count(self) -> ServerSettings:
        check_device_count(parse_device_ids(self.device_ids), self.tensor_parallel_size)
        return self

    @property
    def model_names(self) -> list[str]:
        """The names requests may use, the one responses report first (--served-model-name's
        aliases; one name without it)."""
        return served_model_names(self.served_model_name) or [self.model or DEFAULT_MODEL_NAME]

    @property
    def model_name(self) -> str:
        """The name responses, /metrics and the first /v1/models card report."""
        return self.model_names[0]

    @property
    def api_key_value(self) -> str | None:
        return self.api_key.get_secret_value() if self.api_key is not None else None

    def engine_config(self) -> EngineConfig:
        return EngineConfig.from_attrs(self)


def env_names(field_name: str) -> list[str]:
    """The environment variables that set `field_name` (for --help)."""
    return list(SETTINGS_BY_NAME[field_name].env_names)
