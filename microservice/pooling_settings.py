"""Settings of the embedding (:6000) and reranking (:8000) microservices, from the environment.

Each has its own names (`EMBEDDING_*`, `RERANKING_*`) so that one `.env` configures the whole
RAG stack; OPEA's `TEI_EMBEDDING_ENDPOINT` / `TEI_RERANKING_ENDPOINT` are accepted as aliases of
the model server endpoints, so an OPEA `.env` works. `LLM_API_KEY` is the model servers' key, as
for the LLM microservice. Empty variables count as unset.
"""

from __future__ import annotations

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

_CONFIG = SettingsConfigDict(
    populate_by_name=True, env_ignore_empty=True, extra="ignore", case_sensitive=False
)


class _PoolingServiceSettings(BaseSettings):
    api_key: SecretStr | None = Field(None, validation_alias=AliasChoices("LLM_API_KEY"))
    connect_timeout: float = Field(
        1.5, gt=0, validation_alias=AliasChoices("LLM_MODEL_SERVER_CONNECT_TIMEOUT")
    )
    read_timeout: float = Field(
        300.0, gt=0, validation_alias=AliasChoices("LLM_MODEL_SERVER_READ_TIMEOUT")
    )
    health_cache_seconds: float = Field(
        3.0, ge=0, validation_alias=AliasChoices("LLM_HEALTH_CHECK_CACHE_SECONDS")
    )

    @property
    def api_key_value(self) -> str | None:
        return self.api_key.get_secret_value() if self.api_key else None


class EmbeddingSettings(_PoolingServiceSettings):
    model_config = _CONFIG

    host: str = Field("0.0.0.0", validation_alias=AliasChoices("EMBEDDING_USVC_HOST"))
    port: int = Field(6000, validation_alias=AliasChoices("EMBEDDING_USVC_PORT"))
    model_server_endpoint: str = Field(
        "http://localhost:8009",
        validation_alias=AliasChoices("EMBEDDING_MODEL_SERVER_ENDPOINT", "TEI_EMBEDDING_ENDPOINT"),
    )
    model_name: str | None = Field(None, validation_alias=AliasChoices("EMBEDDING_MODEL_NAME"))


class RerankingSettings(_PoolingServiceSettings):
    model_config = _CONFIG

    host: str = Field("0.0.0.0", validation_alias=AliasChoices("RERANKING_USVC_HOST"))
    port: int = Field(8000, validation_alias=AliasChoices("RERANKING_USVC_PORT"))
    model_server_endpoint: str = Field(
        "http://localhost:8010",
        validation_alias=AliasChoices("RERANKING_MODEL_SERVER_ENDPOINT", "TEI_RERANKING_ENDPOINT"),
    )
    model_name: str | None = Field(None, validation_alias=AliasChoices("RERANKING_MODEL_NAME"))
