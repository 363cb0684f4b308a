"""The reasoning split on its own: whole answers and streams cut at every place give the same
(reasoning, content); the parsers `auto` picks; the grammar gate of structured outputs."""

from __future__ import annotations

import pytest
import torch

from model_server.entrypoints.openai.reasoning_parsers import (
    PARSERS,
    get_reasoning_parser,
    thinking_disabled,
)
from model_server.structured_output.manager import RequestGrammar
from model_server.structured_output.params import ReasoningGate

QWEN3 = PARSERS["qwen3"]
R1 = PARSERS["deepseek_r1"]
OPEN = "<|im_start|>assistant\n<think>\n"  # a template that opened the thinking
PLAIN = "<|im_start|>assistant\n"

CASES = [
    # (parser, prompt, output, reasoning, content)
    (QWEN3, PLAIN, "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "\n\nParis."),
    (QWEN3, PLAIN, "  <think>a</think>b", "a", "b"),
    (QWEN3, PLAIN, "Paris.", None, "Paris."),
    (QWEN3, PLAIN, "Paris </think> x", None, "Paris </think> x"),
    (QWEN3, PLAIN, "<thin", None, "<thin"),
    (QWEN3, PLAIN, "<think>still thinking", "still thinking", ""),
    (QWEN3, OPEN, "Let me see.</think>Paris.", "Let me see.", "Paris."),
    (QWEN3, OPEN, "a</think>b</think>c", "a", "b</think>c"),
    (QWEN3, OPEN, "thinking to the end </thi", "thinking to the end </thi", ""),
    (R1, PLAIN, "Let me see.</think>Paris.", "Let me see.", "Paris."),
    (R1, PLAIN, "<think>Let me see.</think>Paris.", "Let me see.", "Paris."),
    (R1, PLAIN, "no end at all", "no end at all", ""),
    (R1, PLAIN, "</think>Paris.", None, "Paris."),
    (R1, PLAIN, "", None, ""),
]


@pytest.mark.parametrize(("parser", "prompt", "output", "reasoning", "content"), CASES)
def test_whole_answers(parser, prompt, output, reasoning, content) -> None:
    assert parser.split(prompt, output) == (reasoning, content)


def _streamed(parser, prompt: str, pieces: list[str]) -> tuple[str, str]:
    stream = parser.stream(prompt)
    reasoning, content = "", ""
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(("parser", "prompt", "output", "reasoning", "content"), CASES)
def test_streams_cut_anywhere_give_the_whole_answer(
    parser, prompt, output, reasoning, content
) -> None:
    expected = (reasoning or "", content)
    assert _streamed(parser, prompt, list(output)) == expected  # one character at a time
    for cut in range(len(output) + 1):  # and in two pieces, at every place
        assert _streamed(parser, prompt, [output[:cut], output[cut:]]) == expected


def test_a_tag_cut_across_chunks_is_held_back_not_leaked() -> None:
    stream = QWEN3.stream(OPEN)
    assert stream.feed("I think </th") == ("I think ", "")
    assert stream.feed("ink>The") == ("", "The")
    assert stream.feed(" answer") == ("", " answer")
    stream = QWEN3.stream(PLAIN)
    assert stream.feed("\n<thi") == ("", "")
    assert stream.feed("nk>hm") == ("hm", "")
    stream = QWEN3.stream(PLAIN)
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("s is content") == ("", "<this is content")


def test_auto_picks_from_the_chat_template() -> None:
    assert get_reasoning_parser("auto", "{{ '<|im_start|>' }}") is None
    assert get_reasoning_parser("auto", None) is None
    assert get_reasoning_parser("auto", "<|im_start|>assistant\n<think>\n") is QWEN3
    assert get_reasoning_parser("auto", "{{'<｜Assistant｜><think>\\n'}}") is R1
    assert get_reasoning_parser("none", "<think>") is None
    assert get_reasoning_parser(None, "<think>") is None
    assert get_reasoning_parser("qwen3", None) is QWEN3
    assert get_reasoning_parser("deepseek_r1", "") is R1


def test_enable_thinking_false_turns_the_split_off() -> None:
    assert thinking_disabled({"enable_thinking": False})
    assert not thinking_disabled({"enable_thinking": True})
    assert not thinking_disabled({})


# ---- the grammar gate: the grammar applies after </think> --------------------------------

START, END, VOCAB = 5, 6, 64


class FakeMatcher:
    """A grammar that accepts exactly the tokens 1, 2, 3 in that order (bitmask: the next one)."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept_token(self, token_id: int) -> bool:
        expected = [1, 2, 3][len(self.accepted)] if len(self.accepted) < 3 else None
        if token_id != expected:
            return False
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return len(self.accepted) == 3

    def reset(self) -> None:
        self.accepted = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].zero_()
        if len(self.accepted) < 3:
            token = [1, 2, 3][len(self.accepted)]
            bitmask[row, token // 32] = 1 << (token % 32)


def _allowed(grammar: RequestGrammar) -> set[int]:
    bitmask = torch.zeros((1, VOCAB // 32), dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0)
    return {t for t in range(VOCAB) if int(bitmask[0, t // 32]) >> (t % 32) & 1}


def test_the_grammar_waits_for_the_end_of_the_thinking() -> None:
    grammar = RequestGrammar(FakeMatcher(), reasoning=ReasoningGate(END, START, True))
    assert _allowed(grammar) == set(range(VOCAB))
    for token in (40, 41, START, 42):
        assert grammar.accept_token(token) and not grammar.is_terminated
        assert _allowed(grammar) == set(range(VOCAB))
    assert grammar.accept_token(END)
    assert _allowed(grammar) == {1}
    assert grammar.accept_token(1) and grammar.accept_token(2) and grammar.accept_token(3)
    assert grammar.is_terminated
    # A replay (sync after dropped tokens) starts inside the thinking again.
    grammar.sync([40, END, 1])
    assert grammar.phase == "grammar" and _allowed(grammar) == {2}


def test_the_first_token_may_open_the_thinking() -> None:
    grammar = RequestGrammar(FakeMatcher(), reasoning=ReasoningGate(END, START, False))
    assert _allowed(grammar) == {1, START}
    assert grammar.accept_token(START) and grammar.phase == "thinking"
    assert grammar.accept_token(40) and grammar.accept_token(END)
    assert _allowed(grammar) == {1}
    # Not opened: the grammar applies from the first token.
    grammar = RequestGrammar(FakeMatcher(), reasoning=ReasoningGate(END, START, False))
    assert grammar.accept_token(1) and grammar.phase == "grammar"
    assert not grammar.accept_token(START)


def test_bit_31_of_a_word_is_set_as_an_int32() -> None:
    grammar = RequestGrammar(FakeMatcher(), reasoning=ReasoningGate(END, 31, False))
    assert _allowed(grammar) == {1, 31}


def test_without_a_gate_the_grammar_applies_at_once() -> None:
    grammar = RequestGrammar(FakeMatcher())
    assert _allowed(grammar) == {1}
    assert not grammar.accept_token(40)
