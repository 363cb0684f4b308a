"""Streamed tool calls: text deltas in, content deltas and completed calls out.

The rules of base.py hold for the stream as a whole: the content streamed is always a prefix of
the non-streamed content, and the calls streamed a prefix of its calls, so `finish()` only has
to send the rest. Content that might turn out to open a tool-call section (a partial marker,
trailing whitespace) is held back until the next delta says what it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model_server.entrypoints.openai.tool_parsers.base import ParsedToolCall, ToolParser


@dataclass(slots=True)
class ToolCallStream:
    parser: ToolParser
    text: str = ""
    # Characters of `text` already sent as content.
    num_sent: int = 0
    section_start: int | None = None
    calls_sent: list[ParsedToolCall] = field(default_factory=list)

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        """(content to send now, calls completed by this delta)."""
        self.text += delta
        content = ""
        if self.section_start is None:
            start = self.parser.find_section(self.text)
            if start is None:
                return self._send_upto(len(self.text) - self.parser.held_back(self.text)), []
            self.section_start = start
            content = self._send_upto(len(self.text[:start].rstrip()))
        calls = self.parser.parse_section(self.text[self.section_start :], final=False) or []
        new = calls[len(self.calls_sent) :]
        self.calls_sent.extend(new)
        return content, new

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """What is left to send once the output is complete."""
        result = self.parser.extract(self.text)
        if not result.calls:
            return self._send_upto(len(self.text)), []
        content = self._send_upto(len(result.content or ""))
        return content, result.calls[len(self.calls_sent) :]

    def _send_upto(self, end: int) -> str:
        if end <= self.num_sent:
            return ""
        piece = self.text[self.num_sent : end]
        self.num_sent = end
        return piece
