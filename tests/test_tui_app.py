"""dctms-tui driven by Textual's Pilot: every assertion checks a figure against the plan itself."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from conftest import make_broken_tiny_plan, make_tiny_plan

from dctms.schema.errors import PlanError
from dctms.schema.io import read_plan, write_plan
from dctms.schema.types import Plan
from dctms.tui.app import InspectorApp
from dctms.tui.screens.help import HelpScreen
from dctms.tui.state import Inspection
from dctms.tui.widgets.arena_map import ArenaMap
from dctms.tui.widgets.gantt import Gantt
from dctms.tui.widgets.memory_curve import MemoryCurve
from dctms.tui.widgets.table import VirtualTable

PLANS = Path(__file__).resolve().parent.parent / "plans"
SIZE = (110, 36)


def make_app(plan: Plan | None = None, old: Plan | None = None, **kwargs) -> InspectorApp:
    plan = plan or make_tiny_plan()
    inspection = Inspection(plan, "tiny.plan", old=old, old_path=None if old is None else "old.plan")
    return InspectorApp(inspection, **kwargs)


def drive(app: InspectorApp, scenario: Callable, size: tuple[int, int] = SIZE) -> None:
    """Run ``scenario(pilot)`` against ``app`` in a headless terminal of ``size``."""

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await scenario(pilot)

    asyncio.run(main())


def screen_text(app: InspectorApp) -> str:
    """What the terminal shows now, as plain text (one line per row)."""
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


def text(widget) -> str:
    """A widget's rendered lines as plain text (the whole widget, visible or scrolled away)."""
    return "\n".join(strip.text.rstrip() for strip in widget.render_lines(widget.size.region))


async def keys(pilot, *presses: str) -> None:
    await pilot.press(*presses)
    await pilot.pause()


async def search(pilot, value: str) -> None:
    """``/``, then the filter (set at once: typing is Textual's to test, and slow), then enter."""
    await pilot.press("slash")
    pilot.app.focused.value = value
    await keys(pilot, "enter")


# ---------------------------------------------------------------------------------- overview


def test_overview_shows_the_plans_figures():
    plan = make_tiny_plan()
    app = make_app(plan)

    async def scenario(pilot):
        shown = screen_text(app)
        e, s = plan.envelope, plan.stats
        assert app.current_mode == "overview"
        assert f"{e.total:,} B" in shown  # M_max
        for name in ("weights", "kv", "intermediate", "runtime"):
            assert f"{getattr(e, name):,} B" in shown
        # labelled as `dctms show` labels them (docs/explanation/envelope.md)
        assert re.search(rf"total = M_max +{e.total:,} B .* 100 %", shown)
        assert re.search(rf"device +{e.device:,} B", shown)
        assert re.search(rf"free +{e.free:,} B .* fits", shown)
        table1 = text(app.screen.query_one("#table1"))
        assert f"{s.logical_tensors}" in table1 and "448" in table1
        assert f"{s.reduction:.2%}" in table1 and "72.77%" in table1
        arena = text(app.screen.query_one("#arena"))
        assert f"decode                   {plan.phases[0].arena_bytes:,}" in arena
        # Start-up builds no per-phase index: only the overview exists.
        assert app.inspection.index._phases == {}

    drive(app, scenario, size=(110, 50))


def test_overview_shows_the_roofline_summary():
    from dctms.figures.roofline import plan_roofline, seconds_text, tokens_per_s_text

    plan = read_plan(PLANS / "qwen1.5b.plan")
    roof = plan_roofline(plan)
    app = make_app(plan)

    async def scenario(pilot):
        widget = app.screen.query_one("#roofline")
        for _ in range(100):  # filled in just after the first paint
            if "computing" not in text(widget):
                break
            await pilot.pause(0.05)
        shown = text(widget)
        flat = " ".join(shown.split())  # the title may wrap
        assert f"Roofline on {plan.target.profile.name}" in flat
        assert f"decode {tokens_per_s_text(roof.decode_tokens_per_s)} tok/s" in flat
        assert f"TTFT {seconds_text(roof.ttft_s)} for {plan.bounds.input_tokens:,} tokens" in flat
        for phase in roof.phases:
            row = next(line for line in shown.splitlines() if line.strip().startswith(phase.name))
            assert seconds_text(phase.seconds) in row and f"{phase.tokens:,}" in row

    drive(app, scenario, size=(130, 60))


