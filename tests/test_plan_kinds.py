"""compile, fit and check share one plan-kind path (toolkit/kinds/dispatch.py): a speculative plan is
re-compiled by `dctms check` with its draft, and `dctms fit --draft` plans both models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY_QWEN2

from dctms.cli.main import main as cli
from dctms.schema.draft import DEFAULT_NUM_DRAFT
from dctms.schema.io import read_plan
from dctms.toolkit.check import check_plan, compile_command

DRAFT = {**TINY_QWEN2, "num_hidden_layers": 1}


def _config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True)
    path = folder / "config.json"
    path.write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("kinds")
    return _config(root / "target", TINY_QWEN2), _config(root / "draft", DRAFT)


def test_check_recompiles_a_speculative_plan_with_its_draft(pair, tmp_path):
    target, draft = pair
    plan = tmp_path / "spec.plan"
    argv = ["compile", str(target), "-N", "12", "-M", "6", "--prefill-chunk", "8"]
    assert cli([*argv, "--draft", str(draft), "--num-draft", "2", "-q", "-o", str(plan)]) == 0
    result = check_plan(plan)
    assert result.verdict == "ok", result.line()
    request = read_plan(plan).compile
    command = compile_command(request, "MODEL", "spec.plan")
    assert "--draft DRAFT --num-draft 2" in command
    # Recorded with another draft config, the plan no longer checks: the draft is really compiled.
    other = tmp_path / "other.plan"
    bigger = _config(tmp_path / "draft2", {**DRAFT, "num_hidden_layers": 2})
    assert cli([*argv, "--draft", str(bigger), "--num-draft", "2", "-q", "-o", str(other)]) == 0
    assert read_plan(other).envelope.total != read_plan(plan).envelope.total
    assert check_plan(other).verdict == "ok"


@pytest.mark.slow  # a fit search over two models (171 s in a loaded 2-core run with coverage)
def test_fit_with_a_draft_plans_both_models(pair, tmp_path, capsys):
    target, draft = pair
    out = tmp_path / "fit.plan"
    argv = ["fit", str(target), "--memory", "200MiB", "-M", "4", "--prefill-chunk", "8"]
    assert cli([*argv, "--draft", str(draft), "--max-compiles", "40", "-q", "-o", str(out)]) == 0
    plan = read_plan(out)
    assert plan.draft is not None and plan.draft.num_draft == DEFAULT_NUM_DRAFT
    assert plan.envelope.total <= 200 * 2**20
    assert [p.model for p in plan.envelope.parts] == ["target", "draft"]


def test_a_kind_option_without_its_companion_is_one_line(pair, capsys):
    target, _ = pair
    assert cli(["compile", str(target), "-N", "8", "-M", "4", "--num-draft", "2", "-q", "-o", "-"]) == 2
    err = capsys.readouterr().err
    assert "--num-draft needs --draft" in err and err.count("\n") == 1
    assert cli(["fit", str(target), "--memory", "1GiB", "-M", "4", "--images", "1", "-q"]) == 2
    err = capsys.readouterr().err
    assert "need both --images K and --image-size HxW" in err and err.count("\n") == 1
