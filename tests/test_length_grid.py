"""``dctms compile --token-step/--window-step``: the length grid the phases are verified on.

The steps decide which points are traced and verified (and so which lengths the runner pads a
call to); the plan records them in ``compile``, so ``dctms check`` re-compiles the same plan, and
``show`` / ``diff`` print the grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY_QWEN2

from dctms.cli.main import main as cli
from dctms.schema.io import read_plan
from dctms.toolkit.check import check_plan, compile_command

N, M = 80, 40  # prefill chunk 80 (= N), decode windows up to N + M


def _config(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_QWEN2))
    return folder / "config.json"


def _compile(tmp_path: Path, name: str, *flags: str) -> Path:
    out = tmp_path / name
    args = ["compile", str(_config_once(tmp_path)), "-N", str(N), "-M", str(M), "-q", "-o", str(out)]
    assert cli([*args, *flags]) == 0
    return out


def _config_once(tmp_path: Path) -> Path:
    path = tmp_path / "model" / "config.json"
    return path if path.exists() else _config(tmp_path)


def _values(plan, phase: str, axis: int) -> list[int]:
    lengths = next(p for p in plan.phases if p.name == phase).lengths
    return sorted({p[axis] for p in lengths.points})


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("grid")
    return _compile(tmp, "default.plan"), _compile(
        tmp, "coarse.plan", "--token-step", "32", "--window-step", "64"
    )


def test_the_steps_choose_the_verified_points(plans) -> None:
    default, coarse = read_plan(plans[0]), read_plan(plans[1])
    # default: tokens on multiples of 16, decode windows on multiples of 32 (each bound too)
    assert _values(default, "prefill", 0) == [16, 32, 48, 64, 80]
    assert _values(default, "decode", 0) == [32, 64, 96, 120]
    assert _values(coarse, "prefill", 0) == [32, 64, 80]
    assert _values(coarse, "decode", 0) == [64, 120]
    assert (coarse.compile.token_step, coarse.compile.window_step) == (32, 64)
    assert (default.compile.token_step, default.compile.window_step) == (None, None)
    # the same bound and envelope: only the points the runner may run at differ
    assert coarse.envelope == default.envelope


def test_check_recompiles_a_plan_with_its_grid(plans) -> None:
    result = check_plan(plans[1])
    assert result.ok, result.line()
    command = compile_command(read_plan(plans[1]).compile, "MODEL", "out.plan")
    assert "--token-step 32 --window-step 64" in command
    assert "--token-step" not in compile_command(read_plan(plans[0]).compile, "MODEL", "o")


def test_show_and_diff_print_the_grid(plans, capsys) -> None:
    assert cli(["show", str(plans[1])]) == 0
    out = capsys.readouterr().out
    assert "grid: window 64, 120" in out
    assert "grid steps: --token-step 32, --window-step 64" in out
    assert cli(["diff", str(plans[0]), str(plans[1])]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "length_grid_decode" in x)
    assert "window 32-120 (4)" in line and "window 64-120 (2)" in line


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--token-step", "0"], "--token-step must be at least 1, got 0"),
        (["--window-step", "-3"], "--window-step must be at least 1, got -3"),
        (["--window-step", "99999999"], "--window-step must be at most"),
    ],
)
def test_a_bad_step_is_one_line_and_exit_2(tmp_path, capsys, flags, message) -> None:
    out = tmp_path / "x.plan"
    code = cli(["compile", str(_config(tmp_path)), "-N", "16", "-M", "8", "-q", "-o", str(out), *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
