"""Tool parsers: each family's format read into calls, text without calls left whole, and the
streamed content and calls reassembling to the non-streamed answer however the text is split."""

from __future__ import annotations

import json
import random

import pytest

from model_server.entrypoints.openai.tool_parsers import (
    ToolCallStream,
    detect_tool_parser,
    get_tool_parser,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "UTC"}}'

CASES = {
    "hermes": [
        (f"<tool_call>\n{WEATHER}\n</tool_call>", None, ["get_weather"]),
        (
            f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{TIME}</tool_call>",
            "Let me check.",
            ["get_weather", "get_time"],
        ),
        (f"<tool_call>\n{WEATHER}", None, ["get_weather"]),  # stopped before closing
        ("Plain answer, no tools.", "Plain answer, no tools.", []),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ("a < b and <tool_ is not a call", "a < b and <tool_ is not a call", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, ["get_weather"]),
        (
            '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
            None,
            ["a", "b"],
        ),
        ('{"answer": 42}', '{"answer": 42}', []),
        ("The weather is nice.", "The weather is nice.", []),
    ],
    "mistral": [
        (f"[TOOL_CALLS] [{WEATHER}, {TIME}]", None, ["get_weather", "get_time"]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, ["get_weather"]),
        ("Sure. [TOOL_CALLS] [" + WEATHER + "]", "Sure.", ["get_weather"]),
        ("No call here.", "No call here.", []),
    ],
}


@pytest.mark.parametrize(
    ("parser_name", "text", "content", "names"),
    [(p, *case) for p, cases in CASES.items() for case in cases],
)
def test_extract(parser_name: str, text: str, content: str | None, names: list[str]) -> None:
    parser = get_tool_parser(parser_name, None)
    result = parser.extract(text)
    assert result.content == content
    assert [c.name for c in result.calls] == names
    for call in result.calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize(
    ("parser_name", "text"), [(p, case[0]) for p, cases in CASES.items() for case in cases]
)
def test_streaming_reassembles_to_extract(parser_name: str, text: str) -> None:
    parser = get_tool_parser(parser_name, None)
    whole = parser.extract(text)
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(6, len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream = ToolCallStream(parser)
        content, calls = "", []
        for piece in pieces:
            c, new = stream.feed(piece)
            content, calls = content + c, calls + new
        c, new = stream.finish()
        content, calls = content + c, calls + new
        assert (content or None) == whole.content
        assert calls == whole.calls


def test_detect_and_unknown() -> None:
    assert detect_tool_parser(None) == "hermes"
    assert detect_tool_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_tool_parser("<|python_tag|>") == "llama3_json"
    with pytest.raises(ValueError, match="unknown tool call parser 'x'"):
        get_tool_parser("x", None)
