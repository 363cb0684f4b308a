"""JSON from peers this service does not trust: its clients, and a model server that may answer
anything. `loads` turns every way a text can fail into `JSONProblem` (a ValueError), so no input
reaches a handler as a RecursionError or an unencodable string.

Lone surrogates (a JSON escape such as "\\ud800" with no partner) are replaced by U+FFFD, as
WHATWG's conversion to scalar values does, instead of refusing the text: a JavaScript text
splitter can cut a surrogate pair in a retrieved document, and one broken character should not
fail a RAG request. Left in, they make any later UTF-8 encoding raise (httpx's request body,
every JSON answer).
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

# Deepest nesting accepted. Real requests stay far below it (a tool's JSON schema nested 20
# objects deep is about 45 levels); it keeps every later walk of the data (pydantic, json.dumps
# of the upstream request) well inside Python's recursion limit.
MAX_DEPTH = 128

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# UTF-8 cannot encode a surrogate, so a JSON text holds one only as a \uD800-\uDFFF escape:
# texts without such an escape skip the walk that replaces them.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class JSONProblem(ValueError):
    """Why a JSON text was refused, worded to follow its subject ("the request body ...")."""


def loads(raw: bytes | str) -> Any:
    """The value of a UTF-8 JSON text, with finite numbers only, at most MAX_DEPTH deep, lone
    surrogates replaced by U+FFFD. Raises JSONProblem."""
    text = _decode(raw) if isinstance(raw, bytes) else raw
    try:
        data = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except JSONProblem:
        raise
    except RecursionError:
        raise JSONProblem(f"nests JSON deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        raise JSONProblem(
            f"is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        ) from None
    except ValueError:  # int(): a literal longer than Python converts
        limit = sys.get_int_max_str_digits()
        raise JSONProblem(f"holds an integer of more than {limit} digits") from None
    # Fewer brackets than MAX_DEPTH cannot nest deeper than it: most texts skip the depth walk.
    deep = text.count("[") + text.count("{") > MAX_DEPTH
    scrub = _SURROGATE_ESCAPE.search(text) is not None
    return _walk(data, deep, scrub) if deep or scrub else data


def scrub(text: str) -> str:
    """`text` with every lone surrogate replaced by U+FFFD."""
    return _LONE_SURROGATE.sub("\ufffd", text)


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JSONProblem(f"is not valid UTF-8 (byte {exc.start})") from None


def _reject_constant(name: str) -> Any:
    # Python's json reads NaN/Infinity, which no later JSON encoding (httpx's, the answer's)
    # accepts.
    raise JSONProblem(f"is not valid JSON: {name} is not a JSON number (send a finite number)")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise JSONProblem(f"holds the number {literal}, which is out of range (send a finite one)")
    return value


def _walk(data: Any, deep: bool, scrub_strings: bool) -> Any:
    """Checks the depth (when `deep`) and scrubs every string, keys too (when `scrub_strings`),
    in place; iterative, so the walk itself cannot overflow the stack."""
    if isinstance(data, str):
        return scrub(data) if scrub_strings else data
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise JSONProblem(f"nests JSON deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict):
            if scrub_strings:
                cleaned = {_clean(k): _clean(v) for k, v in node.items()}
                node.clear()
                node.update(cleaned)
            children = node.values()
        else:
            if scrub_strings:
                node[:] = [_clean(v) for v in node]
            children = node
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return data


def _clean(value: Any) -> Any:
    return scrub(value) if isinstance(value, str) else value
