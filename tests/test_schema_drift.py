"""plan.schema.json and the msgspec types must describe the same document.

Two independent checks: the checked-in file equals what ``schema_gen`` renders from the types, and a
structural comparison built from ``msgspec.inspect`` (not from msgspec's own schema generator) finds
the same fields, required fields, types and bounds in every struct. The comparison is itself shown to
catch drift, so it cannot silently pass.
"""

from __future__ import annotations

import copy
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from jsonschema import Draft202012Validator

from dctms.schema import types
from dctms.schema.schema_check import plan_schema
from dctms.schema.schema_gen import SCHEMA_PATH, render_json_schema
from dctms.schema.types import MAX_BYTES, SCHEMA_VERSION, Plan


def expected_shape(t: mi.Type) -> dict[str, Any]:
    """The JSON Schema fragment a field of type ``t`` should have (annotations ignored)."""
    if isinstance(t, mi.IntType):
        return _bounded({"type": "integer"}, t)
    if isinstance(t, mi.FloatType):
        return _bounded({"type": "number"}, t)
    if isinstance(t, mi.StrType):
        out: dict[str, Any] = {"type": "string"}
        if t.min_length is not None:
            out["minLength"] = t.min_length
        if t.pattern is not None:
            out["pattern"] = t.pattern
        return out
    if isinstance(t, mi.BoolType):
        return {"type": "boolean"}
    if isinstance(t, mi.NoneType):
        return {"type": "null"}
    if isinstance(t, mi.AnyType):
        return {}
    if isinstance(t, mi.ListType):
        out = {"type": "array"}
        if not isinstance(t.item_type, mi.AnyType):  # "items": {} says nothing; msgspec omits it
            out["items"] = expected_shape(t.item_type)
        if t.min_length is not None:
            out["minItems"] = t.min_length
        if t.max_length is not None:
            out["maxItems"] = t.max_length
        return out
    if isinstance(t, mi.DictType):
        keys = {k: v for k, v in expected_shape(t.key_type).items() if k != "type"}
        out = {"type": "object"}
        if not isinstance(t.value_type, mi.AnyType):  # as for lists, msgspec omits a bare {}
            out["additionalProperties"] = expected_shape(t.value_type)
        if keys:
            out["propertyNames"] = keys
        return out
    if isinstance(t, mi.StructType):
        return {"$ref": f"#/$defs/{t.cls.__name__}"}
    if isinstance(t, mi.LiteralType):
        return {"enum": list(t.values)}
    if isinstance(t, mi.UnionType):
        out = {"anyOf": [expected_shape(x) for x in t.types]}
        tagged = [x for x in t.types if isinstance(x, mi.StructType) and x.tag_field is not None]
        if tagged:  # a tagged union: the tag field says which struct
            out["discriminator"] = {
                "propertyName": tagged[0].tag_field,
                "mapping": {x.tag: f"#/$defs/{x.cls.__name__}" for x in tagged},
            }
        return out
    raise AssertionError(f"no JSON Schema mapping for {t!r}")


def _bounded(out: dict[str, Any], t: mi.IntType | mi.FloatType) -> dict[str, Any]:
    for attr, key in (
        ("ge", "minimum"),
        ("le", "maximum"),
        ("gt", "exclusiveMinimum"),
        ("lt", "exclusiveMaximum"),
    ):
        if getattr(t, attr) is not None:
            out[key] = getattr(t, attr)
    return out


def _strip(fragment: Any) -> Any:
    """A schema fragment without annotations (title, description, default)."""
    if isinstance(fragment, dict):
        return {
            k: _strip(v)
            for k, v in fragment.items()
            if k not in ("title", "description", "default")
        }
    if isinstance(fragment, list):
        return [_strip(v) for v in fragment]
    return fragment


def structs_of(root: type) -> dict[str, mi.StructType]:
    """Every struct reachable from ``root``, by class name."""
    found: dict[str, mi.StructType] = {}

    def walk(t: mi.Type) -> None:
        if isinstance(t, mi.StructType):
            if t.cls.__name__ in found:
                return
            found[t.cls.__name__] = t
            for f in t.fields:
                walk(f.type)
        for attr in ("item_type", "key_type", "value_type"):
            if hasattr(t, attr):
                walk(getattr(t, attr))
        for sub in getattr(t, "types", ()):
            walk(sub)

    walk(mi.type_info(root))
    return found


