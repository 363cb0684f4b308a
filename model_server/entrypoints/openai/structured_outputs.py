"""A request's output constraint, from whichever field it came in: OpenAI's `response_format`
(chat), vLLM's `structured_outputs` or its older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` (both endpoints), or a forced tool call (tool_calls.py).

At most one field may constrain a request: two are a 400 naming both, never a silent choice.
"""

from __future__ import annotations

from typing import Any

from model_server.entrypoints.openai.protocol import APIError, ResponseFormat
from model_server.structured_output.params import StructuredOutputError, StructuredOutputsParams


def request_constraints(request: Any) -> list[tuple[str, dict[str, Any]]]:
    """(field, StructuredOutputsParams kwargs) for each constraining field the request set."""
    found: list[tuple[str, dict[str, Any]]] = []
    so = request.structured_outputs
    if so is not None:
        dumped = so.model_dump(by_alias=True)
        kwargs = {k: v for k, v in dumped.items() if v is not None and v is not False}
        found.append(("structured_outputs", kwargs))
    for name, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(request, name)
        if value is not None:
            found.append((name, {key: value}))
    fmt: ResponseFormat | None = getattr(request, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None  # checked by ResponseFormat
        found.append(("response_format", {"json": fmt.json_schema.json_schema}))
    return found


def build_structured_outputs(
    constraints: list[tuple[str, dict[str, Any]]],
) -> StructuredOutputsParams | None:
    """The one constraint of a request, checked (a bad schema is a 400 naming its field)."""
    if not constraints:
        return None
    if len(constraints) > 1:
        names = " and ".join(name for name, _ in constraints)
        raise APIError(
            f"{names} both constrain the output: send only one of them",
            400,
            param=constraints[1][0],
        )
    param, kwargs = constraints[0]
    try:
        return StructuredOutputsParams(**kwargs, param=param)
    except StructuredOutputError as exc:
        raise APIError(f"{param}: {exc}", 400, param=param) from None
