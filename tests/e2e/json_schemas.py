"""Twenty JSON schemas of the shapes agents ask for: nested objects, arrays, enums, numbers with
bounds, optional fields, unions, patterns. Strings and arrays carry length bounds where a 135M
model could otherwise write until max_tokens (the grammar would still hold, the JSON would not
close); a few are left unbounded on purpose."""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "maxLength": 24}

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130}},
        "required": ["name", "age"],
    },
    "city": {
        "type": "object",
        "properties": {"city": _NAME, "country": _NAME},
        "required": ["city", "country"],
    },
    "boolean_flag": {
        "type": "object",
        "properties": {"answer": {"type": "boolean"}},
        "required": ["answer"],
    },
    "enum_color": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    "bounded_number": {
        "type": "object",
        "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60}},
        "required": ["temperature"],
    },
    "integer_range": {
        "type": "object",
        "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["score"],
    },
    "string_list": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 4},
        },
        "required": ["tags"],
    },
    "number_list": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 100},
        "minItems": 2,
        "maxItems": 5,
    },
    "nested_address": {
        "type": "object",
        "properties": {
            "name": _NAME,
            "address": {
                "type": "object",
                "properties": {"street": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {"title": _NAME, "subtitle": _NAME, "pages": {"type": "integer"}},
        "required": ["title"],
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"sku": _NAME, "qty": {"type": "integer", "minimum": 1}},
                    "required": ["sku", "qty"],
                },
            }
        },
        "required": ["items"],
    },
    "enum_and_number": {
        "type": "object",
        "properties": {
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "value": {"type": "number", "minimum": -100, "maximum": 200},
        },
        "required": ["unit", "value"],
    },
    "sentiment": {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["sentiment", "confidence"],
    },
    "union_value": {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 12}]}
        },
        "required": ["value"],
    },
    "nullable_field": {
        "type": "object",
        "properties": {"nickname": {"type": ["string", "null"], "maxLength": 16}},
        "required": ["nickname"],
    },
    "deep_nesting": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["c"],
                    }
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    "const_and_enum_list": {
        "type": "object",
        "properties": {
            "kind": {"const": "event"},
            "days": {
                "type": "array",
                "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["kind", "days"],
    },
    "pattern_code": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
        "required": ["code"],
    },
    "defs_reference": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -10, "maximum": 10},
                    "y": {"type": "integer", "minimum": -10, "maximum": 10},
                },
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "unbounded_text": {
        "type": "object",
        "properties": {"summary": {"type": "string"}, "words": {"type": "integer", "minimum": 0}},
        "required": ["summary", "words"],
    },
}
assert len(SCHEMAS) == 20
