"""``dctms validate`` and ``dctms show``: output, exit status, and one clean line for every bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from dctms.cli import main as cli
from dctms.schema.types import SCHEMA_VERSION, Plan
from dctms.views.show import show_text


def run_cli(*argv: str) -> tuple[int, str, str]:
    """Run the real console entry point in a fresh interpreter (catches tracebacks at import too)."""
    proc = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout, proc.stderr


def edited(plan_bytes: bytes, edit) -> bytes:
    document = json.loads(plan_bytes)
    edit(document)
    return json.dumps(document).encode()


def _tensor0(document) -> dict:
    return document["phases"][0]["tensors"][0]


BAD_INPUTS = {
    "missing file": None,
    "directory": "DIR",
    "empty file": b"",
    "binary garbage": bytes(range(256)) * 4,
    "truncated JSON": lambda good: good[: len(good) // 2],
    "wrong type": lambda good: edited(good, lambda d: _tensor0(d).update(bytes="16")),
    "unknown field": lambda good: edited(good, lambda d: d["stats"].update(colour="red")),
    "negative size": lambda good: edited(good, lambda d: _tensor0(d).update(bytes=-16)),
    "absurd size": lambda good: edited(good, lambda d: d["envelope"].update(total=10**30)),
    "newer schema": lambda good: edited(good, lambda d: d.update(schema_version=99)),
}


def make_bad(tmp_path: Path, kind: str, good: bytes) -> Path:
    recipe = BAD_INPUTS[kind]
    path = tmp_path / "bad.plan"
    if recipe is None:
        return path
    if recipe == "DIR":
        path.mkdir()
        return path
    path.write_bytes(recipe(good) if callable(recipe) else recipe)
    return path


@pytest.mark.parametrize("command", ["validate", "show"])
@pytest.mark.parametrize("kind", list(BAD_INPUTS))
def test_bad_input_one_line_exit_2(
    tmp_path, tiny_plan_bytes: bytes, command: str, kind: str
) -> None:
    path = make_bad(tmp_path, kind, tiny_plan_bytes)
    code, out, err = run_cli(command, str(path))
    assert code == 2, err
    assert out == ""
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    assert "Traceback" not in err and str(path) in err


def test_bad_input_messages(tmp_path, tiny_plan_bytes: bytes, capsys) -> None:
    expected = {
        "missing file": "no such file",
        "directory": "is a directory, not a plan file",
        "empty file": "file is empty",
        "binary garbage": "not valid JSON",
        "truncated JSON": "not valid JSON: Input data was truncated",
        "wrong type": '$.phases[0].tensors[0].bytes: expected integer, got "16"',
        "unknown field": "$.stats.colour: unknown field",
        "negative size": "$.phases[0].tensors[0].bytes: must be >= 0, got -16",
        "absurd size": "$.envelope.total: must be <= 9007199254740992, got 1.000e+30",
        "newer schema": (
            f"plan schema_version 99 is newer than this dctms understands ({SCHEMA_VERSION}); "
            "upgrade dctms"
        ),
    }
    assert set(expected) == set(BAD_INPUTS)
    for kind, message in expected.items():
        case = tmp_path / kind.replace(" ", "_")
        case.mkdir()
        path = make_bad(case, kind, tiny_plan_bytes)
        assert cli.main(["validate", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"{path}: {message}"), (kind, err)


# ----------------------------------------------------------------------------------------- validate


def test_validate_ok(plan_file: Path, capsys) -> None:
    assert cli.main(["validate", str(plan_file)]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{plan_file}: ok (6 ops, 7 tensors)\n" and captured.err == ""


def test_validate_checks_every_plan_and_every_problem(
    tmp_path, plan_file: Path, tiny_plan_bytes, capsys
) -> None:
    # semantic problems: t0 moved onto the bytes of scratch.3 (slot 1) and t2 (slot 2), a wrong stat
    broken = tmp_path / "broken.plan"
    broken.write_bytes(
        edited(
            tiny_plan_bytes,
            lambda d: (_tensor0(d).update(offset=64), d["stats"].update(arena_bytes=64)),
        )
    )
    missing = tmp_path / "missing.plan"
    assert cli.main(["validate", str(broken), str(plan_file), str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == f"{plan_file}: ok (6 ops, 7 tensors)\n"
    assert captured.err.splitlines() == [
        f"{broken}: $.phases[0].tensors[4]: bytes [64, 72) overlap tensor 't0' [64, 80) "
        "while both are live (slots 1..1)",
        f"{broken}: $.phases[0].tensors[2]: bytes [64, 80) overlap tensor 't0' [64, 80) "
        "while both are live (slots 2..2)",
        f"{broken}: $.stats.arena_bytes: 64, but the largest phase arena is 128",
        f"{missing}: no such file",
    ]


def test_validate_needs_a_plan(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["validate"])
    assert exit_.value.code == 2
    assert "PLAN" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["validate", "--help"], ["show", "--help"]])
def test_help(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 0
    assert "usage: dctms" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------- show


def test_show_text(plan_file: Path, tiny_plan: Plan, capsys) -> None:
    assert cli.main(["show", str(plan_file)]) == 0
    out = capsys.readouterr().out
    assert out == show_text(tiny_plan)
    for expected in [
        "input tokens (N)     8",
        "total = M_max                   1,664         0.00",
        "device                      1,048,576         1.00",
        "runtime                         1,024         0.00  (test allowance)",
        "logical tensors                     5      448",
        "physical buffers                    2      122",
        "reduction                      60.00%   72.77%",
        "decode                                  128              128   1.000",
    ]:
        assert expected in out, expected


def test_show_text_without_device_and_zero_bound(tiny_plan: Plan) -> None:
    envelope = msgspec.structs.replace(tiny_plan.envelope, device=None, free=None)
    phase = msgspec.structs.replace(tiny_plan.phases[0], lower_bound_bytes=0)
    text = show_text(msgspec.structs.replace(tiny_plan, envelope=envelope, phases=[phase]))
    assert "device" not in text and "free" not in text
    assert "n/a" in text


def test_show_json(plan_file: Path, tiny_plan: Plan, capsys) -> None:
    assert cli.main(["show", str(plan_file), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert list(summary) == ["envelope", "stats", "bounds"]
    assert summary == {
        "envelope": msgspec.to_builtins(tiny_plan.envelope),
        "stats": msgspec.to_builtins(tiny_plan.stats),
        "bounds": msgspec.to_builtins(tiny_plan.bounds),
    }
    assert summary["envelope"]["total"] == 1664 and summary["stats"]["reduction"] == 0.6


def test_show_refuses_invalid_plan_in_one_line(tmp_path, tiny_plan_bytes, capsys) -> None:
    path = tmp_path / "bad.plan"
    path.write_bytes(
        edited(tiny_plan_bytes, lambda d: d["stats"].update(arena_bytes=1, lower_bound_bytes=1))
    )
    assert cli.main(["show", str(path)]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"dctms show: {path}: $.stats.arena_bytes: 1, but the largest phase arena is 128 (+1 more)\n"
    )
