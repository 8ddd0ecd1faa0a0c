"""Property tests: no bytes whatsoever make ``decode_plan`` raise anything but ``PlanError``.

Cases per run (hypothesis ``max_examples``; each test checks that it really ran them, ``counted``):
    structural mutations of the tiny plan's JSON   600
    type-preserving mutations (reach the verifier)  300
    JSON Schema / msgspec agreement on mutations    250
    truncated plan bytes                            150
    corrupted plan bytes (flips, inserts)           200
    random bytes                                    100
    total                                          1600
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dctms.schema.errors import PlanError
from dctms.schema.io import decode_plan, encode_plan
from dctms.schema.schema_check import schema_problems
from dctms.schema.types import SCHEMA_VERSION, Plan
from dctms.schema.verify import verify_plan

CASES = {
    "mutations": 600,
    "semantic": 300,
    "agreement": 250,
    "truncated": 150,
    "corrupted": 200,
    "random": 100,
}
RAN: Counter[str] = Counter()  # examples run, by case; each test reads only its own entry


def counted(name: str):
    """The test fails unless hypothesis really ran ``CASES[name]`` examples in this very test."""

    def wrap(test):
        @functools.wraps(test)
        def run(*args, **kwargs):
            start = RAN[name]
            test(*args, **kwargs)
            ran = RAN[name] - start
            assert ran >= CASES[name], f"{name}: hypothesis ran {ran} of {CASES[name]} cases"

        return run

    return wrap


def fuzz_settings(name: str):
    return settings(
        max_examples=CASES[name],
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


def decode_or_plan_error(data: bytes) -> Plan | None:
    """Decode; a PlanError is an accepted outcome, anything else fails the test."""
    try:
        plan = decode_plan(data, "fuzz.plan")
    except PlanError as err:
        assert err.problems and "\n" not in str(err)
        return None
    # Whatever was accepted really is a valid plan and survives a round trip.
    assert verify_plan(plan) == []
    assert encode_plan(decode_plan(encode_plan(plan))) == encode_plan(plan)
    return plan


# ------------------------------------------------------------------------------ structural mutations

EDGE_INTS = [0, -1, 1, 2**31, 2**31 + 1, 2**53, 2**53 + 1, 2**63, 2**64, 10**30, -(10**30)]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.sampled_from(EDGE_INTS)
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["", "inf", "nan", "float16", "t0", "state", "\x00", "é"])
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def all_paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += all_paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += all_paths(value, prefix + (i,))
    return out


def mutate(document: Any, data: st.DataObject) -> None:
    paths = all_paths(document)
    path = data.draw(st.sampled_from(paths))
    parent = document
    for part in path[:-1]:
        parent = parent[part]
    key, current = path[-1], parent[path[-1]]
    action = data.draw(
        st.sampled_from(["delete", "replace", "add", "number", "stringify", "duplicate"])
    )
    if action == "delete":
        del parent[key]
    elif action == "replace":
        parent[key] = data.draw(json_values)
    elif action == "add" and isinstance(current, dict):
        current[data.draw(st.text(min_size=1, max_size=6))] = data.draw(json_values)
    elif action == "number" and isinstance(current, int) and not isinstance(current, bool):
        parent[key] = data.draw(
            st.sampled_from([current + 1, current - 1, -current, current * 2] + EDGE_INTS)
        )
    elif action == "stringify":
        parent[key] = json.dumps(current)
    elif action == "duplicate" and isinstance(current, list) and current:
        current.append(current[data.draw(st.integers(0, len(current) - 1))])
    else:
        parent[key] = data.draw(json_values)


def mutated_bytes(original: bytes, data: st.DataObject) -> tuple[Any, bytes]:
    document = json.loads(original)
    for _ in range(data.draw(st.integers(1, 3))):
        mutate(document, data)
    return document, json.dumps(document).encode()


@pytest.mark.slow
@counted("mutations")
@fuzz_settings("mutations")
@given(data=st.data())
def test_mutated_plans_raise_only_plan_error(tiny_plan_bytes: bytes, data: st.DataObject) -> None:
    RAN["mutations"] += 1
    _, mutated = mutated_bytes(tiny_plan_bytes, data)
    decode_or_plan_error(mutated)


def tweak(document: Any, data: st.DataObject) -> None:
    """A schema-valid edit: a small change to a count, an id swapped for another, an item dropped."""
    paths = all_paths(document)
    ints = [p for p in paths if type(_at(document, p)) is int]
    ids = [
        p for p in paths if isinstance(_at(document, p), str) and p[-1] in ("id", "view_of", "name")
    ]
    ids += [
        p for p in paths if len(p) > 1 and p[-2] in ("inputs", "outputs") and isinstance(p[-1], int)
    ]
    lists = [p for p in paths if isinstance(_at(document, p), list) and _at(document, p)]
    kind = data.draw(st.sampled_from(["int", "id", "drop"]))
    if kind == "int":
        path = data.draw(st.sampled_from(ints))
        value = _at(document, path) + data.draw(st.sampled_from([-64, -16, -1, 1, 16, 64]))
        _set(document, path, max(0, value))
    elif kind == "id":
        path, other = data.draw(st.sampled_from(ids)), data.draw(st.sampled_from(ids))
        if isinstance(_at(document, other), str):
            _set(document, path, _at(document, other))
    else:
        items = _at(document, data.draw(st.sampled_from(lists)))
        del items[data.draw(st.integers(0, len(items) - 1))]


def _at(document: Any, path: tuple) -> Any:
    for part in path:
        document = document[part]
    return document


def _set(document: Any, path: tuple, value: Any) -> None:
    _at(document, path[:-1])[path[-1]] = value


@counted("semantic")
@fuzz_settings("semantic")
@given(data=st.data())
def test_type_preserving_mutations(tiny_plan_bytes: bytes, data: st.DataObject) -> None:
    RAN["semantic"] += 1
    document = json.loads(tiny_plan_bytes)
    for _ in range(data.draw(st.integers(1, 2))):
        tweak(document, data)
    decode_or_plan_error(json.dumps(document).encode())


@counted("agreement")
@fuzz_settings("agreement")
@given(data=st.data())
def test_json_schema_and_msgspec_agree(tiny_plan_bytes: bytes, data: st.DataObject) -> None:
    """msgspec accepts a document exactly when the JSON Schema does (so the two cannot drift),
    and the schema check that skips the subtrees msgspec accepts finds exactly the problems of
    JSON Schema's walk of every node.

    The one known difference: JSON Schema counts 2.0 as an integer, msgspec does not.
    """
    RAN["agreement"] += 1
    document, mutated = mutated_bytes(tiny_plan_bytes, data)
    # Only documents of this schema version (a bool is not one, though True == 1 in Python).
    version = document.get("schema_version") if isinstance(document, dict) else None
    if type(version) is not int or version != SCHEMA_VERSION:
        return
    every = schema_problems(document, every_node=True)
    assert schema_problems(document) == every
    schema_ok = not every
    try:
        msgspec.json.decode(mutated, type=Plan)
        msgspec_ok, why = True, ""
    except msgspec.ValidationError as err:
        msgspec_ok, why = False, str(err)
    if schema_ok and not msgspec_ok:
        assert why.startswith("Expected `int`, got `float`"), why
    else:
        assert schema_ok == msgspec_ok, why or every


@pytest.mark.parametrize("tag", [[], {}, 3, None, "view"])
def test_a_tensor_kind_that_is_no_tag_is_named(tiny_plan_bytes: bytes, tag: Any) -> None:
    """The tensor union's tag as a list or an object (unhashable) is reported like any other bad
    tag, by field, by the schema and by ``decode_plan`` (found by the agreement fuzz)."""
    document = json.loads(tiny_plan_bytes)
    document["phases"][0]["tensors"][1]["kind"] = tag
    problems = schema_problems(document)
    assert [p.path for p in problems] == ["$.phases[0].tensors[1].kind"], problems
    assert problems[0].message.startswith("must be one of"), problems
    with pytest.raises(PlanError, match=r"tensors\[1\]\.kind: must be one of"):
        decode_plan(json.dumps(document).encode())


def test_every_bad_subtree_is_listed_though_valid_ones_are_skipped(tiny_plan_bytes: bytes) -> None:
    """The schema check skips the subtrees msgspec accepts and walks the others whole: three
    errors in three places (a tensor without its tag, an op's bad field, a bound out of range)
    are all listed, as JSON Schema's walk of every node lists them."""
    document = json.loads(tiny_plan_bytes)
    del document["phases"][0]["tensors"][2]["kind"]
    document["phases"][0]["ops"][1]["inputs"] = "t0"
    document["bounds"]["input_tokens"] = "eight"
    problems = schema_problems(document)
    assert [p.path for p in problems] == [
        "$.bounds.input_tokens",
        "$.phases[0].ops[1].inputs",
        "$.phases[0].tensors[2].kind",
    ], problems
    assert problems == schema_problems(document, every_node=True)


# ------------------------------------------------------------------------------------- byte mutations


@counted("truncated")
@fuzz_settings("truncated")
@given(data=st.data())
def test_truncated_plans(tiny_plan_bytes: bytes, data: st.DataObject) -> None:
    RAN["truncated"] += 1
    cut = data.draw(st.integers(0, len(tiny_plan_bytes.rstrip()) - 1))  # the newline is optional
    assert decode_or_plan_error(tiny_plan_bytes[:cut]) is None


@counted("corrupted")
@fuzz_settings("corrupted")
@given(data=st.data())
def test_corrupted_plans(tiny_plan_bytes: bytes, data: st.DataObject) -> None:
    RAN["corrupted"] += 1
    raw = bytearray(tiny_plan_bytes)
    for _ in range(data.draw(st.integers(1, 5))):
        at = data.draw(st.integers(0, len(raw) - 1))
        if data.draw(st.booleans()):
            raw[at] = data.draw(st.integers(0, 255))
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    decode_or_plan_error(bytes(raw))


@counted("random")
@fuzz_settings("random")
@given(raw=st.binary(max_size=300))
def test_random_bytes(raw: bytes) -> None:
    RAN["random"] += 1
    assert decode_or_plan_error(raw) is None


def test_fuzz_case_count() -> None:
    """The fuzz budget: at least 1,000 cases per run over all the property tests above."""
    assert sum(CASES.values()) >= 1000