# -------------------------------------------------------------------------------- navigation


@pytest.mark.slow
def test_number_keys_tab_and_palette_switch_screens():
    app = make_app()

    async def scenario(pilot):
        order = ["overview", "memory", "lifetimes", "buffers", "schedule", "ops", "pool"]
        for number, mode in enumerate(order, start=1):
            await keys(pilot, str(number))
            assert app.current_mode == mode
        await keys(pilot, "tab")
        assert app.current_mode == "overview"  # wraps around
        await keys(pilot, "shift+tab")
        assert app.current_mode == "pool"
        await keys(pilot, "8")  # no Diff screen with one plan: it says why
        assert app.current_mode == "pool"
        (note,) = app._notifications
        assert "compares two plans: start it as dctms-tui OLD NEW" in note.message
        assert " 8 Diff " in screen_text(app).splitlines()[0]  # dimmed in the navigation bar
        await keys(pilot, "ctrl+p")
        await pilot.press(*"lifetim")
        await pilot.pause(0.3)
        await keys(pilot, "enter")
        assert app.current_mode == "lifetimes"
        await keys(pilot, "question_mark")
        assert isinstance(app.screen, HelpScreen)
        assert "+ / -" in screen_text(app)
        assert "group the tensors under a heading per module" in screen_text(app)
        await keys(pilot, "escape")
        assert not isinstance(app.screen, HelpScreen)
        await keys(pilot, "q")
        assert app.return_code == 0

    drive(app, scenario)


def test_digits_and_q_typed_into_search_stay_there():
    app = make_app(screen="ops")

    async def scenario(pilot):
        await keys(pilot, "slash", "q", "2")
        assert app.current_mode == "ops" and app.is_running
        assert app.screen.query_one("#search").value == "q2"

    drive(app, scenario)


# ------------------------------------------------------------------------------------ memory


def test_memory_peak_is_the_lower_bound_and_live_table_follows_the_slot():
    plan = make_tiny_plan()
    phase = plan.phases[0]
    app = make_app(plan, screen="memory")

    async def scenario(pilot):
        curve = app.screen.query_one(MemoryCurve)
        assert max(curve.curve) == phase.lower_bound_bytes
        assert curve.peak_slot == 1 and curve.slot == 1
        summary = text(app.screen.query_one("#memory-summary"))
        assert f"peak {phase.lower_bound_bytes:,} B" in summary and "at slot 1" in summary
        assert f"arena {phase.arena_bytes:,} B" in summary
        assert f"lower bound {phase.lower_bound_bytes:,} B" in summary
        table = app.screen.query_one("#live", VirtualTable)
        assert sorted(table.keys) == ["scratch.3", "t0"]  # live at the peak (slot 1)
        await keys(pilot, "left_square_bracket")  # slot 0: only t0
        assert curve.slot == 0 and table.keys == ["t0"]
        assert "1 tensors live at slot 0" in text(app.screen.query_one("#live-title"))
        await keys(pilot, "right_square_bracket", "right_square_bracket", "right_square_bracket")
        assert curve.slot == 3 and sorted(table.keys) == ["t2", "t3"]
        await keys(pilot, "m")
        assert curve.slot == 1
        # Sort by size: t0 (16 B) and scratch.3 (8 B) both take 64 aligned bytes; by raw bytes next.
        table.sort_by("bytes", reverse=True)
        assert table.keys == ["t0", "scratch.3"]
        table.sort_by("bytes")
        assert table.keys == ["scratch.3", "t0"]
        await keys(pilot, "s")
        assert table.sorted_by == ("aligned", True)
        await keys(pilot, "s")  # again: smallest first
        assert table.sorted_by == ("aligned", False)
        await keys(pilot, "s")
        assert table.sorted_by == ("aligned", True)

    drive(app, scenario)


