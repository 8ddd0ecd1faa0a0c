"""action.yml, the composite GitHub Action: its wiring, and its review and verdict steps run here.

GitHub is not available, so the steps are run the way a runner runs a composite action's ``run``
steps: ``${{ ... }}`` expressions substituted (inputs with their defaults, ``runner.temp``,
``github.action_path``, the previous step's outputs), then ``bash -e`` with the step's ``env``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_ci_script import GIT_ENV
from test_ci_script import repo as repo  # noqa: F401 - the base -> head repository fixture

ROOT = Path(__file__).resolve().parents[1]
ACTION = yaml.safe_load((ROOT / "action.yml").read_text())
STEPS = {
    step.get("id") or step.get("name") or step.get("uses"): step for step in ACTION["runs"]["steps"]
}
SCRIPT = ROOT / "scripts/dctms-ci.sh"
EXPR = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")


def test_composite_action_wiring() -> None:
    assert ACTION["runs"]["using"] == "composite"
    for step in ACTION["runs"]["steps"]:
        if "run" in step:
            assert step.get("shell") == "bash", step.get("name")
    text = (ROOT / "action.yml").read_text()
    for name in ACTION["inputs"]:
        assert f"inputs.{name}" in text, f"input {name} is never used"
    # Every setting the script reads is passed by the action (DCTMS is the venv's, on PATH).
    read = set(re.findall(r"\$\{(DCTMS_[A-Z_]+)", SCRIPT.read_text()))
    passed = set(STEPS["review"]["env"])
    assert read == passed, (read - passed, passed - read)
    assert "scripts/dctms-ci.sh" in STEPS["review"]["run"]
    assert os.access(SCRIPT, os.X_OK)
    outputs = ACTION["outputs"]
    assert outputs["status"]["value"] == "${{ steps.review.outputs.status }}"
    assert outputs["report"]["value"] == "${{ steps.review.outputs.report }}"


def evaluate(text: str, context: dict[str, str]) -> str:
    def value(match: re.Match) -> str:
        expr = match.group(1)
        if expr in context:
            return context[expr]
        if expr.startswith("inputs."):
            return str(ACTION["inputs"][expr[7:]].get("default", ""))
        raise AssertionError(f"unexpected expression in a tested step: {expr}")

    return EXPR.sub(value, text)


def run_step(step: dict, context: dict[str, str], cwd: Path, env: dict[str, str]):
    step_env = {k: evaluate(str(v), context) for k, v in step.get("env", {}).items()}
    script = evaluate(step["run"], context)
    return subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=cwd,
        env={**env, **step_env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize(("inputs", "status"), [({"fail-above": "64KiB"}, "1"), ({}, "0")])
def test_review_and_verdict_steps(repo, tmp_path: Path, inputs: dict, status: str) -> None:  # noqa: F811
    outputs = tmp_path / "github_output"
    summary = tmp_path / "summary.md"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DCTMS", "GITHUB_"))}
    env |= GIT_ENV | {
        "GITHUB_ACTION_PATH": str(ROOT),
        "GITHUB_OUTPUT": str(outputs),
        "GITHUB_STEP_SUMMARY": str(summary),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # the install step's PATH
    }
    context = {
        "runner.temp": str(tmp_path),
        "github.action_path": str(ROOT),
        "inputs.base": "main",
        **{f"inputs.{k}": v for k, v in inputs.items()},
    }
    review = run_step(STEPS["review"], context, repo["path"], env)
    assert review.returncode == 0, review.stderr  # the status is applied by the last step
    written = dict(line.split("=", 1) for line in outputs.read_text().splitlines())
    assert written["status"] == status
    assert written["report"] == str(tmp_path / "dctms-report.md")
    assert summary.read_text() == Path(written["report"]).read_text()
    assert "### dctms plan diff: `main:plans/tiny.plan` → `plans/tiny.plan`" in summary.read_text()

    context |= {f"steps.review.outputs.{k}": v for k, v in written.items()}
    verdict = run_step(STEPS["Verdict"], context, repo["path"], env)
    assert verdict.returncode == int(status)
    if status == "1":
        assert "::error::dctms: a plan is stale or M_max crossed a limit" in verdict.stdout
