"""Model-server settings: the environment (`LLM_*`, plus OPEA's aliases), overridden by CLI flags.

One name per setting everywhere (native, compose, helm); see DESIGN.md. Where two environment
names are given, the `LLM_*` one wins over the OPEA alias. Empty variables count as unset, so a
compose file can pass `LLM_MAX_MODEL_LEN=` through without breaking anything.
"""

from __future__ import annotations

from typing import Any

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from model_server.config import EngineConfig, parse_device_ids, parse_quantization, parse_size

# The served name of the embedded default model (its Hugging Face id).
DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _env(*names: str) -> Any:
    return AliasChoices(*names)


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(
        populate_by_name=True,  # CLI flags pass field names; the environment uses the aliases
        env_ignore_empty=True,
        extra="ignore",
        case_sensitive=False,
    )

    # --- what to serve
    model: str | None = Field(
        None,
        validation_alias=_env("LLM_MODEL", "LLM_VLLM_MODEL_NAME"),
        description="HF folder, .gguf file or hub id; unset: the embedded SmolLM2-135M-Instruct.",
    )
    served_model_name: str | None = Field(
        None,
        validation_alias=_env("LLM_SERVED_MODEL_NAME"),
        description="The model name clients send; default: --model, or the embedded model's id.",
    )
    load_format: str = Field("auto", validation_alias=_env("LLM_LOAD_FORMAT"))
    device: str = Field("cpu", validation_alias=_env("LLM_DEVICE"))
    device_ids: str | None = Field(None, validation_alias=_env("LLM_DEVICE_IDS"))
    dtype: str = Field("auto", validation_alias=_env("LLM_DTYPE", "VLLM_DTYPE"))
    seed: int = Field(0, validation_alias=_env("LLM_SEED"))
    quantization: str | None = Field(None, validation_alias=_env("LLM_QUANTIZATION"))
    kv_cache_dtype: str = Field("auto", validation_alias=_env("LLM_KV_CACHE_DTYPE"))
    tensor_parallel_size: int = Field(1, validation_alias=_env("LLM_TP_SIZE", "VLLM_TP_SIZE"))

    # --- engine limits
    max_model_len: int | None = Field(None, validation_alias=_env("LLM_MAX_MODEL_LEN"))
    max_num_seqs: int = Field(256, validation_alias=_env("LLM_MAX_NUM_SEQS", "VLLM_MAX_NUM_SEQS"))
    max_num_batched_tokens: int = Field(2048, validation_alias=_env("LLM_MAX_NUM_BATCHED_TOKENS"))
    block_size: int = Field(16, validation_alias=_env("LLM_BLOCK_SIZE"))
    # Bytes. Accepts sizes like "2GiB"; a bare number is GiB (so VLLM_CPU_KVCACHE_SPACE=40 works).
    kv_cache_memory: int | None = Field(
        None, validation_alias=_env("LLM_KV_CACHE_MEMORY", "VLLM_CPU_KVCACHE_SPACE")
    )
    enable_prefix_caching: bool = Field(True, validation_alias=_env("LLM_ENABLE_PREFIX_CACHING"))
    enable_chunked_prefill: bool = Field(True, validation_alias=_env("LLM_ENABLE_CHUNKED_PREFILL"))
    attention_backend: str | None = Field(None, validation_alias=_env("LLM_ATTENTION_BACKEND"))
    enforce_eager: bool = Field(False, validation_alias=_env("LLM_ENFORCE_EAGER"))
    gpu_memory_utilization: float = Field(0.9, validation_alias=_env("LLM_GPU_MEMORY_UTILIZATION"))
    num_threads: int | None = Field(None, validation_alias=_env("LLM_NUM_THREADS"))

    # --- server
    host: str = Field("0.0.0.0", validation_alias=_env("LLM_HOST"))
    port: int = Field(8008, validation_alias=_env("LLM_MODEL_SERVER_PORT", "LLM_VLLM_PORT"))
    api_key: SecretStr | None = Field(None, validation_alias=_env("LLM_API_KEY"))
    skip_warmup: bool = Field(False, validation_alias=_env("LLM_SKIP_WARMUP", "VLLM_SKIP_WARMUP"))
    # Seconds in-flight requests get to finish after SIGTERM/SIGINT before they are aborted.
    drain_timeout: float = Field(30.0, validation_alias=_env("LLM_DRAIN_TIMEOUT"))
    log_level: str = Field("info", validation_alias=_env("LLM_LOG_LEVEL"))
    access_log: bool = Field(True, validation_alias=_env("LLM_ACCESS_LOG"))

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _parse_size(cls, value: Any) -> Any:
        if value is None or isinstance(value, bool):
            return value
        return parse_size(value)

    @field_validator("tensor_parallel_size")
    @classmethod
    def _check_tp(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {value}")
        return value

    @field_validator("device_ids")
    @classmethod
    def _check_device_ids(cls, value: str | None) -> str | None:
        parse_device_ids(value)
        return value

    @field_validator("quantization")
    @classmethod
    def _check_quantization(cls, value: str | None) -> str | None:
        parse_quantization(value)  # which device supports it is checked when the engine starts
        return value

    @field_validator("kv_cache_dtype")
    @classmethod
    def _check_kv_cache_dtype(cls, value: str) -> str:
        if value.lower() != "auto":
            raise ValueError(f"kv_cache_dtype {value!r} is not supported yet; use auto")
        return value

    @field_validator("port")
    @classmethod
    def _check_port(cls, value: int) -> int:
        if not 0 <= value <= 65535:
            raise ValueError(f"port must be in 0-65535, got {value}")
        return value

    @field_validator("drain_timeout")
    @classmethod
    def _check_drain_timeout(cls, value: float) -> float:
        if value < 0:
            raise ValueError(f"drain_timeout must be non-negative, got {value}")
        return value

    @property
    def model_name(self) -> str:
        """The name clients use in requests and see in /v1/models."""
        return self.served_model_name or self.model or DEFAULT_MODEL_NAME

    @property
    def api_key_value(self) -> str | None:
        return self.api_key.get_secret_value() if self.api_key is not None else None

    def engine_config(self) -> EngineConfig:
        return EngineConfig.from_attrs(self)


def env_names(field_name: str) -> list[str]:
    """The environment variables that set `field_name` (for --help)."""
    alias = ServerSettings.model_fields[field_name].validation_alias
    if isinstance(alias, AliasChoices):
        return [str(c) for c in alias.choices]
    return [str(alias)] if alias else []
