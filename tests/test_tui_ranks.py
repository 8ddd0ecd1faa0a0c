"""dctms-tui on a folder of rank plans (issue 18): the Overview's rank table holds each rank plan's
envelope, r / R moves every screen to another rank's plan, a bad folder is one stderr line.

The 2-rank pipeline split of test_distributed's 3-layer tiny qwen2 is compiled in this process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_distributed import _opts, model3  # noqa: F401 (model3 is a fixture)
from test_tui_app import screen_text, text

from dctms.schema.io import write_plan
from dctms.schema.model_folder import open_model_folder
from dctms.schema.ranks import read_rank_plans
from dctms.toolkit.kinds.distributed import compile_ranks
from dctms.tui.app import InspectorApp, main
from dctms.tui.screens.help import HelpScreen
from dctms.tui.state import Inspection

SIZE = (120, 40)


@pytest.fixture(scope="module")
def folders(model3, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    """``pipeline/`` and ``tensor/``: rank0.plan and rank1.plan as compile --ranks 2 writes them."""
    out = {}
    for mode in ("pipeline", "tensor"):
        folder = tmp_path_factory.mktemp(mode)
        for plan in compile_ranks(open_model_folder(model3), _opts(ranks=2, parallel=mode)):
            write_plan(plan, folder / f"rank{plan.distributed.rank}.plan")
        out[mode] = folder
    return out


def _app(folder: Path) -> InspectorApp:
    ranks = read_rank_plans(folder)
    return InspectorApp(Inspection(ranks[0], str(folder), ranks=ranks))


def _drive(app: InspectorApp, scenario) -> None:
    async def run() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            await scenario(pilot)

    asyncio.run(run())


async def _press(pilot, *keys: str) -> None:
    await pilot.press(*keys)
    await pilot.pause()


def _rank_lines(app: InspectorApp) -> dict[int, list[str]]:
    """The rank table's rows, by rank: [rank, layers, shard, weights, kv, intermediate, M_max, ...]."""
    rows = {}
    for line in text(app.screen.query_one("#ranks")).splitlines():
        cells = line.replace("▶", " ").split()
        if len(cells) > 2 and cells[0].isdigit() and cells[1][0].isdigit():  # not the title
            rows[int(cells[0])] = cells
    return rows


def _ops_note(plan) -> str:
    return f"{len(plan.phases[0].ops):,} ops, {len(plan.phases[0].tensors):,} tensors"


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_the_rank_table_holds_each_rank_plans_envelope(folders, mode) -> None:
    ranks = read_rank_plans(folders[mode])
    app = _app(folders[mode])

    async def scenario(pilot) -> None:
        rows = _rank_lines(app)
        assert sorted(rows) == [0, 1]
        for plan in ranks:
            d, e = plan.distributed, plan.envelope
            cells = rows[d.rank]
            span = f"{d.layers[0]}-{d.layers[1] - 1}" if d.layers[1] - d.layers[0] > 1 else "0"
            shard = ["-"] if mode == "pipeline" else [str(d.rank), "of", "2"]
            values = [f"{v:,}" for v in (e.weights, e.kv, e.intermediate, e.total)]
            assert cells[: 2 + len(shard) + 4] == [str(d.rank), span, *shard, *values]
        largest = max(ranks, key=lambda p: (p.envelope.total, -p.distributed.rank))
        assert [r for r, cells in rows.items() if cells[-1] == "largest"] == [
            largest.distributed.rank
        ]
        assert "rank0.plan (rank 0 of 2)" in app.title

    _drive(app, scenario)


def test_r_and_shift_r_move_every_screen_to_another_rank(folders) -> None:
    r0, r1 = read_rank_plans(folders["pipeline"])
    assert _ops_note(r0) != _ops_note(r1)  # rank 0 runs two layers, rank 1 one
    app = _app(folders["pipeline"])

    async def scenario(pilot) -> None:
        await _press(pilot, "2")  # the Memory screen is built for rank 0 and kept ...
        assert _ops_note(r0) in screen_text(app)
        await _press(pilot, "1", "r")  # ... and dropped when r moves to rank 1
        shown = screen_text(app)
        assert app.inspection.plan is app.inspection.ranks[1]
        bounds = text(app.screen.query_one("#bounds"))  # below the findings: maybe scrolled away
        assert "rank 1 of 2, pipeline parallel: layers 0 of 3" in bounds  # the bounds row
        assert f"{r1.envelope.total:,} B" in shown  # the envelope bar's M_max
        assert "rank1.plan (rank 1 of 2)" in app.title and "rank1.plan" in shown
        assert _rank_lines(app)[1][0] == "1" and "▶" in text(app.screen.query_one("#ranks"))
        await _press(pilot, "2")
        assert _ops_note(r1) in screen_text(app)
        await _press(pilot, "R")  # the screen on view is rebuilt for rank 0
        assert app.current_mode == "memory" and _ops_note(r0) in screen_text(app)
        await _press(pilot, "R")  # wraps round to the last rank
        assert app.inspection.rank == 1 and _ops_note(r1) in screen_text(app)
        await _press(pilot, "question_mark")
        assert isinstance(app.screen, HelpScreen)
        assert "next / previous rank's plan" in screen_text(app)

    _drive(app, scenario)


def test_a_single_plan_has_no_rank_key(folders) -> None:
    plan = read_rank_plans(folders["pipeline"])[0]
    app = InspectorApp(Inspection(plan, "rank0.plan"))

    async def scenario(pilot) -> None:
        assert not app.screen.query("#ranks")
        await _press(pilot, "r")
        assert app.inspection.plan is plan and "rank" not in app.title.replace("rank0", "")
        await _press(pilot, "question_mark")
        assert "next / previous rank's plan" not in screen_text(app)

    _drive(app, scenario)


def test_a_bad_rank_folder_is_one_line_and_exit_2(folders, tmp_path, capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "rank0.plan").write_bytes((folders["pipeline"] / "rank0.plan").read_bytes())
    (mixed / "rank1.plan").write_bytes((folders["tensor"] / "rank1.plan").read_bytes())
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "rank0.plan").write_bytes((folders["pipeline"] / "rank0.plan").read_bytes())
    for folder, message in [
        (empty, "no rank0.plan"),
        (mixed, "not rank 1 of the 2-rank pipeline split"),
        (alone, "rank1.plan: missing (rank0.plan is rank 0 of 2)"),
    ]:
        assert main([str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("dctms-tui: ") and message in err, err


def test_the_distributed_guide_shows_this_rank_table(folders) -> None:
    """docs/how-to/distributed.md shows the pipeline folder's rank table as the Overview draws it."""
    guide = (Path(__file__).resolve().parents[1] / "docs" / "how-to" / "distributed.md").read_text()
    shown = guide.split("draws this):\n\n```\n", 1)[1].split("```", 1)[0]
    app = _app(folders["pipeline"])

    async def scenario(pilot) -> None:
        table = text(app.screen.query_one("#ranks"))
        assert shown == "".join(line.rstrip() + "\n" for line in table.splitlines()), table

    _drive(app, scenario)
