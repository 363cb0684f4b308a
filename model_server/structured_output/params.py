"""What a request constrains its output to: vLLM's `StructuredOutputsParams`.

Exactly one of `json`, `regex`, `choice`, `grammar`, `json_object` is set. `param` names the
request field the constraint came from (`response_format`, `guided_json`, `tool_choice`, ...), so
that a schema or grammar the engine cannot compile is a 400 naming that field; it is not part of
the cache key. Pure Python: no grammar engine, no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# A compiled grammar is cached under (kind, canonical text).
GrammarKey = tuple[str, str]


class StructuredOutputError(ValueError):
    """A constraint that cannot be used (bad schema, uncompilable grammar): a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ReasoningGate:
    """A reasoning model's thinking comes before the constrained answer: the grammar applies only
    after the token `end_id` (`</think>`). The output starts inside the thinking
    (`starts_thinking`: the prompt opened it), or may open it with its first token, `start_id`
    (`<think>`; None: it cannot, the grammar applies from the first token)."""

    end_id: int
    start_id: int | None = None
    starts_thinking: bool = False


@dataclass(slots=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # The request field this came from (error messages only).
    param: str | None = field(default=None, compare=False)
    # Reasoning models: where the grammar starts (per request; not part of the cache key).
    reasoning: ReasoningGate | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("json_object", self.json_object or None),
            )
            if value is not None
        ]
        if len(given) != 1:
            what = ", ".join(given) if given else "none"
            raise StructuredOutputError(
                "structured outputs take exactly one of json, regex, choice, grammar or "
                f"json_object; got {what}",
                self.param,
            )
        if self.json is not None:
            self.json = _check_schema(self.json, self.param)
        if self.regex is not None and not self.regex:
            raise StructuredOutputError("the regex must not be empty", self.param)
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise StructuredOutputError(
                "choice must be a non-empty list of non-empty strings", self.param
            )
        if self.grammar is not None and not self.grammar.strip():
            raise StructuredOutputError("the grammar must not be empty", self.param)

    @property
    def key(self) -> GrammarKey:
        """The cache key: the same constraint compiles once, whichever field it came in."""
        if self.json is not None:
            return ("json", json.dumps(self.json, sort_keys=True, separators=(",", ":")))
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", json.dumps(self.choice))
        if self.grammar is not None:
            return ("grammar", self.grammar)
        return ("json_object", "")


def _check_schema(schema: str | dict[str, Any], param: str | None) -> dict[str, Any]:
    """The schema as a dict, checked against its JSON Schema metaschema (a clear message for a
    misspelt type or a bound that is not a number, before the grammar engine sees it)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise StructuredOutputError(
                f"the JSON schema is not valid JSON: {exc}", param
            ) from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise StructuredOutputError(
            f"the JSON schema must be an object, got {type(schema).__name__}", param
        )
    import jsonschema  # a small pure-Python dependency; imported on first use

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        at = f" at {where}" if where else ""
        raise StructuredOutputError(f"invalid JSON schema{at}: {exc.message}", param) from None
    return schema
