"""Issue 11, finding 10: what the verifier can re-derive from a plan it re-derives, and it refuses
a plan claiming less — each edit below kept every other figure consistent (totals re-derived, the
digest re-stamped) and validated before (``schema/rules_derived.py``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hardening import build_tiny, restamp

from dctms.schema.errors import PlanError
from dctms.schema.io import decode_plan

PLANS = Path(__file__).parent.parent / "plans"


@pytest.fixture(scope="module")
def document(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("harden-rederive")
    return json.loads(build_tiny(root / "tiny").read_text())


def _decode(doc: dict) -> set[str]:
    """The rules that refuse ``doc`` (empty when it is valid)."""
    try:
        decode_plan(restamp(doc))
    except PlanError as err:
        return {p.rule for p in err.problems}
    return set()


def _totals(doc: dict) -> None:
    e = doc["envelope"]
    e["total"] = e["weights"] + e["kv"] + e["persistent"] + e["intermediate"] + e["runtime"]
    if "device" in e:
        e["free"] = e["device"] - e["total"]


def _decode_phase(doc: dict) -> dict:
    return next(p for p in doc["phases"] if p["name"] == "decode")


def test_the_unedited_plan_is_valid(document):
    assert _decode(copy.deepcopy(document)) == set()


def test_persistent_state_removed(document):
    doc = copy.deepcopy(document)
    doc["state"] = [s for s in doc["state"] if s["kind"] != "persistent"]
    doc["envelope"]["persistent"] = 0
    _totals(doc)
    assert _decode(doc) == {"persistent_state"}


def test_runtime_lowered(document):
    doc = copy.deepcopy(document)
    doc["envelope"]["runtime"] = 1024
    _totals(doc)
    assert _decode(doc) == {"runtime_floor"}


def test_a_scratch_tensor_removed_with_its_op_scratch(document):
    doc = copy.deepcopy(document)
    phase = _decode_phase(doc)
    index, op = next(
        (i, o) for i, o in enumerate(phase["ops"]) if o["primitive"] == "DynamicSliceUpdate"
    )
    del op["scratch"]
    phase["tensors"] = [
        t for t in phase["tensors"] if not (t["kind"] == "scratch" and t["op"] == index)
    ]
    stats = doc["stats"]
    stats["logical_tensors"] -= 1
    stats["reduction"] = 1 - stats["physical_buffers"] / stats["logical_tensors"]
    assert _decode(doc) == {"dynamic_scratch"}


def test_an_interval_shrunk_below_the_run_ahead_widening(document):
    doc = copy.deepcopy(document)
    phase = _decode_phase(doc)
    tensor = next(
        t for t in phase["tensors"]
        if t["kind"] == "intermediate" and "view_of" not in t
        and t["interval"][1] > t["interval"][0] + 1
    )  # fmt: skip
    tensor["interval"][1] -= 1  # still past its last read: only the widening is lost
    assert _decode(doc) == {"run_ahead"}


@pytest.mark.parametrize("name", ["qwen1.5b.plan", "qwen7b.plan"])
def test_the_checked_in_plans_meet_every_re_derived_figure(name):
    decode_plan((PLANS / name).read_bytes())  # raises on any problem