def test_the_first_s_sorts_largest_first():
    plan = make_tiny_plan()
    app = make_app(plan, screen="memory")

    async def scenario(pilot):
        table = app.screen.query_one("#live", VirtualTable)
        largest = list(table.keys)  # the list opens largest first
        await keys(pilot, "s")  # and the first s says so, rather than turning it round
        assert table.sorted_by == ("aligned", True) and table.keys == largest
        await keys(pilot, "s")
        assert table.sorted_by == ("aligned", False)

    drive(app, scenario)


# --------------------------------------------------------------------------------- lifetimes


def test_lifetimes_selection_shows_the_tensors_real_figures():
    plan = make_tiny_plan()
    t2 = next(t for t in plan.phases[0].tensors if t.id == "t2")
    app = make_app(plan, screen="lifetimes")

    async def scenario(pilot):
        gantt = app.screen.query_one(Gantt)
        assert [r.key for r in gantt.rows][:2] == ["t0", "t1"]
        await keys(pilot, "j", "j", "j", "j")  # t0 t1 k_out scratch.3 t2
        assert gantt.selected.key == "t2"
        details = text(app.screen.query_one("#details"))
        assert f"interval [{t2.interval[0]}, {t2.interval[1]}]" in details
        assert f"buffer {t2.buffer}" in details and f"offset {t2.offset:,}" in details
        assert "producer: op 2 Multiply (slot 2, model.layers.0.self_attn)" in details
        assert "consumers (1): op 4 Maximum (slot 3, model.layers.0.self_attn)" in details
        assert "module model.layers.0.self_attn" in details
        await keys(pilot, "k")
        assert gantt.selected.key == "scratch.3"
        assert "producer: op 3 DynamicSliceUpdate" in text(app.screen.query_one("#details"))

    drive(app, scenario)


def test_lifetimes_filter_and_per_buffer_toggle():
    app = make_app(screen="lifetimes")

    async def scenario(pilot):
        gantt = app.screen.query_one(Gantt)
        await search(pilot, "prim:maximum")
        assert [r.key for r in gantt.rows] == ["t3"]
        assert app.focused is gantt  # enter goes back to the chart
        assert "interval [3, 4]" in text(app.screen.query_one("#details"))
        await search(pilot, "layer:0")
        assert [r.key for r in gantt.rows] == ["k_out", "scratch.3", "t2", "t3"]
        await search(pilot, "")
        assert len(gantt.rows) == 7
        await keys(pilot, "b")  # one row per buffer: the cursor follows t0 to buffer 0
        assert [r.key for r in gantt.rows] == ["buffer 0", "buffer 1"]
        assert [b.tensor for b in gantt.rows[1].bars] == ["scratch.3", "t2", "out"]
        assert "buffer 0" in text(app.screen.query_one("#details"))
        await keys(pilot, "b")
        assert len(gantt.rows) == 7

    drive(app, scenario)


