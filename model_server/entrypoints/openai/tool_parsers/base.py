"""What a tool parser does: find a model's tool calls in its output text, and render tools and
earlier calls into a prompt for chat templates that do not know tools themselves.

A parser names the markers that open its tool-call section (`markers`) and turns that section into
calls (`parse_section`). Everything else, non-streamed and streamed, is shared here, so that
streamed deltas always reassemble to the non-streamed answer:

  - no marker, or a section that does not parse: the whole text is the content, unchanged;
  - otherwise the content is the text before the first marker with its trailing whitespace
    dropped (None when nothing is left), and the calls are those of the section.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ParsedToolCall:
    name: str
    # The arguments as a JSON text (OpenAI's `function.arguments`).
    arguments: str


@dataclass(slots=True)
class ExtractedToolCalls:
    content: str | None
    calls: list[ParsedToolCall]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def arguments_text(arguments: Any) -> str:
    """A call's arguments as OpenAI sends them: a JSON text of an object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)


def call_from_object(obj: Any, arguments_keys: Sequence[str]) -> ParsedToolCall | None:
    """`{"name": ..., "<arguments key>": {...}}` as a call; None for any other value."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments: Any = {}
    for key in arguments_keys:
        if key in obj:
            arguments = obj[key]
            break
    if not isinstance(arguments, dict | str):
        return None
    return ParsedToolCall(obj["name"], arguments_text(arguments))


def json_values(text: str, separators: str = " \t\r\n,;") -> tuple[list[Any], bool]:
    """The complete JSON values at the start of `text`, one after another with `separators`
    between them, and whether the whole text was consumed (False: an unfinished or broken tail)."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos] in separators:
            pos += 1
        if pos == len(text):
            return values, True
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return values, False
        values.append(value)


class ToolParser(ABC):
    """One model family's tool-call format."""

    name: str
    # Texts that open the tool-call section; `at_start_only`: only as the first non-space text.
    markers: tuple[str, ...]
    at_start_only: bool = False

    @abstractmethod
    def parse_section(self, section: str, final: bool) -> list[ParsedToolCall] | None:
        """The calls in `section` (from the marker on). `final=False` (streaming): the calls
        complete so far, an unfinished one left out. `final=True`: every call, or None when
        the section does not parse as this format."""

    # ---- prompts, for chat templates that know nothing of tools -------------------------

    @abstractmethod
    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        """A system-prompt text that describes `tools` (OpenAI's tool objects) and the format."""

    @abstractmethod
    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """An assistant turn's calls (`{"name", "arguments": dict}`) as this model writes them."""

    def render_result(self, content: str) -> str:
        """A tool's answer, as the user-turn text that carries it back."""
        return f"<tool_response>\n{content}\n</tool_response>"

    # ---- shared -----------------------------------------------------------------------

    def find_section(self, text: str) -> int | None:
        """Where the tool-call section starts in `text`, or None."""
        if self.at_start_only:
            stripped = len(text) - len(text.lstrip())
            rest = text[stripped:]
            return stripped if any(rest.startswith(m) for m in self.markers) else None
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def held_back(self, text: str) -> int:
        """How many characters at the end of `text` (which has no section) must not be streamed
        as content yet: a possible start of a marker, and trailing whitespace (dropped if a
        section follows)."""
        if self.at_start_only:
            rest = text.lstrip()
            if not rest:
                return len(text)
            return len(text) if any(m.startswith(rest) for m in self.markers) else 0
        keep = 0
        for marker in self.markers:
            for n in range(min(len(marker) - 1, len(text)), 0, -1):
                if marker.startswith(text[-n:]):
                    keep = max(keep, n)
                    break
        body = text[: len(text) - keep]
        return keep + (len(body) - len(body.rstrip()))

    def extract(self, text: str) -> ExtractedToolCalls:
        """The non-streamed answer: content and calls of the whole output."""
        start = self.find_section(text)
        if start is None:
            return ExtractedToolCalls(text, [])
        calls = self.parse_section(text[start:], final=True)
        if not calls:
            return ExtractedToolCalls(text, [])
        content = text[:start].rstrip()
        return ExtractedToolCalls(content or None, calls)
