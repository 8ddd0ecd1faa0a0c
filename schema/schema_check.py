"""JSON Schema validation of a parsed plan document, with every error as a readable ``Problem``.

jsonschema's own messages embed ``repr`` of the offending value (which can be megabytes of garbage) and
say "is not valid under any of the given schemas" for optional fields; these are rewritten into short
"expected X, got Y" lines with the JSON path of the field.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

import msgspec

from dctms.schema.errors import Problem
from dctms.schema.paths import json_path
from dctms.schema.schema_gen import SCHEMA_PATH

if TYPE_CHECKING:  # jsonschema is imported only when a plan is refused (it costs ~0.1 s)
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import ValidationError

RULE = "schema"
_MAX_SHOWN = 40  # characters of a value quoted in a message


@functools.cache
def plan_schema() -> dict[str, Any]:
    """The checked-in ``plan.schema.json``."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


@functools.cache
def _validator() -> Draft202012Validator:
    """The plan schema's validator, whose ``$ref`` to a definition first asks msgspec whether the
    subtree is a valid instance of that definition's type (the schema is generated from those
    types, and tests/test_schema_fuzz.py checks that msgspec accepts nothing the schema rejects):
    a valid subtree is not walked. jsonschema's walk costs ~18 us a node in Python; with the
    check, a plan with one bad field is walked along the path to it only (and every bad subtree
    in full, so every error is still listed)."""
    from jsonschema import Draft202012Validator, validators

    walk = Draft202012Validator.VALIDATORS["$ref"]

    def ref(validator, target, instance, schema):
        kind = _definition_type(target)
        if kind is not None and _accepted(kind, instance):
            return
        yield from walk(validator, target, instance, schema)

    return validators.extend(Draft202012Validator, {"$ref": ref})(plan_schema())


@functools.cache
def _plain_validator() -> Draft202012Validator:
    from jsonschema import Draft202012Validator

    return Draft202012Validator(plan_schema())


_DEFINITIONS = "#/$defs/"


@functools.cache
def _definition_type(target: str) -> type | None:
    """The msgspec type a ``$ref`` to one of the schema's definitions names (None: another ref)."""
    from dctms.schema import types

    if not target.startswith(_DEFINITIONS):
        return None
    kind = getattr(types, target[len(_DEFINITIONS) :], None)
    return kind if isinstance(kind, type) and issubclass(kind, msgspec.Struct) else None


def _accepted(kind: type, instance: Any) -> bool:
    config = kind.__struct_config__
    if config.tag_field is not None:  # decoded alone, a union member does not need its tag
        if not isinstance(instance, dict) or instance.get(config.tag_field) != config.tag:
            return False
    try:
        msgspec.convert(instance, type=kind)
    except msgspec.ValidationError:
        return False
    return True


def schema_problems(document: Any, every_node: bool = False) -> list[Problem]:
    """Every way ``document`` violates the plan schema, sorted by location, without duplicates.
    ``every_node``: JSON Schema's own walk of the whole document, without msgspec's check of the
    subtrees (the same problems, slower; the tests compare the two)."""
    found: dict[tuple[Any, ...], Problem] = {}
    validator = _plain_validator() if every_node else _validator()
    for error in validator.iter_errors(document):
        for parts, message in _describe(error):
            problem = Problem(json_path(parts), message, RULE)
            found.setdefault((_sort_key(parts), message), problem)
    return [found[key] for key in sorted(found)]


def _sort_key(parts: list[str | int]) -> tuple[tuple[int, Any], ...]:
    # Mixed str/int paths: sort indices numerically and before keys.
    return tuple((0, p) if isinstance(p, int) else (1, p) for p in parts)


