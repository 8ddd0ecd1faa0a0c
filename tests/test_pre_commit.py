"""The pre-commit hooks in .pre-commit-hooks.yaml, run by pre-commit itself on a temporary repository.

pre-commit installs a ``language: python`` hook by pip-installing this repository into its own
environment, which needs the package index; the test keeps everything else real -- the manifest's
entry, files pattern and types, pre-commit's own staged-file selection and invocation -- by copying
each hook into a ``repo: local`` config with ``language: system`` (the dctms on PATH, this checkout).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import yaml
from conftest import TINY_QWEN2, make_tiny_plan

import dctms
from dctms.schema.io import encode_plan, write_plan

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
HOOKS = {hook["id"]: hook for hook in MANIFEST}
BIN = Path(sys.executable).parent
ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_SYSTEM": "/dev/null",
}


def run(argv: list[str], cwd: Path, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **ENV, "PATH": f"{BIN}:{os.environ['PATH']}"}
    env["PRE_COMMIT_HOME"] = str(home)  # pre-commit's cache, not the user's
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def local_config(*ids: str) -> str:
    hooks = []
    for hook_id in ids:
        hook = {k: HOOKS[hook_id][k] for k in ("id", "name", "entry", "files", "types")}
        hooks.append({**hook, "language": "system"})
    return yaml.safe_dump({"repos": [{"repo": "local", "hooks": hooks}]}, sort_keys=False)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    path.mkdir()
    assert run(["git", "init", "-q", "-b", "main"], path, tmp_path).returncode == 0
    (path / "README").write_text("not a plan\n")
    return path


def test_manifest_hooks_are_well_formed() -> None:
    assert set(HOOKS) == {"dctms-validate", "dctms-check"}
    for hook in MANIFEST:
        assert hook["language"] == "python"  # pre-commit pip-installs this repository
        assert hook["entry"].split()[0] == "dctms"  # the console script the wheel installs
        assert hook["files"] == r"\.plan$"
        assert hook["entry"].split()[1] in ("validate", "check")


@pytest.mark.slow
def test_validate_hook_passes_good_plans_and_stops_a_broken_one(repo: Path, tmp_path) -> None:
    pre_commit = shutil.which("pre-commit", path=str(BIN))
    assert pre_commit, "pre-commit is a test dependency"
    (repo / ".pre-commit-config.yaml").write_text(local_config("dctms-validate"))
    write_plan(make_tiny_plan(), repo / "good.plan")
    run(["git", "add", "-A"], repo, tmp_path)
    proc = run([pre_commit, "run"], repo, tmp_path)  # staged files only, as on `git commit`
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dctms validate" in proc.stdout and "Passed" in proc.stdout

    # A staged plan with a broken figure: the hook names the file and the problem, and fails.
    broken = encode_plan(make_tiny_plan()).replace(b'"total": 1664', b'"total": 1665')
    (repo / "plans").mkdir()
    (repo / "plans/broken.plan").write_bytes(broken)
    run(["git", "add", "-A"], repo, tmp_path)
    proc = run([pre_commit, "run"], repo, tmp_path)
    assert proc.returncode == 1
    assert "Failed" in proc.stdout and "plans/broken.plan: $.envelope" in proc.stdout
    assert "good.plan: ok" in proc.stdout  # every staged plan was passed to the hook

    # Installed as the git hook, it blocks the commit; unstaging the broken plan lets it through.
    assert run([pre_commit, "install"], repo, tmp_path).returncode == 0
    assert run(["git", "commit", "-q", "-m", "x"], repo, tmp_path).returncode != 0
    run(["git", "rm", "-q", "--cached", "plans/broken.plan"], repo, tmp_path)
    commit = run(["git", "commit", "-q", "-m", "good plan only"], repo, tmp_path)
    assert commit.returncode == 0, commit.stdout + commit.stderr


@pytest.mark.slow
def test_check_hook_stops_a_stale_plan(repo: Path, tmp_path) -> None:
    pre_commit = shutil.which("pre-commit", path=str(BIN))
    (repo / ".pre-commit-config.yaml").write_text(local_config("dctms-validate", "dctms-check"))
    (repo / "model").mkdir()
    (repo / "model/config.json").write_text(json.dumps(TINY_QWEN2))
    plan = dctms.compile_plan(repo / "model/config.json", 8, 4)
    dctms.write_plan(plan, repo / "tiny.plan")
    run(["git", "add", "-A"], repo, tmp_path)
    proc = run([pre_commit, "run"], repo, tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert "dctms check" in proc.stdout and "re-compiles to the same bytes" not in proc.stdout

    old = plan.generator
    dctms.write_plan(
        msgspec.structs.replace(plan, generator=msgspec.structs.replace(old, mlx="0.0.1")),
        repo / "tiny.plan",
    )
    run(["git", "add", "-A"], repo, tmp_path)
    proc = run([pre_commit, "run"], repo, tmp_path)
    assert proc.returncode == 1
    assert "tiny.plan: stale: generator.mlx 0.0.1 in the plan" in proc.stdout
