"""Incremental detokenization and stop-string matching for one generated sequence."""

from __future__ import annotations

from dataclasses import dataclass, field

# Decoding resumes from this many tokens before the unread ones, so that merges across the
# boundary (leading spaces, multi-token characters) decode as they would in the full text.
_CONTEXT_TOKENS = 5


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one delta at a time.

    Invariant: `text` is the decode of every token consumed so far, except that a trailing
    incomplete UTF-8 sequence (decoded as U+FFFD) is held back until the tokens that complete
    it arrive, so a multi-byte character is never split across deltas.
    """

    tokenizer: object
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Consume tokens; returns the text they completed (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        decode = self.tokenizer.decode
        prefix = decode(
            self.token_ids[self.prefix_offset : self.read_offset],
            skip_special_tokens=self.skip_special_tokens,
        )
        full = decode(
            self.token_ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens
        )
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.text += delta
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(self.read_offset - _CONTEXT_TOKENS, 0)
        return delta


def find_stop_string(
    text: str, stop: list[str], new_chars: int, include_stop_str: bool
) -> tuple[str, int] | None:
    """Look for a stop string that may overlap the last `new_chars` characters of `text`.

    Returns (stop string, length to truncate `text` to) for the earliest match, or None.
    """
    if not stop or new_chars <= 0:
        return None
    best: tuple[str, int] | None = None
    best_pos = len(text) + 1
    for s in stop:
        # Only a match ending in the new characters is new; earlier text was checked already.
        start = max(len(text) - new_chars - len(s) + 1, 0)
        pos = text.find(s, start)
        if pos != -1 and pos < best_pos:
            best_pos = pos
            best = (s, pos + len(s) if include_stop_str else pos)
    return best