def test_lifetimes_search_and_group_by_module():
    app = make_app(screen="lifetimes")

    async def scenario(pilot):
        gantt = app.screen.query_one(Gantt)
        await search(pilot, "mod:embed_tokens")
        assert [r.key for r in gantt.rows] == ["t0", "t1"]
        await search(pilot, "")
        before = [r.key for r in gantt.rows]
        await keys(pilot, "g")  # grouped by module (here the slot order already is)
        assert app.screen.by_module
        after = [r.key for r in gantt.rows if r.bars]
        assert sorted(after) == sorted(before) and after[-1] == "out"
        # visibly: a heading row per module, on screen, above its tensors
        shown = screen_text(app)
        for module in ("model.embed_tokens", "model.layers.0.self_attn", "(step)"):
            assert f"▸ {module}" in shown
        assert gantt.selected.key == "t0"  # the cursor stays on its tensor
        await keys(pilot, "k")
        assert gantt.selected.key == "module model.embed_tokens"
        assert "module model.embed_tokens: 2 tensor(s)" in text(app.screen.query_one("#details"))
        await keys(pilot, "g")
        assert not app.screen.by_module and [r.key for r in gantt.rows] == before
        # the module column is not cut: the whole short path shows beside each tensor
        assert "embed_tokens" in next(
            line for line in screen_text(app).splitlines() if line.startswith(" t0 ")
        )
        # escape in the search box, or over the chart, drops the filter
        await search(pilot, "prim:maximum")
        assert [r.key for r in gantt.rows] == ["t3"]
        await keys(pilot, "escape")
        assert [r.key for r in gantt.rows] == before and app.focused is gantt
        await keys(pilot, "slash")
        app.focused.value = "layer:0"
        await keys(pilot, "escape")
        assert [r.key for r in gantt.rows] == before and app.focused is gantt
        assert app.screen.query_one("#search").value == ""

    drive(app, scenario)


def test_zoom_and_pan_on_the_tiny_plan():
    app = make_app(screen="lifetimes")

    async def scenario(pilot):
        gantt = app.screen.query_one(Gantt)
        fit = gantt.fit_scale()
        assert gantt.fitted and gantt.scale == fit
        assert gantt.total_cells <= gantt.timeline_width  # every slot visible
        await keys(pilot, "plus")
        assert gantt.scale == 16.0 and not gantt.fitted  # capped at 16 cells per slot
        await keys(pilot, "minus")
        assert gantt.scale == fit and gantt.fitted
        await keys(pilot, "minus")
        assert gantt.scale == fit  # never smaller than "all slots visible"

    drive(app, scenario, size=(100, 30))


# ----------------------------------------------------------------------- buffers, schedule, ops


def test_buffers_screen():
    plan = make_tiny_plan()
    app = make_app(plan, screen="buffers")

    async def scenario(pilot):
        reuse = app.screen.query_one("#reuse", Gantt)
        assert [r.buffer for r in reuse.rows] == [0, 1]
        details = text(app.screen.query_one("#buffer-details"))
        assert "buffer 0" in details and "2 tenant(s)" in details and "t3 (0.self_attn) [3,4] 16 B @0" in details
        await keys(pilot, "j")
        assert "3 tenant(s)" in text(app.screen.query_one("#buffer-details"))
        arena = app.screen.query_one(ArenaMap)
        assert arena.arena_bytes == plan.phases[0].arena_bytes and len(arena.placements) == 5
        await keys(pilot, "plus")  # the two charts zoom together
        assert arena.scale == reuse.scale and not arena.fitted

    drive(app, scenario)


def test_schedule_slots_and_sync_points():
    plan = make_tiny_plan()
    app = make_app(plan, screen="schedule")

    async def scenario(pilot):
        slots = app.screen.query_one("#slots", VirtualTable)
        syncs = app.screen.query_one("#syncs", VirtualTable)
        assert slots.keys == ["0", "1", "2", "3", "4"]
        assert slots.rows[1][1] == "1 Reshape · 3 DynamicSliceUpdate"
        sp = plan.phases[0].sync_points[0]
        assert syncs.rows == [(str(sp.slot), sp.reason, "2", "k_out out")]
        await keys(pilot, "j")
        assert "slot 1" in text(app.screen.query_one("#schedule-details"))
        await keys(pilot, "e")
        details = text(app.screen.query_one("#schedule-details"))
        assert f"sync point after slot {sp.slot}" in details and "k_out out" in details
        await search(pilot, "prim:argmax")
        assert slots.keys == ["4"]

    drive(app, scenario)


