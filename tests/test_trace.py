"""``dctms trace``: the JSON loads, spans and counters add up to the plan's own figures."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

import pytest

from dctms.cli import main as cli
from dctms.schema.io import read_plan
from dctms.schema.sizes import align_up, is_arena_tenant
from dctms.views.trace import EXTENT_COUNTER, LIVE_COUNTER, trace_document

ROOT = Path(__file__).resolve().parents[1]
PLANS = [ROOT / "plans" / "qwen1.5b.plan", ROOT / "plans" / "qwen7b.plan"]


def counter(events: list[dict], pid: int, name: str) -> dict[int, int]:
    return {
        e["ts"]: e["args"]["bytes"]
        for e in events
        if e["ph"] == "C" and e["pid"] == pid and e["name"] == name
    }


def per_slot(samples: dict[int, int], num_slots: int) -> list[int]:
    """Counters are emitted where they change: expand them back to one value per slot."""
    out, value = [], 0
    for slot in range(num_slots):
        value = samples.get(slot, value)
        out.append(value)
    return out


@pytest.fixture(scope="module", params=PLANS, ids=lambda p: p.stem)
def exported(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("trace") / "trace.json"
    assert cli.main(["trace", str(request.param), "-o", str(out)]) == 0
    return read_plan(request.param), json.loads(out.read_text())


@pytest.mark.slow
def test_json_loads_with_truthful_units(exported):
    plan, doc = exported
    assert doc["otherData"]["time_unit"] == "slot"
    assert "not time" in doc["otherData"]["time_unit_note"]
    assert "displayTimeUnit" not in doc  # it only allows ms/ns, neither is true
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert len(names) == len(plan.phases)
    for pid, phase in enumerate(plan.phases, start=1):
        assert names[pid].startswith(f"{phase.name} phase") and "schedule slots" in names[pid]
    assert doc["otherData"]["m_max_bytes"] == plan.envelope.total


def test_spans_are_the_arena_tenants(exported):
    plan, doc = exported
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] != "module"]
    assert len(spans) == plan.stats.logical_tensors
    for pid, phase in enumerate(plan.phases, start=1):
        tenants = {t.id: t for t in phase.tensors if is_arena_tenant(t)}
        mine = [e for e in spans if e["pid"] == pid]
        assert sorted(e["args"]["tensor"] for e in mine) == sorted(tenants)
        assert sum(e["args"]["bytes"] for e in mine) == sum(t.bytes for t in tenants.values())
        for e in mine:
            t = tenants[e["args"]["tensor"]]
            assert (e["ts"], e["dur"]) == (t.interval[0], t.interval[1] - t.interval[0] + 1)
            assert e["tid"] == t.buffer + 1
            assert (e["args"]["offset"], e["args"]["buffer"]) == (t.offset, t.buffer)
            assert e["args"]["aligned_bytes"] == align_up(t.bytes, plan.target.alignment)
        # One track per physical buffer, and a track never holds two spans at once.
        track: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for e in mine:
            track[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
        assert len(track) == len(phase.buffers)
        for spans_on_track in track.values():
            spans_on_track.sort()
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans_on_track))


def test_counters_reach_the_lower_bound_and_the_arena(exported):
    plan, doc = exported
    events = doc["traceEvents"]
    for pid, phase in enumerate(plan.phases, start=1):
        n = len(phase.slots)
        live = per_slot(counter(events, pid, LIVE_COUNTER), n)
        extent = per_slot(counter(events, pid, EXTENT_COUNTER), n)
        assert max(live) == phase.lower_bound_bytes
        assert max(extent) == phase.arena_bytes
        assert all(
            a <= b for a, b in zip(live, extent, strict=True)
        )  # packed bytes can't be below live bytes
        # The area under the live counter equals the spans' aligned bytes x slots.
        spans = [e for e in events if e["ph"] == "X" and e["pid"] == pid and e["cat"] != "module"]
        assert sum(live) == sum(e["args"]["aligned_bytes"] * e["dur"] for e in spans)
        assert counter(events, pid, LIVE_COUNTER)[n] == 0  # closes after the last slot
    assert max(p.lower_bound_bytes for p in plan.phases) == plan.stats.lower_bound_bytes


def test_tiny_plan_events_exactly(tiny_plan):
    doc = trace_document(tiny_plan)
    spans = {
        e["args"]["tensor"]: (e["ts"], e["dur"], e["tid"])
        for e in doc["traceEvents"]
        if e["ph"] == "X" and e["cat"] != "module"
    }
    # t1 is a view and k_out aliases the KV cache: neither is a tenant.
    assert spans == {
        "t0": (0, 3, 1),
        "scratch.3": (1, 1, 2),
        "t2": (2, 2, 2),
        "t3": (3, 2, 1),
        "out": (4, 1, 2),
    }
    live = counter(doc["traceEvents"], 1, LIVE_COUNTER)
    assert live == {0: 64, 1: 128, 5: 0}  # 128 = lower_bound_bytes from slot 1 to slot 4
    syncs = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert [(e["ts"], e["name"]) for e in syncs] == [(5, "sync: sample next token")]


def test_one_phase_to_stdout(capsys):
    assert cli.main(["trace", str(PLANS[0]), "--phase", "decode", "-o", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {e["pid"] for e in doc["traceEvents"]} == {2}


def test_bad_input(tmp_path, capsys, plan_file):
    assert (
        cli.main(["trace", str(plan_file), "--phase", "nope", "-o", str(tmp_path / "t.json")]) == 2
    )
    assert "no phase 'nope'" in capsys.readouterr().err
    assert cli.main(["trace", str(tmp_path / "missing.plan"), "-o", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file" in err
    assert cli.main(["trace", str(plan_file), "-o", str(tmp_path / "no" / "dir" / "t.json")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_tenant_slices_are_named_by_module_and_a_modules_track(tiny_plan):
    doc = trace_document(tiny_plan)
    spans = {
        e["args"]["tensor"]: e
        for e in doc["traceEvents"]
        if e.get("cat") != "module" and e["ph"] == "X"
    }
    assert spans["t2"]["name"] == "model.layers.0.self_attn: t2 [1,8] float16"
    assert spans["t2"]["args"]["module"] == "model.layers.0.self_attn"
    assert spans["t2"]["args"]["layer"] == 0
    assert spans["scratch.3"]["args"]["module"] == "model.layers.0.self_attn"  # its op's
    assert spans["out"]["args"]["module"] == "(step)" and spans["out"]["args"]["layer"] is None
    track = [e for e in doc["traceEvents"] if e.get("cat") == "module"]
    # slots [[0], [1, 3], [2], [4], [5]]: op 0 embed; ops 1 (embed) first in slot 1; 2, 4 attention
    assert [(e["name"], e["ts"], e["dur"]) for e in track] == [
        ("model.embed_tokens", 0, 2),
        ("model.layers.0.self_attn", 2, 2),
        ("(step)", 4, 1),
    ]
    assert sum(e["args"]["ops"] for e in track) == len(tiny_plan.phases[0].ops)
