"""``dctms pack``: the summary, the offsets file, and one clean line for every bad input."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dctms.cli import main as cli
from dctms.toolkit.pack.instances import tiles
from dctms.toolkit.pack.problem import is_valid, make_problem


def _write_tiles(path: Path, n: int, seed: int = 2) -> None:
    p, _ = tiles(n, seed=seed, width=1 << 16, span=500)
    lines = ["id,start,end,size,alignment"]
    lines += [f"t{i},{p.start[i]},{p.end[i]},{p.size[i]},{p.align[i]}" for i in range(p.n)]
    path.write_text("\n".join(lines) + "\n")


def _read_problem(path: Path):
    rows = list(csv.DictReader(path.open()))
    return rows, make_problem(
        [int(r["start"]) for r in rows],
        [int(r["end"]) for r in rows],
        [int(r["size"]) for r in rows],
        [int(r["alignment"]) for r in rows],
    )


def test_pack_writes_valid_offsets_and_a_json_summary(tmp_path: Path, capsys) -> None:
    problem_csv, out = tmp_path / "p.csv", tmp_path / "offsets.csv"
    _write_tiles(problem_csv, 150, seed=1)  # greedy 1.26 x the optimum; the search closes it
    assert cli.main(["pack", str(problem_csv), "--json", "-o", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["lower_bound"] == 1 << 16
    assert summary["arena"] == 1 << 16 and summary["proven_optimal"] and summary["gap"] == 0
    assert summary["proof"] == "lower_bound" and summary["buffers"] == 150
    assert summary["greedy_arena"] > summary["arena"]
    rows, problem = _read_problem(problem_csv)
    written = list(csv.DictReader(out.open()))
    assert [r["id"] for r in written] == [r["id"] for r in rows]
    import numpy as np

    offsets = np.array([int(r["offset"]) for r in written])
    assert is_valid(problem, offsets)
    assert int((offsets + problem.size).max()) == summary["arena"]


def test_pack_text_summary_reports_the_gap_without_search(tmp_path: Path, capsys) -> None:
    problem_csv = tmp_path / "p.csv"
    _write_tiles(problem_csv, 300, seed=4)
    assert cli.main(["pack", str(problem_csv), "--seconds", "0"]) == 0
    text = capsys.readouterr().out
    assert "lower bound   65,536 bytes" in text
    assert "not proven: at most" in text and "ratio         1.0000" not in text


def test_same_input_same_offsets(tmp_path: Path) -> None:
    problem_csv = tmp_path / "p.csv"
    _write_tiles(problem_csv, 250, seed=9)
    outs = [tmp_path / "a.csv", tmp_path / "b.csv"]
    for out in outs:
        assert cli.main(["pack", str(problem_csv), "--seconds", "0.1", "-o", str(out)]) == 0
    assert outs[0].read_bytes() == outs[1].read_bytes()


def test_alignment_column_is_optional(tmp_path: Path, capsys) -> None:
    problem_csv = tmp_path / "p.csv"
    problem_csv.write_text("size,end,start,id\n10,4,0,a\n20,8,2,b\n5,9,5,c\n")
    assert cli.main(["pack", str(problem_csv), "--alignment", "16", "--json", "-o", "-"]) == 0
    out = capsys.readouterr()
    rows = list(csv.DictReader(out.out.splitlines()))
    assert {r["id"] for r in rows} == {"a", "b", "c"}
    assert all(int(r["offset"]) % 16 == 0 for r in rows)
    assert json.loads(out.err)["lower_bound"] == 30


BAD_CSV = {
    "empty file": ("", "empty file"),
    "unknown column": ("id,start,end,size,colour\n", "unknown column 'colour'"),
    "missing column": ("id,start,size\n", "missing column 'end'"),
    "not an integer": ("id,start,end,size\na,0,1.5,8\n", "line 2: end '1.5' is not an integer"),
    "end before start": ("id,start,end,size\na,5,5,8\n", "line 2: end 5 is not after start 5"),
    "negative size": ("id,start,end,size\na,0,1,-8\n", "line 2: size -8 is outside"),
    "absurd size": ("id,start,end,size\na,0,1,1" + "0" * 30 + "\n", "line 2: size"),
    "absurd time": ("id,start,end,size\na,0,1" + "0" * 25 + ",8\n", "line 2: end"),
    "zero alignment": ("id,start,end,size,alignment\na,0,1,8,0\n", "line 2: alignment 0"),
    "duplicate id": ("id,start,end,size\na,0,1,8\na,1,2,8\n", "line 3: id 'a' appears twice"),
    "short row": ("id,start,end,size\na,0,1\n", "line 2: 3 fields, the header has 4"),
    "empty id": ("id,start,end,size\n,0,1,8\n", "line 2: empty id"),
    # 1,025 buffers of 2^53 bytes overflowed the packers' int64 arrays (OverflowError, exit 70)
    "sizes past 2^62 in all": (
        "id,start,end,size\n" + "".join(f"b{i},0,1,{2**53}\n" for i in range(1025)),
        "line 513: the sizes and alignments up to this row add up to 4611686018427388416 bytes",
    ),
}


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", *argv], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("case", sorted(BAD_CSV))
def test_bad_csv_is_one_line_and_exit_2(case: str, tmp_path: Path, capsys) -> None:
    text, expected = BAD_CSV[case]
    path = tmp_path / "bad.csv"
    path.write_text(text)
    assert cli.main(["pack", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dctms pack: {path}: "), captured.err
    assert expected in lines[0]


def _bad_input_cases(tmp_path: Path) -> tuple[Path, dict]:
    good = tmp_path / "p.csv"
    good.write_text("id,start,end,size\na,0,2,8\n")
    binary = tmp_path / "b.csv"
    binary.write_bytes(b"\xff\xfe\x00id")
    return good, {
        "missing file": (["pack", str(tmp_path / "nope.csv")], "no such file"),
        "a directory": (["pack", str(tmp_path)], "not a file"),
        "not UTF-8": (["pack", str(binary)], "not UTF-8"),
        "output onto the input": (["pack", str(good), "-o", str(good)], "is an input of this command"),
        "output onto a device": (["pack", str(good), "-o", "/dev/null"], "is not a regular file"),
        "output in a missing folder": (
            ["pack", str(good), "-o", str(tmp_path / "no" / "o.csv")],
            "does not exist",
        ),
        "negative budget": (["pack", str(good), "--seconds", "-1"], "--seconds"),
        "zero alignment": (["pack", str(good), "--alignment", "0"], "--alignment"),
    }


def test_bad_inputs_are_one_line_and_leave_the_input_alone(tmp_path: Path, capsys) -> None:
    good, cases = _bad_input_cases(tmp_path)
    before = good.read_bytes()
    for name, (argv, expected) in cases.items():
        assert cli.main(argv) == 2, name
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and expected in err, (name, err)
    assert good.read_bytes() == before


def test_bad_input_through_the_real_entry_point(tmp_path: Path) -> None:
    proc = _run("pack", str(tmp_path / "nope.csv"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"dctms pack: {tmp_path / 'nope.csv'}: no such file"


def test_compile_refuses_an_absurd_pack_budget(tmp_path: Path) -> None:
    proc = _run(
        "compile",
        "plans/configs/qwen2.5-1.5b-instruct-4bit.json",
        "-N",
        "8",
        "-M",
        "8",
        "--pack-seconds",
        "-3",
        "-o",
        str(tmp_path / "x.plan"),
    )
    assert proc.returncode == 2 and "--pack-seconds" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    assert not (tmp_path / "x.plan").exists()


def test_budget_holds_on_40000_identical_buffers(tmp_path: Path, capsys) -> None:
    """40,000 buffers live at once made greedy best-fit quadratic (8 * 10^8 candidates) before
    any budget applied: over 20 s at --seconds 1. The greedy pass now has its share of the
    budget and the online allocator takes over past it; a generous wall bound, not a timing."""
    import time

    problem_csv = tmp_path / "same.csv"
    problem_csv.write_text(
        "id,start,end,size\n" + "".join(f"b{i},0,10,4096\n" for i in range(40_000))
    )
    out = tmp_path / "offsets.csv"
    t0 = time.perf_counter()
    assert cli.main(["pack", str(problem_csv), "--seconds", "1", "--json", "-o", str(out)]) == 0
    assert time.perf_counter() - t0 < 10
    summary = json.loads(capsys.readouterr().out)
    assert summary["arena"] == summary["lower_bound"] == 40_000 * 4096
    offsets = [int(r["offset"]) for r in csv.DictReader(out.open())]
    p = make_problem([0] * 40_000, [10] * 40_000, [4096] * 40_000, 1)
    assert is_valid(p, np.asarray(offsets))
