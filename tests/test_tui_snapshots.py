"""SVG snapshots of every dctms-tui screen on the tiny fixture plan (layout guard).

The figures on these screens are asserted by value in test_tui_app.py; the snapshots catch layout
changes. Fixed terminal size, nothing focused that blinks. Regenerate after an intended change with
``pytest tests/test_tui_snapshots.py --snapshot-update`` and look at the SVGs before committing.
"""

from __future__ import annotations

import json

import msgspec
import pytest
from conftest import make_tiny_plan
from prefix_runs import compile_pool_plans, record_fixed_run

from dctms.schema.types import Plan
from dctms.tui.app import InspectorApp
from dctms.tui.state import Inspection

SIZE = (100, 30)


def tiny_app(screen: str | None = None, old: Plan | None = None) -> InspectorApp:
    plan = make_tiny_plan()
    if old is not None:
        return InspectorApp(Inspection(plan, "new.plan", old=old, old_path="old.plan"), screen=screen)
    return InspectorApp(Inspection(plan, "tiny.plan"), screen=screen)


@pytest.mark.parametrize(
    "screen", ["overview", "memory", "lifetimes", "buffers", "schedule", "ops"]
)
def test_screen(snap_compare, screen: str):
    assert snap_compare(tiny_app(screen), terminal_size=SIZE)


def test_lifetimes_selection_and_zoom(snap_compare):
    assert snap_compare(
        tiny_app("lifetimes"), press=["j", "j", "j", "j", "plus"], terminal_size=SIZE
    )


def test_lifetimes_per_buffer(snap_compare):
    assert snap_compare(tiny_app("lifetimes"), press=["b"], terminal_size=SIZE)


def test_diff(snap_compare):
    old = make_tiny_plan()
    e = old.envelope
    smaller = msgspec.structs.replace(
        e, runtime=e.runtime - 512, total=e.total - 512, free=e.free + 512
    )
    old = msgspec.structs.replace(old, envelope=smaller)
    assert snap_compare(tiny_app(old=old), terminal_size=SIZE)


def test_help(snap_compare):
    assert snap_compare(tiny_app(), press=["question_mark"], terminal_size=SIZE)


@pytest.fixture(scope="module")
def pool_run(tmp_path_factory):
    """The tiny model's 2-block pool plan and a run of fixed prompts through it (a real run: the
    report's numbers come from the runner's index, not typed here)."""
    from dctms.figures.prefix_run import read_pool_run
    from dctms.schema.io import read_plan

    root = tmp_path_factory.mktemp("pool-snapshot")
    plans = compile_pool_plans(root, ("small",))
    report = root / "fixed-run.json"
    report.write_text(json.dumps(record_fixed_run(plans["small"], plans["model"])))
    plan = read_plan(plans["small"])
    return plan, read_pool_run(report, plan)


def test_pool(snap_compare, pool_run):
    plan, run = pool_run
    app = InspectorApp(Inspection(plan, "pool.plan", pool_run=run), screen="pool")
    assert snap_compare(app, terminal_size=SIZE)


def test_pool_without_a_pool(snap_compare):
    assert snap_compare(tiny_app("pool"), terminal_size=SIZE)
