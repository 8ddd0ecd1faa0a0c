"""The packing cache (toolkit.pack.memo): the same answers as the packer, and never a wrong one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from dctms.toolkit.pack import memo
from dctms.toolkit.pack.instances import tiles
from dctms.toolkit.pack.problem import make_problem
from dctms.toolkit.pack.solve import solve

SECONDS = 0.05


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DCTMS_PACK_CACHE", str(tmp_path / "packings"))
    return tmp_path / "packings"


def _problem(seed: int = 0):
    p, _ = tiles(120, seed)
    assert solve(p, 0.0).arena > solve(p, 0.0).lower_bound  # the search has work to do
    return p


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.json"))


def test_an_entry_gives_the_packers_own_answer_without_packing(folder, monkeypatch):
    p = _problem()
    fresh = solve(p, SECONDS)
    first = memo.cached_solve(p, SECONDS)
    assert first == fresh and len(_entries(folder)) == 1

    def refuse(*_):
        raise AssertionError("packed again despite a valid entry")

    monkeypatch.setattr(memo, "solve", refuse)
    assert memo.cached_solve(p, SECONDS) == fresh


def test_the_key_covers_the_budget_every_array_and_the_packers_source(folder, monkeypatch):
    p = _problem()
    key = memo.entry_key(p, SECONDS)
    assert memo.entry_key(p, SECONDS * 2) != key
    for field in ("start", "end", "size", "align"):
        arrays = {f: getattr(p, f).copy() for f in ("start", "end", "size", "align")}
        arrays[field][7] += 64 if field != "start" else -1
        assert memo.entry_key(make_problem(**arrays), SECONDS) != key, field
    monkeypatch.setattr(memo, "solver_digest", lambda: "an edited packer")
    assert memo.entry_key(p, SECONDS) != key


@pytest.mark.parametrize(
    "damage",
    ["truncated", "not json", "overlap", "misaligned", "short", "arena", "bound", "lower"],
)
def test_a_damaged_entry_is_packed_again_and_rewritten(folder, damage):
    p = _problem()
    fresh = memo.cached_solve(p, SECONDS)
    (entry,) = _entries(folder)
    doc = json.loads(entry.read_text())
    live_together = np.flatnonzero((p.start < p.end[0]) & (p.start[0] < p.end))
    other = int(live_together[live_together != 0][0])
    if damage == "truncated":
        entry.write_text(entry.read_text()[:40])
    elif damage == "not json":
        entry.write_bytes(b"\xff\x00")
    else:
        if damage == "overlap":
            doc["offsets"][other] = doc["offsets"][0]
        elif damage == "misaligned":
            doc["offsets"][0] += 1
        elif damage == "short":
            doc["offsets"].pop()
        elif damage == "arena":
            doc["arena"] -= 64
        elif damage == "bound":
            doc["bound"] = doc["arena"] + 64
        elif damage == "lower":
            doc["lower_bound"] -= 64
        entry.write_text(json.dumps(doc))
    assert memo._read(entry, p) is None
    assert memo.cached_solve(p, SECONDS) == fresh
    assert memo._read(entry, p) == fresh  # rewritten whole


def test_off_small_problems_and_an_unwritable_folder_only_pack(tmp_path, monkeypatch):
    p = _problem()
    fresh = solve(p, SECONDS)
    monkeypatch.setenv("DCTMS_PACK_CACHE", "off")
    assert memo.cache_folder() is None
    assert memo.cached_solve(p, SECONDS) == fresh
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DCTMS_PACK_CACHE", str(blocker / "packings"))  # cannot be made
    assert memo.cached_solve(p, SECONDS) == fresh
    monkeypatch.setenv("DCTMS_PACK_CACHE", str(tmp_path / "small"))
    tiny = make_problem([0, 1], [2, 3], [64, 64], 64)
    memo.cached_solve(tiny, SECONDS)
    assert not (tmp_path / "small").exists()


def test_the_default_folder_is_under_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("DCTMS_PACK_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert memo.cache_folder() == tmp_path / "dctms" / "packings"


def test_the_test_run_never_packs_into_the_users_cache():
    # conftest: every worker and subprocess of this run packs into the run's own folder (or the
    # one `make test-quick` names), never ~/.cache.
    chosen = os.environ.get("DCTMS_PACK_CACHE", "")
    assert chosen and chosen.lower() != "off"
    assert not Path(chosen).resolve().is_relative_to((Path.home() / ".cache").resolve())


def test_a_compile_reads_its_phases_from_the_cache(folder, tmp_path, monkeypatch):
    from conftest import TINY_QWEN2

    from dctms.cli.main import main
    from dctms.toolkit.tiny_model import write_tiny_model

    write_tiny_model(tmp_path / "model", TINY_QWEN2)
    argv = ["compile", str(tmp_path / "model"), "-N", "32", "-M", "8", "-q", "-o"]
    assert main([*argv, str(tmp_path / "a.plan")]) == 0
    assert _entries(folder)
    monkeypatch.setattr(memo, "solve", lambda *_: pytest.fail("packed again"))
    assert main([*argv, str(tmp_path / "b.plan")]) == 0
    assert (tmp_path / "a.plan").read_bytes() == (tmp_path / "b.plan").read_bytes()


def test_the_folder_keeps_the_most_recently_used_entries(folder, monkeypatch):
    """Past MAX_ENTRIES a write removes the least recently used quarter: an entry read lately
    stays, the oldest unread ones go."""
    monkeypatch.setattr(memo, "MAX_ENTRIES", 4)
    problems = [_problem(seed) for seed in range(5)]
    for k, p in enumerate(problems[:4]):
        memo.cached_solve(p, SECONDS)
        for i, path in enumerate(sorted(_entries(folder), key=os.path.getmtime)):
            os.utime(path, ns=(10**9 * i, 10**9 * i))  # written one second apart, in order
        assert len(_entries(folder)) == k + 1
    oldest = min(_entries(folder), key=os.path.getmtime)
    first = folder / (memo.entry_key(problems[0], SECONDS) + ".json")
    assert oldest == first
    memo.cached_solve(problems[0], SECONDS)  # read: now the most recently used
    assert os.path.getmtime(first) > max(
        os.path.getmtime(e) for e in _entries(folder) if e != first
    )
    second = folder / (memo.entry_key(problems[1], SECONDS) + ".json")
    memo.cached_solve(problems[4], SECONDS)  # the fifth entry: down to three
    left = _entries(folder)
    assert len(left) == 3 and first in left and second not in left
    assert folder / (memo.entry_key(problems[4], SECONDS) + ".json") in left
