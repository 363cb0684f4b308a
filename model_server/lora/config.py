"""The LoRA settings as the engine uses them (from EngineConfig's flags)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from model_server.lora.request import LoRARequest
from model_server.settings_spec import parse_lora_modules

if TYPE_CHECKING:
    from model_server.config import EngineConfig


@dataclass(slots=True, frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry: an adapter served from the start."""

    name: str
    path: str
    base_model_name: str | None = None


@dataclass(slots=True, frozen=True)
class LoRAConfig:
    """`max_loras` device slots (adapters one step may use), `max_lora_rank` their width,
    `max_cpu_loras` adapters kept in host memory (>= max_loras)."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    modules: tuple[LoRAModulePath, ...] = ()

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> LoRAConfig | None:
        """None without --enable-lora (EngineConfig.validate refuses LoRA flags then)."""
        if not config.enable_lora:
            return None
        text = parse_lora_modules(config.lora_modules)
        modules = tuple(LoRAModulePath(**entry) for entry in json.loads(text or "[]"))
        return cls(
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
            max_cpu_loras=max(config.max_cpu_loras or config.max_loras, config.max_loras),
            modules=modules,
        )

    def static_requests(self) -> list[LoRARequest]:
        """The `--lora-modules` adapters as requests: ids 1, 2, ... in flag order (the engine
        loads them at startup and the server registers their names with the same ids)."""
        return [
            LoRARequest(m.name, i + 1, m.path, m.base_model_name)
            for i, m in enumerate(self.modules)
        ]
