"""A packing cache on disk: the same problem and budget are packed once per machine.

``solve`` is a pure function of the problem, the budget and the packer's code (its search counts
work, not time), so its answer can be kept: ``dctms compile``, ``fit``'s probes and ``check``
pack the same phases again and again (a test suite compiles the same configs in many
processes; ``fit`` on the same model re-packs every probe). An entry is keyed by the SHA-256 of
the packer's own source files, the budget and the problem's arrays, so an edited packer never
reads an older answer. An entry is trusted only after the same checks the verifier makes of an
arena (offsets aligned and disjoint for buffers live together, its arena and lower bound
recomputed); anything else -- a missing, truncated or altered file -- is packed again and
rewritten. The cache never fails a compile: a folder that cannot be read or written is skipped.

Where: ``$DCTMS_PACK_CACHE`` (``off`` turns it off), else ``$XDG_CACHE_HOME/dctms/packings``,
else ``~/.cache/dctms/packings``. Entries are small (about ten bytes per buffer), and the folder is
bounded: a read entry's modification time is renewed, and a write that takes the folder past
``MAX_ENTRIES`` removes the least recently used quarter (entries an earlier packer wrote, which no
key reaches any more, go first as they are never read).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from dctms.schema.cache_home import cache_dir
from dctms.toolkit.pack.problem import Problem, is_valid, live_max
from dctms.toolkit.pack.solve import Packing, solve

# Smaller problems pack faster than an entry is hashed, read and checked.
MIN_BUFFERS = 16
# Entries kept (a few kB each: about 25 MB in all); past it the least recently used quarter goes.
MAX_ENTRIES = 4096
_OFF = ("off", "0", "no", "false")


def cache_folder() -> Path | None:
    """The cache's folder, or None when ``DCTMS_PACK_CACHE`` turns it off."""
    chosen = os.environ.get("DCTMS_PACK_CACHE")
    if chosen is not None:
        return None if chosen.strip().lower() in _OFF or not chosen.strip() else Path(chosen)
    return cache_dir() / "packings"


@functools.cache
def solver_digest() -> str:
    """SHA-256 of the packer's source files (this folder's modules, by name)."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def entry_key(p: Problem, seconds: float) -> str:
    h = hashlib.sha256(solver_digest().encode())
    h.update(repr(float(seconds)).encode())
    for a in (p.start, p.end, p.size, p.align):
        h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
        h.update(b"|")
    return h.hexdigest()


def cached_solve(p: Problem, seconds: float = 0.0) -> Packing:
    """``solve(p, seconds)``, read from the cache when an entry checks out, else packed and kept."""
    folder = cache_folder()
    if folder is None or p.n < MIN_BUFFERS:
        return solve(p, seconds)
    path = folder / (entry_key(p, seconds) + ".json")
    kept = _read(path, p)
    if kept is not None:
        _touch(path)
        return kept
    packing = solve(p, seconds)
    _write(path, packing)
    _evict(folder, MAX_ENTRIES)
    return packing


def _touch(path: Path) -> None:
    try:
        os.utime(path)  # recently used: the last to be evicted
    except OSError:
        pass


def _evict(folder: Path, keep: int) -> None:
    """Past ``keep`` entries, remove the least recently used ones down to three quarters of it."""
    try:
        entries = [e for e in os.scandir(folder) if e.name.endswith(".json")]
        if len(entries) <= keep:
            return
        entries.sort(key=lambda e: (e.stat().st_mtime_ns, e.name))
        for e in entries[: len(entries) - keep * 3 // 4]:
            Path(e.path).unlink(missing_ok=True)
    except OSError:
        pass  # another process evicting at once, or a folder not ours to clean: only larger


def _read(path: Path, p: Problem) -> Packing | None:
    try:
        doc = json.loads(path.read_bytes())
        offsets = np.asarray(doc["offsets"], dtype=np.int64)
        packing = Packing(
            doc["offsets"], doc["arena"], doc["lower_bound"], doc["bound"],
            doc["greedy_arena"], doc["work"],
        )  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return None
    if offsets.shape != (p.n,) or not is_valid(p, offsets):
        return None
    top = int((offsets + p.size).max()) if p.n else 0
    lower = live_max(p)
    if packing.arena != top or packing.lower_bound != lower:
        return None
    if not (lower <= packing.bound <= packing.arena <= packing.greedy_arena):
        return None
    return packing


def _write(path: Path, packing: Packing) -> None:
    doc = {
        "offsets": packing.offsets,
        "arena": packing.arena,
        "lower_bound": packing.lower_bound,
        "bound": packing.bound,
        "greedy_arena": packing.greedy_arena,
        "work": packing.work,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".entry-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, separators=(",", ":"))
            os.replace(tmp, path)  # whole or not at all: a reader never sees half an entry
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass  # a cache that cannot be written is only slower
