"""``dctms fit``: the search (pure, counted) and the command on a tiny qwen2 config (real compiles)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dctms.cli import main as cli
from dctms.schema.io import read_plan
from dctms.schema.model_folder import open_model
from dctms.toolkit.compiler import CompileOptions, compile_plan
from dctms.toolkit.tiny_model import DEMO_CONFIG
from dctms.views.fit import largest_fitting, max_positions

M = 16


def write_config(folder: Path, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**DEMO_CONFIG, **changes}))
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("fit") / "tiny")


def m_max(folder: Path, n: int, m: int) -> int:
    return compile_plan(open_model(folder), CompileOptions(n, m)).envelope.total


# ------------------------------------------------------------------------------ the search alone


def counted(f):
    calls = []

    def measure(v: int) -> int:
        calls.append(v)
        return f(v)

    return measure, calls


@pytest.mark.parametrize("budget", [1_000, 1_010, 5_000, 123_456, 10**7])
def test_search_finds_the_boundary_with_logarithmic_calls(budget):
    measure, calls = counted(lambda v: 1_000 + 10 * v)
    result = largest_fitting(measure, budget, cap=2**20)
    expected = (budget - 1_000) // 10
    if expected < 1:
        assert result.best is None and calls == [1]
        return
    assert result.best == expected
    assert len(calls) == len(set(calls))  # never the same value twice
    assert len(calls) <= 2 * math.ceil(math.log2(expected + 1)) + 2
    assert result.probe(expected).fits and not result.probe(expected + 1).fits


def test_search_stops_at_the_cap():
    measure, calls = counted(lambda v: v)
    result = largest_fitting(measure, 10**9, cap=100)
    assert result.best == 100 and result.capped
    assert calls == [1, 2, 4, 8, 16, 32, 64, 100]
    assert largest_fitting(lambda v: v, 10**9, cap=1).best == 1
    assert largest_fitting(lambda v: v, 10**9, cap=0).best is None


def test_search_with_flat_steps():
    # M_max that stays flat over ranges (e.g. padded chunks): still the largest value that fits.
    result = largest_fitting(lambda v: 100 * (v // 7), 100 * 5, cap=2**20)
    assert result.best == 41  # 41 // 7 = 5, 42 // 7 = 6


def test_max_positions():
    assert max_positions({"max_position_embeddings": 4096}) == 4096
    assert max_positions({"text_config": {"max_position_embeddings": 8192}}) == 8192
    assert max_positions({"model_type": "x"}) is None


# ------------------------------------------------------------------- the command, real compiles


def test_fit_n_is_the_largest_that_fits(tiny, tmp_path, capsys):
    budget = m_max(tiny, 300, M)  # a budget from a real compile, so the answer is not trivial
    out_plan = tmp_path / "fit.plan"
    code = cli.main(
        ["fit", str(tiny), "--memory", str(budget), "-M", str(M), "--json", "-o", str(out_plan)]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out)
    n = summary["value"]
    assert n >= 300 and not summary["capped"]
    # Independent compiles: N fits, N + 1 does not.
    assert m_max(tiny, n, M) == summary["envelope"]["total"] <= budget
    assert m_max(tiny, n + 1, M) == summary["next_value_total"] > budget
    assert summary["envelope"]["free"] == budget - summary["envelope"]["total"]
    assert summary["compiles"] <= 2 * math.ceil(math.log2(n)) + 2
    assert captured.err.count("\n") == summary["compiles"]  # one progress line per compile
    plan = read_plan(out_plan)
    assert (plan.bounds.input_tokens, plan.bounds.output_tokens) == (n, M)
    assert plan.envelope.device == budget


def test_fit_m_text_and_max_position_cap(tmp_path, capsys):
    folder = write_config(tmp_path / "short", max_position_embeddings=64)
    code = cli.main(["fit", str(folder), "--memory", "1TiB", "-N", "16", "-q"])
    captured = capsys.readouterr()
    assert code == 0 and captured.err == ""
    lines = captured.out.splitlines()
    assert (
        lines[0]
        == "qwen2 (4 layers): largest M = 48 for N = 16 within 1,024.00 GiB (1,099,511,627,776 bytes)"
    )
    assert (
        lines[1] == "  stopped at max_position_embeddings 64 (N + M); the budget would allow more"
    )
    assert "total = M_max" in captured.out and "free = M_free" in captured.out
    assert "7 compiles" in captured.out  # 1, 2, 4, 8, 16, 32, 48


def test_even_one_token_does_not_fit(tiny, capsys):
    code = cli.main(["fit", str(tiny), "--memory", "10MiB", "-M", str(M), "-q"])
    err = capsys.readouterr().err
    short = m_max(tiny, 1, M) - 10 * 2**20
    assert code == 1
    assert err.startswith("dctms fit: even N = 1 (M = 16) needs M_max ")
    assert f"({short:,} bytes) more than the 10.00 MiB budget" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--memory", "lots", "-M", "16"], "--memory: not a size"),
        (["--memory", "1GiB", "-M", "0"], "-M must be at least 1"),
        (["--memory", "1GiB", "-M", "4096"], "leaves no room"),
    ],
)
def test_bad_input_exit_2(tiny, capsys, argv, message):
    code = cli.main(["fit", str(tiny), *argv, "-q"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


def test_missing_model_exit_2(tmp_path, capsys):
    assert cli.main(["fit", str(tmp_path / "none"), "--memory", "1GiB", "-M", "16"]) == 2
    assert "no such file or folder" in capsys.readouterr().err
