"""StructuredOutputsParams: one constraint, checked schemas, a cache key that ignores where the
constraint came from and how its JSON was spelled."""

from __future__ import annotations

import pytest

from model_server.structured_output.params import StructuredOutputError, StructuredOutputsParams


def test_exactly_one_constraint() -> None:
    with pytest.raises(StructuredOutputError, match=r"exactly one.*got none"):
        StructuredOutputsParams(param="structured_outputs")
    with pytest.raises(StructuredOutputError, match="got regex, choice") as info:
        StructuredOutputsParams(regex="a", choice=["a"], param="structured_outputs")
    assert info.value.param == "structured_outputs"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"json": {"type": "strin"}}, "invalid JSON schema at type"),
        ({"json": {"type": "integer", "minimum": "0"}}, "invalid JSON schema at minimum"),
        ({"json": "{nope"}, "not valid JSON"),
        ({"json": [1]}, "must be an object"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty list"),
        ({"regex": ""}, "must not be empty"),
        ({"grammar": "  "}, "must not be empty"),
    ],
)
def test_bad_constraints_say_what_is_wrong(kwargs: dict, words: str) -> None:
    with pytest.raises(StructuredOutputError, match=words):
        StructuredOutputsParams(**kwargs)


def test_key_is_canonical() -> None:
    a = StructuredOutputsParams(json={"type": "object", "properties": {}}, param="guided_json")
    b = StructuredOutputsParams(json='{"properties": {}, "type": "object"}', param="x")
    assert a.key == b.key and a.key[0] == "json"
    assert isinstance(b.json, dict)
    assert StructuredOutputsParams(json_object=True).key == ("json_object", "")
    assert (
        StructuredOutputsParams(choice=["a", "b"]).key
        != StructuredOutputsParams(choice=["b", "a"]).key
    )
