"""The grammar engine behind structured outputs, behind a small interface: compile a constraint
once, then one matcher per request that accepts tokens and fills its row of the token bitmask.

The engine is xgrammar (xgrammar_backend.py; docs/structured_outputs.md has the measurements that
chose it over llguidance); manager.py imports it on first use only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from model_server.structured_output.params import StructuredOutputsParams


class GrammarMatcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by `token_id`; False (state unchanged) when the grammar forbids it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` ([R, ceil(V / 32)] int32)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start of the grammar."""


class GrammarBackend(ABC):
    name: str

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (thread-safe); StructuredOutputError when it cannot be built."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher: ...