def drift(root: type, schema: dict[str, Any]) -> list[str]:
    """Every difference between the structs reachable from ``root`` and ``schema``'s ``$defs``."""
    defs = schema.get("$defs", {})
    structs = structs_of(root)
    out = []
    if schema.get("$ref") != f"#/$defs/{root.__name__}":
        out.append(f"top-level $ref is {schema.get('$ref')!r}")
    if set(defs) != set(structs):
        out.append(f"$defs {sorted(defs)} != structs {sorted(structs)}")
    for name, info in structs.items():
        d = defs.get(name)
        if d is None:
            continue
        tag = [info.tag_field] if info.tag_field is not None else []  # written first
        fields = tag + [f.encode_name for f in info.fields]
        if list(d.get("properties", {})) != fields:
            out.append(f"{name}: properties {list(d.get('properties', {}))} != fields {fields}")
        if tag and _strip(d["properties"][info.tag_field]) != {"enum": [info.tag]}:
            out.append(f"{name}.{info.tag_field}: schema is not the tag {info.tag!r}")
        required = tag + [f.encode_name for f in info.fields if f.required]
        if d.get("required", []) != required:
            out.append(f"{name}: required {d.get('required', [])} != {required}")
        if d.get("additionalProperties") is not False or d.get("type") != "object":
            out.append(f"{name}: must be a closed object (additionalProperties false)")
        for f in info.fields:
            have = _strip(d.get("properties", {}).get(f.encode_name))
            want = expected_shape(f.type)
            if have is not None and have != want:
                out.append(f"{name}.{f.encode_name}: schema {have} != type {want}")
    return out


# --------------------------------------------------------------------------------------------- tests


def test_checked_in_schema_is_generated_from_the_types() -> None:
    assert SCHEMA_PATH.read_text(encoding="utf-8") == render_json_schema(), (
        "schema/plan.schema.json is stale: run `python -m dctms.schema.schema_gen` "
        "(and bump SCHEMA_VERSION if the plan format changed)"
    )


def test_schema_matches_types_structurally() -> None:
    assert drift(Plan, plan_schema()) == []


def test_schema_is_draft_2020_12_with_versioned_id() -> None:
    schema = plan_schema()
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == f"https://dctms.dev/schema/plan-v{SCHEMA_VERSION}.json"


def test_byte_counts_are_bounded_integers() -> None:
    tensor = plan_schema()["$defs"]["Intermediate"]["properties"]["bytes"]
    assert tensor == {"type": "integer", "minimum": 0, "maximum": MAX_BYTES}
    assert MAX_BYTES == 2**53


def test_valid_plan_passes_the_json_schema(tiny_plan_bytes: bytes) -> None:
    errors = list(
        Draft202012Validator(plan_schema()).iter_errors(msgspec.json.decode(tiny_plan_bytes))
    )
    assert errors == []


# The comparison must be able to fail: each of these drifts is caught.


class Intermediate(types.Intermediate, tag="intermediate"):
    """The real Intermediate plus a field nobody added to the schema."""

    extra: int = 0


class Phase(types.Phase):
    # same field, pointing at the drifted Intermediate
    tensors: list[Intermediate | types.Output | types.StateView | types.Scratch]


class DriftedPlan(types.Plan):
    phases: list[Phase]


def _renamed(schema: dict[str, Any]) -> dict[str, Any]:
    schema = copy.deepcopy(schema)
    schema["$ref"] = "#/$defs/DriftedPlan"
    schema["$defs"]["DriftedPlan"] = schema["$defs"].pop("Plan")
    return schema


def test_a_field_added_to_a_struct_is_drift() -> None:
    found = drift(DriftedPlan, _renamed(plan_schema()))
    assert any(line.startswith("Intermediate: properties") and "extra" in line for line in found)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d["Intermediate"]["properties"].pop("offset"), "Intermediate: properties"),
        (lambda d: d["Intermediate"]["required"].remove("interval"), "Intermediate: required"),
        (
            lambda d: d["Buffer"].__setitem__("additionalProperties", True),
            "Buffer: must be a closed",
        ),
        (
            lambda d: d["Intermediate"]["properties"]["bytes"].__setitem__("maximum", 2**64),
            "Intermediate.bytes",
        ),
        (
            lambda d: d["Op"]["properties"]["inputs"]["items"].__setitem__("type", "integer"),
            "Op.inputs",
        ),
        (lambda d: d["Binding"]["properties"]["kind"]["enum"].append("param"), "Binding.kind"),
        (lambda d: d.pop("SyncPoint"), "$defs"),
    ],
)
def test_schema_edits_are_drift(edit, expected: str) -> None:
    schema = copy.deepcopy(plan_schema())
    edit(schema["$defs"])
    assert any(line.startswith(expected) for line in drift(Plan, schema))