def test_ops_search_and_details():
    app = make_app(screen="ops")

    async def scenario(pilot):
        table = app.screen.query_one("#ops", VirtualTable)
        assert table.row_count == 6
        await search(pilot, "Multiply")
        assert table.keys == ["2"]
        assert table.rows[0][:4] == ("2", "Multiply", "model.layers.0.self_attn", "2")
        assert table.rows[0][4] == "t1[1,8] c_half[]"
        details = text(app.screen.query_one("#op-details"))
        assert "op 2 Multiply" in details and "t2[1,8] float16" in details
        assert "1 of 6 ops match 'Multiply'" in text(app.screen.query_one("#ops-count"))
        await search(pilot, "layer:0")
        assert table.keys == ["2", "3", "4"]
        await keys(pilot, "j")
        assert "op 3 DynamicSliceUpdate" in text(app.screen.query_one("#op-details"))

    drive(app, scenario)


# -------------------------------------------------------------------------------------- diff


def changed_plan(plan: Plan) -> Plan:
    """``plan`` with 1 MiB more runtime allowance (total and free follow) and another architecture."""
    e = plan.envelope
    extra = 2**20
    envelope = msgspec.structs.replace(
        e, runtime=e.runtime + extra, total=e.total + extra, free=e.free - extra
    )
    model = msgspec.structs.replace(plan.model, architecture="tiny2")
    return msgspec.structs.replace(plan, envelope=envelope, model=model)


def test_diff_mode_opens_on_the_deltas():
    old = make_tiny_plan()
    new = changed_plan(old)
    app = make_app(new, old=old)

    async def scenario(pilot):
        assert app.current_mode == "diff"
        envelope = text(app.screen.query_one("#diff-envelope"))
        runtime = next(line for line in envelope.splitlines() if line.strip().startswith("runtime"))
        assert f"{old.envelope.runtime:,}" in runtime and f"{new.envelope.runtime:,}" in runtime
        assert "+1,048,576" in runtime and "+1.00" in runtime and "+102,400.00" in runtime
        weights = next(line for line in envelope.splitlines() if line.strip().startswith("weights"))
        assert "+0" in weights
        fingerprint = text(app.screen.query_one("#diff-fingerprint"))
        arch = next(line for line in fingerprint.splitlines() if "architecture" in line)
        assert "tiny" in arch and "tiny2" in arch and "changed" in arch
        assert "4 figure(s) differ" in text(app.screen.query_one("#diff-header"))
        roofline = text(app.screen.query_one("#diff-roofline"))  # same graph, same speed
        speed = next(line for line in roofline.splitlines() if "decode tok/s" in line)
        assert "+0.000" in speed
        await keys(pilot, "2")  # the other screens show the new plan
        assert app.current_mode == "memory"
        await keys(pilot, "8")
        assert app.current_mode == "diff"

    drive(app, scenario)


def test_diff_shows_intermediate_bytes_by_module():
    old = make_tiny_plan()
    phase = old.phases[0]
    # t2 (made in model.layers.0.self_attn) larger: 128 aligned bytes instead of 64
    tensors = [msgspec.structs.replace(t, bytes=100) if t.id == "t2" else t for t in phase.tensors]
    new = msgspec.structs.replace(old, phases=[msgspec.structs.replace(phase, tensors=tensors)])
    app = make_app(new, old=old)

    async def scenario(pilot):
        table = text(app.screen.query_one("#diff-modules"))
        row = next(line for line in table.splitlines() if "model.layers.*.self_attn" in line)
        assert "decode" in row and row.split()[-1] == "+64"  # its tenants grew by 64 aligned bytes
        assert "embed_tokens" not in table  # unchanged modules are left out

    drive(app, scenario)
    same = make_app(old, old=old)

    async def nothing(pilot):
        assert not same.screen.query("#diff-modules")

    drive(same, nothing)


# ------------------------------------------------------------------------------- bad input


