"""SVG snapshots of every dctms-tui screen on the tiny fixture plan (layout guard).

The figures on these screens are asserted by value in test_tui_app.py; the snapshots catch layout
changes. Fixed terminal size, nothing focused that blinks. Regenerate after an intended change with
``pytest tests/test_tui_snapshots.py --snapshot-update`` and look at the SVGs before committing.
"""

from __future__ import annotations

import msgspec
import pytest
from conftest import make_tiny_plan

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
