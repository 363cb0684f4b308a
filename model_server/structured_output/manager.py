"""Compiled grammars, cached per constraint, and the per-request grammar state.

`StructuredOutputManager.compile` is the one thread-safe entry: the server calls it on a worker
thread before a request reaches the engine (a compile never runs inside an engine step, and an
uncompilable grammar is a 400 before any token), and the engine thread calls `new_grammar` when
it adds the request, which then only finds the compiled grammar in the cache. Each request (each
of the `n` samples) gets its own matcher: `RequestGrammar`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from model_server.structured_output.backend import GrammarBackend, GrammarMatcher
from model_server.structured_output.params import (
    GrammarKey,
    ReasoningGate,
    StructuredOutputsParams,
)

logger = logging.getLogger(__name__)

# Compiled grammars kept (least recently used dropped first). A compiled JSON schema is tens of
# kilobytes to a few megabytes; agents reuse a handful of schemas.
DEFAULT_CACHE_SIZE = 256


def load_backend(tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> GrammarBackend:
    """The grammar engine for this tokenizer and the model's vocabulary size."""
    from model_server.structured_output.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(tokenizer, vocab_size, eos_token_id)


@dataclass(slots=True)
class RequestGrammar:
    """One request's matcher and how many of its output tokens it has consumed.

    With a `reasoning` gate the grammar waits for the thinking to end: `maybe` (the first token
    may open it: the grammar's tokens and `<think>` are allowed), `thinking` (every token is
    allowed until `</think>`), then `grammar`."""

    matcher: GrammarMatcher
    num_accepted: int = 0
    reasoning: ReasoningGate | None = None
    phase: Literal["maybe", "thinking", "grammar"] = "grammar"

    def __post_init__(self) -> None:
        self.phase = self._first_phase()

    def _first_phase(self) -> Literal["maybe", "thinking", "grammar"]:
        gate = self.reasoning
        if gate is None:
            return "grammar"
        if gate.starts_thinking:
            return "thinking"
        return "maybe" if gate.start_id is not None else "grammar"

    def accept_token(self, token_id: int) -> bool:
        gate = self.reasoning
        if self.phase == "maybe":
            assert gate is not None
            if token_id == gate.start_id:
                self.phase = "thinking"
                self.num_accepted += 1
                return True
            self.phase = "grammar"
        elif self.phase == "thinking":
            assert gate is not None
            if token_id == gate.end_id:
                self.phase = "grammar"
            self.num_accepted += 1
            return True
        ok = self.matcher.accept_token(token_id)
        if ok:
            self.num_accepted += 1
        return ok

    @property
    def is_terminated(self) -> bool:
        return self.phase == "grammar" and self.matcher.is_terminated()

    def sync(self, output_token_ids: list[int]) -> None:
        """Make the matcher's state that of `output_token_ids` (rebuild by replay when they
        differ in count, e.g. if a step's tokens were ever dropped); a no-op normally."""
        if self.num_accepted == len(output_token_ids):
            return
        self.matcher.reset()
        self.num_accepted = 0
        self.phase = self._first_phase()
        for token_id in output_token_ids:
            if not self.accept_token(token_id):
                break

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        if self.phase == "thinking":
            bitmask[row].fill_(-1)  # every token allowed
            return
        self.matcher.fill_bitmask(bitmask, row)
        if self.phase == "maybe":
            assert self.reasoning is not None and self.reasoning.start_id is not None
            word, bit = divmod(self.reasoning.start_id, 32)
            if word < bitmask.shape[1]:
                value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
                bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


class StructuredOutputManager:
    """The grammar engine for one tokenizer and vocabulary, and its compile cache."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_id: int | None,
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        backend_factory: Callable[[Any, int, int | None], GrammarBackend] = load_backend,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_id = eos_token_id
        self._cache_size = cache_size
        self._backend_factory = backend_factory
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()
        # Finished and in-flight compiles: a second request for a schema being compiled waits
        # for the first compile instead of starting its own.
        self._cache: OrderedDict[GrammarKey, Future[Any]] = OrderedDict()
        self.num_compiles = 0
        self.compile_seconds = 0.0

    @property
    def backend(self) -> GrammarBackend:
        """The grammar engine, built on first use (it preprocesses the vocabulary once)."""
        with self._lock:
            if self._backend is None:
                if self._tokenizer is None:
                    raise ValueError("structured outputs need a tokenizer; this model has none")
                self._backend = self._backend_factory(
                    self._tokenizer, self.vocab_size, self._eos_token_id
                )
            return self._backend

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of `params` (cached). Thread-safe. Raises
        StructuredOutputError naming `params.param` when it cannot be compiled."""
        backend = self.backend
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            owner = future is None
            if owner:
                future = Future()
                self._cache[key] = future
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if not owner:
            return future.result()
        start = time.perf_counter()
        try:
            compiled = backend.compile(params)
        except BaseException as exc:
            with self._lock:  # failures are not cached: the next request gets a fresh try
                if self._cache.get(key) is future:
                    del self._cache[key]
            future.set_exception(exc)
            raise
        elapsed = time.perf_counter() - start
        with self._lock:
            self.num_compiles += 1
            self.compile_seconds += elapsed
        logger.debug("compiled %s grammar in %.1f ms", key[0], elapsed * 1000)
        future.set_result(compiled)
        return compiled

    def new_grammar(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher for one request (engine thread)."""
        matcher = self.backend.matcher(self.compile(params))
        return RequestGrammar(matcher, reasoning=params.reasoning)
