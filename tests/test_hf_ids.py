"""Models named by their Hugging Face id (cli/hf_cache.py): a cache in huggingface_hub's own layout
(``models--ORG--NAME/{blobs,refs,snapshots}``) built from a tiny model, no network. The commands
find the snapshot by id, a plan records the id and commit (never a path), a plan checks against
another machine's cache, a local folder wins over an id, and a missing id is one line, exit 2."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_QWEN2

from dctms.cli.main import main
from dctms.schema.io import encode_plan, read_plan

REPO = "tiny-org/tiny-qwen"
COMMIT = hashlib.sha1(b"tiny-qwen snapshot").hexdigest()


def build_hub_cache(cache: Path, repo: str, folder: Path, commit: str) -> Path:
    """``folder``'s files as huggingface_hub stores a downloaded snapshot: content-addressed blobs,
    the snapshot's files linked to them, and refs/main naming the commit."""
    store = cache / ("models--" + repo.replace("/", "--"))
    snapshot = store / "snapshots" / commit
    (store / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(folder.iterdir()):
        if not f.is_file() or f.suffix == ".plan":
            continue
        blob = store / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (store / "refs").mkdir(exist_ok=True)
    (store / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dctms.toolkit.tiny_model import write_tiny_model

    root = tmp_path_factory.mktemp("hub")
    folder = write_tiny_model(root / "folder", dict(TINY_QWEN2), seed=0)
    snapshot = build_hub_cache(root / "cache", REPO, folder, COMMIT)
    return root, folder, snapshot


@pytest.fixture
def cache(tiny, monkeypatch):
    """HF_HUB_CACHE pointed at the tiny cache, for this process (huggingface_hub reads it on
    import, so its constant too) and for subprocesses."""
    from huggingface_hub import constants

    root = tiny[0] / "cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    return root


def _dctms(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_compile_by_id_finds_the_snapshot_and_records_id_and_commit(tiny, cache, tmp_path):
    _, folder, snapshot = tiny
    by_id = tmp_path / "by_id.plan"
    # through the environment variable, as a user sets it (a process of its own)
    proc = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "compile", REPO, "-N", "16", "-M", "4",
         "--prefill-chunk", "16", "-o", str(by_id), "-q"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_CACHE": str(cache)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    plan = read_plan(by_id)
    assert (plan.compile.hub.repo_id, plan.compile.hub.revision) == (REPO, COMMIT)
    data = by_id.read_bytes()
    assert str(cache).encode() not in data and str(snapshot).encode() not in data
    # the same plan as from the folder, but for the record of where the model came from
    assert main(["compile", str(folder), "-N", "16", "-M", "4", "--prefill-chunk", "16",
                 "-o", str(tmp_path / "folder.plan"), "-q"]) == 0  # fmt: skip
    from_folder = read_plan(tmp_path / "folder.plan")
    assert from_folder.compile.hub is None
    assert b'"hub"' not in (tmp_path / "folder.plan").read_bytes()  # a folder's plan: as before
    import msgspec

    unrecorded = msgspec.structs.replace(plan, compile=from_folder.compile)
    assert encode_plan(unrecorded) == (tmp_path / "folder.plan").read_bytes()


@pytest.mark.parametrize("revision", ["@main", f"@{COMMIT}"])
def test_a_revision_picks_the_same_snapshot(tiny, cache, tmp_path, capsys, revision):
    out = tmp_path / "rev.plan"
    rc, _, err = _dctms(capsys, "compile", REPO + revision, "-N", "16", "-M", "4", "-o", out, "-q")
    assert rc == 0, err
    assert read_plan(out).compile.hub.revision == COMMIT


def test_run_and_serve_take_the_id(tiny, cache, tmp_path, capsys):
    plan = tmp_path / "run.plan"
    assert _dctms(capsys, "compile", REPO, "-N", "16", "-M", "4", "-o", plan, "-q")[0] == 0
    rc, out, err = _dctms(capsys, "run", plan, "--model", REPO, "--tokens", "1,2,3",
                          "--max-tokens", "3")  # fmt: skip
    assert rc == 0, err
    assert len(out.strip().split(",")) == 3
    from dctms.cli.commands.serve import hub_folder
    from dctms.serve.spec import parse_plan_spec

    spec = hub_folder(parse_plan_spec(f"tiny={plan}={REPO}"), download=False)
    assert spec.model_dir == tiny[2]


def test_fit_takes_the_id(tiny, cache, capsys):
    # a budget the model misses: the answer names its M_max, as for the folder itself
    by_id = _dctms(capsys, "fit", REPO, "-M", "4", "--memory", "64MiB", "-q")
    by_folder = _dctms(capsys, "fit", tiny[1], "-M", "4", "--memory", "64MiB", "-q")
    assert by_id[0] == 1 and "needs M_max" in by_id[2]
    assert by_id == by_folder


def test_a_plan_checks_against_another_machines_cache(tiny, cache, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    plan = tmp_path / "hashed.plan"
    rc, _, err = _dctms(capsys, "compile", REPO, "-N", "16", "-M", "4", "--hash-weights",
                        "-o", plan, "-q")  # fmt: skip
    assert rc == 0, err
    # another machine: the same snapshot in a cache somewhere else
    other = tmp_path / "elsewhere" / "hub"
    shutil.copytree(cache, other, symlinks=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(other))
    rc, out, err = _dctms(capsys, "check", plan)
    assert rc == 0 and "ok" in out, err
    # a changed snapshot there (other weights, same layout) is found stale
    from dctms.toolkit.tiny_model import write_tiny_model

    changed = write_tiny_model(tmp_path / "changed", dict(TINY_QWEN2), seed=5)
    shutil.rmtree(other)
    build_hub_cache(other, REPO, changed, COMMIT)
    rc, out, err = _dctms(capsys, "check", plan)
    assert rc == 1 and "stale" in err
    # no copy at all: the plan needs its weights' hashes, so one line naming the cache
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(empty))
    rc, out, err = _dctms(capsys, "check", plan)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert REPO in err and str(empty) in err and "--download" in err


def test_a_local_folder_wins_over_an_id(tiny, cache, tmp_path, capsys, monkeypatch):
    from dctms.toolkit.tiny_model import write_tiny_model

    write_tiny_model(tmp_path / REPO, dict(TINY_QWEN2, num_hidden_layers=1), seed=2)
    monkeypatch.chdir(tmp_path)
    rc, _, err = _dctms(capsys, "compile", REPO, "-N", "16", "-M", "4", "-o", "local.plan", "-q")
    assert rc == 0, err
    plan = read_plan(tmp_path / "local.plan")
    assert plan.compile.hub is None and plan.model.num_layers == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["compile", "{id}", "-N", "8", "-M", "4"],
        ["run", "x.plan", "--model", "{id}", "--tokens", "1"],
        ["serve", "--plan", "x.plan={id}"],
        ["fit", "{id}", "-M", "4", "--memory", "1GiB"],
        ["check", "x.plan", "--model", "{id}"],
        ["bench", "x.plan", "--model", "{id}"],
        ["explain", "x.plan", "--model", "{id}"],
        ["compile", "{id}@v2", "-N", "8", "-M", "4"],
    ],
    ids=lambda argv: argv[0],
)
def test_a_missing_id_is_one_line_naming_the_cache_and_the_fetch(cache, capsys, argv):
    missing = "tiny-org/not-there"
    rc, out, err = _dctms(capsys, *[a.replace("{id}", missing) for a in argv])
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert missing in err and str(cache) in err and "HF_HUB_CACHE" in err
    assert "--download" in err and f"hf download {missing}" in err
    assert not (cache / "models--tiny-org--not-there").exists()  # nothing fetched or made
