"""Reasoning models: the thinking between `<think>` and `</think>` in the output goes to
`reasoning_content` (and vLLM's newer `reasoning`, the same text) instead of `content`.

`--reasoning-parser` picks the parser (vLLM's names):

- `deepseek_r1`: DeepSeek-R1's chat template opens `<think>` in the prompt, so the output starts
  inside the thinking and everything up to the first `</think>` is reasoning (a `<think>` the
  model writes first anyway is dropped).
- `qwen3`: the model writes `<think>` itself (Qwen3's template), or the template opened it at the
  end of the prompt (Qwen3-2507 thinking, enable_thinking): the output starts inside thinking
  when the prompt ends with an open `<think>`, else thinking begins only if the output does
  (after whitespace) with `<think>`; otherwise it is all content.
- `auto`: from the chat template: one that writes `<think>` picks deepseek_r1 (DeepSeek's role
  markers) or qwen3; any other template none.

A request with `enable_thinking: false` (top level or in `chat_template_kwargs`) is not split:
its template closes the thinking in the prompt, or the model was asked not to think.

The split is one state machine for whole answers and streams alike, so both give the same texts:
a tag cut across chunks is held back until it is known not to be one. After the first `</think>`
everything is content (a later `</think>` included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

THINK_START = "<think>"
THINK_END = "</think>"

# DeepSeek's chat templates (R1, V3) mark turns with fullwidth bars.
_DEEPSEEK_MARKER = "<｜Assistant｜>"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    # deepseek_r1: the output always starts inside the thinking.
    always_thinking: bool = False
    start: str = THINK_START
    end: str = THINK_END

    def starts_thinking(self, prompt_text: str) -> bool:
        """Whether the output starts inside the thinking: always for deepseek_r1, else when the
        prompt ends with an open `<think>` (the template opened it for the model)."""
        return self.always_thinking or prompt_text.rstrip().endswith(self.start)

    def stream(self, prompt_text: str) -> ReasoningStream:
        return ReasoningStream(self, "opening" if self.starts_thinking(prompt_text) else "start")

    def split(self, prompt_text: str, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole answer."""
        stream = self.stream(prompt_text)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning) or None, content + more_content


PARSERS = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", always_thinking=True),
}


def get_reasoning_parser(name: str | None, chat_template: str | None) -> ReasoningParser | None:
    """The parser `--reasoning-parser` names; for `auto`, the one the chat template implies."""
    if name in (None, "", "none"):
        return None
    if name != "auto":
        return PARSERS[name]
    template = chat_template or ""
    if THINK_START not in template:
        return None
    return PARSERS["deepseek_r1" if _DEEPSEEK_MARKER in template else "qwen3"]


def thinking_disabled(template_kwargs: dict[str, Any]) -> bool:
    """`enable_thinking: false` (Qwen3's template argument, the request's shortcut)."""
    return template_kwargs.get("enable_thinking") is False


State = Literal["start", "opening", "reasoning", "content"]


@dataclass(slots=True)
class ReasoningStream:
    """One answer's text, fed piece by piece: `feed(delta)` -> (reasoning, content) pieces.

    States: `start` (may the output open thinking? held while it is whitespace and a prefix of
    `<think>`), `opening` (inside thinking; a leading `<think>` is dropped), `reasoning` (up to
    `</think>`, a possible partial tag held back), `content` (everything else, as it comes)."""

    parser: ReasoningParser
    state: State
    _held: str = ""

    def feed(self, delta: str) -> tuple[str, str]:
        if self.state == "content":
            return "", delta
        text = self._held + delta
        self._held = ""
        if self.state in ("start", "opening"):
            stripped = text.lstrip()
            start = self.parser.start
            if stripped.startswith(start):
                text = stripped[len(start) :]
            elif start.startswith(stripped):
                self._held = text  # whitespace or a piece of `<think>`: not yet known
                return "", ""
            elif self.state == "start":
                self.state = "content"
                return "", text
            self.state = "reasoning"
        end = self.parser.end
        at = text.find(end)
        if at >= 0:
            self.state = "content"
            return text[:at], text[at + len(end) :]
        keep = _partial_suffix(text, end)
        if keep:
            self._held = text[-keep:]
            text = text[:-keep]
        return text, ""

    def finish(self) -> tuple[str, str]:
        """What is still held at the end of the answer."""
        held, self._held = self._held, ""
        if self.state == "reasoning":
            return held, ""
        if self.state == "opening":  # only whitespace or a piece of `<think>` came
            return held.lstrip(), ""
        return "", held

    @property
    def in_content(self) -> bool:
        return self.state == "content"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """The token id of `text` when the tokenizer has it as one token (Qwen3's and DeepSeek-R1's
    `<think>` / `</think>` are), else None."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception:
        return None
    return ids[0] if len(ids) == 1 else None