def run_tui(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dctms.tui.app", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


def broken_plan(tmp_path: Path) -> Path:
    """t2 moved onto t0's bytes while both are live: the verifier's arena_overlap rule."""
    path = tmp_path / "broken.plan"
    write_plan(make_broken_tiny_plan(), path)
    return path


@pytest.mark.parametrize("kind", ["missing", "not json", "broken"])
def test_bad_plan_one_line_exit_2_before_any_screen(tmp_path: Path, kind: str):
    path = tmp_path / "x.plan"
    if kind == "not json":
        path.write_text("{ nope")
    elif kind == "broken":
        path = broken_plan(tmp_path)
    with pytest.raises(PlanError) as caught:
        read_plan(path)
    proc = run_tui(str(path))
    assert proc.returncode == 2
    assert proc.stdout == ""  # no screen was drawn
    assert proc.stderr == f"dctms-tui: {caught.value}\n"
    # The same first line `dctms validate` prints for this file.
    validate = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert validate.returncode == 2
    assert proc.stderr.startswith("dctms-tui: " + validate.stderr.splitlines()[0])


def test_bad_second_plan_and_usage_errors(tmp_path: Path, plan_file: Path):
    proc = run_tui(str(plan_file), str(tmp_path / "missing.plan"))
    assert proc.returncode == 2 and proc.stderr.startswith("dctms-tui: ")
    assert "missing.plan: no such file" in proc.stderr and len(proc.stderr.splitlines()) == 1
    proc = run_tui(str(plan_file), str(plan_file), str(plan_file))
    assert proc.returncode == 2 and "give one PLAN, or OLD NEW" in proc.stderr


# ------------------------------------------------------------------------------ the 7B plan


@pytest.mark.slow
def test_7b_paints_and_scrolls(tmp_path: Path):
    # The app paints its first screen of the 7B plan and says so; how fast is a benchmark
    # (bench/tui_startup.py, a ratio against a bare Textual app in the same run), not a unit test.
    proc = run_tui(str(PLANS / "qwen7b.plan"), "--exit-after-paint")
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout.split("painted ")[1].split(" s")[0]) > 0

    plan = read_plan(PLANS / "qwen7b.plan")
    app = InspectorApp(Inspection(plan, "qwen7b.plan"), screen="lifetimes")

    async def scenario(pilot):
        gantt = app.screen.query_one(Gantt)
        phase = plan.phases[0]
        assert len(gantt.rows) == len(phase.tensors) and gantt.num_slots == len(phase.slots)
        # Drawing a whole screen of the chart costs only the visible lines.
        height = gantt.scrollable_content_region.height
        assert all(gantt.render_line(y).cell_length > 0 for y in range(height))
        await keys(pilot, "pagedown", "pagedown", "end")
        assert gantt.cursor == len(gantt.rows) - 1 and gantt.scroll_y > 0
        assert gantt.selected.key == gantt.rows[-1].key
        await keys(pilot, "plus", "plus", "plus")
        assert gantt.scale == pytest.approx(gantt.fit_scale() * 8)
        last = gantt.rows[-1].bars[0]
        c0, c1 = gantt.columns_of(last.start, last.end)  # zoom kept the selection in view
        assert c0 < gantt.scroll_x + gantt.timeline_width and c1 >= gantt.scroll_x
        before = gantt.scroll_x
        await keys(pilot, "h")
        assert gantt.scroll_x < before
        await keys(pilot, "p")  # the decode phase
        assert app.phase == 1 and len(gantt.rows) == len(plan.phases[1].tensors)
        await keys(pilot, "6")
        ops = app.screen.query_one("#ops", VirtualTable)
        assert ops.row_count == len(plan.phases[1].ops)
        await keys(pilot, "end")
        assert ops.selected_key == str(len(plan.phases[1].ops) - 1)
        await keys(pilot, "2")
        curve = app.screen.query_one(MemoryCurve)
        assert max(curve.curve) == plan.phases[1].lower_bound_bytes

    drive(app, scenario, size=(160, 45))