def _describe(error: ValidationError) -> list[tuple[list[str | int], str]]:
    parts = list(error.absolute_path)
    kind, value, instance = error.validator, error.validator_value, error.instance
    if kind == "required":
        missing = [name for name in value if isinstance(instance, dict) and name not in instance]
        return [(parts + [name], "missing required field") for name in missing]
    if kind == "additionalProperties" and isinstance(instance, dict):
        known = error.schema.get("properties", {})
        extra = [name for name in instance if name not in known]
        return [(parts + [name], "unknown field (not in the plan schema)") for name in extra]
    if kind in ("anyOf", "oneOf") and "discriminator" in error.schema and isinstance(instance, dict):
        return _describe_tagged(error, parts)
    if kind in ("anyOf", "oneOf"):
        # An optional field: report why the non-null branch rejected the value, or both types.
        deeper = [sub for sub in error.context or () if sub.validator != "type"]
        if deeper:
            return [item for sub in deeper for item in _describe(sub)]
        types = [s.get("type") or _kind_of(s) for s in value if isinstance(s, dict)]
        return [(parts, f"expected {' or '.join(map(str, types))}, got {_show(instance)}")]
    return [(parts, _message(kind, value, instance, error))]


def _describe_tagged(
    error: ValidationError, parts: list[str | int]
) -> list[tuple[list[str | int], str]]:
    """A tagged union (tensor variants): the tag names the one branch whose errors count."""
    field = error.schema["discriminator"]["propertyName"]
    mapping: dict[str, str] = error.schema["discriminator"]["mapping"]
    tag = error.instance.get(field)
    if field not in error.instance:
        return [(parts + [field], "missing required field")]
    if not isinstance(tag, str) or tag not in mapping:  # (a list or an object is no tag at all)
        return [(parts + [field], _message("enum", list(mapping), tag, error))]
    branch = next(i for i, s in enumerate(error.validator_value) if s.get("$ref") == mapping[tag])
    chosen = [sub for sub in error.context or () if sub.relative_schema_path[0] == branch]
    return [item for sub in chosen for item in _describe(sub)]


def _message(kind: str, value: Any, instance: Any, error: ValidationError) -> str:
    if kind == "type":
        return f"expected {value}, got {_show(instance)}"
    if kind == "minimum":
        return f"must be >= {value}, got {_show(instance)}"
    if kind == "maximum":
        return f"must be <= {value}, got {_show(instance)}"
    if kind == "minLength":
        return "must not be empty" if value == 1 else f"must have at least {value} characters"
    if kind == "pattern":
        return f"must match {value}, got {_show(instance)}"
    if kind in ("minItems", "maxItems"):
        low, high = error.schema.get("minItems"), error.schema.get("maxItems")
        if low == high:
            return f"must have exactly {low} items, got {len(instance)}"
        bound = "at least" if kind == "minItems" else "at most"
        return f"must have {bound} {value} items, got {len(instance)}"
    if kind == "enum":
        return f"must be one of {', '.join(map(_show, value))}; got {_show(instance)}"
    if kind == "const":
        return f"must be {_show(value)}, got {_show(instance)}"
    if kind == "propertyNames":
        return f"invalid key {_show(instance)}"
    return _shorten(error.message, 200)


def _kind_of(subschema: dict[str, Any]) -> str:
    if "$ref" in subschema:
        return "object " + subschema["$ref"].rsplit("/", 1)[-1]
    if "enum" in subschema or "const" in subschema:
        return "a fixed value"
    return "value"


def _show(value: Any) -> str:
    """A short description of a JSON value for a message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and abs(value) >= 10**16:
        return f"{value:.3e}"  # absurd sizes: 1.000e+30 rather than 31 digits
    if isinstance(value, (int, float)):
        return _shorten(repr(value))
    if isinstance(value, str):
        return _shorten(json.dumps(value, ensure_ascii=True))
    if isinstance(value, list):
        return f"an array of {len(value)} items"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _shorten(text: str, limit: int = _MAX_SHOWN) -> str:
    text = " ".join(text.split())  # one line
    return text if len(text) <= limit else text[: limit - 3] + "..."
