"""A memory cgroup with a hard limit for a subprocess (a server under test or benchmark): cgroup
v1's memory controller (its ``memory.limit_in_bytes``, ``memory.failcnt``, ``memory.oom_control``)
or cgroup v2's (``memory.max``, ``memory.events``). ``memory_group`` raises ``CgroupUnavailable``,
saying why, where neither is writable (tests skip on it). The group is removed on leaving (its
processes must have exited)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")


class CgroupUnavailable(Exception):
    """No writable memory cgroup controller on this machine (the message says why)."""


@dataclass(frozen=True)
class MemoryGroup:
    path: Path
    v2: bool

    def join(self) -> None:
        """Move the calling process into the group (a subprocess's ``preexec_fn``: every page it
        touches after exec is charged here)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    @property
    def limit(self) -> int:
        return int(self._read("memory.max" if self.v2 else "memory.limit_in_bytes").strip())

    @property
    def peak(self) -> int:
        if self.v2:
            peak = self.path / "memory.peak"  # kernels >= 5.19
            return int(peak.read_text()) if peak.exists() else int(self._read("memory.current"))
        return int(self._read("memory.max_usage_in_bytes"))

    @property
    def failcnt(self) -> int:
        """Times a charge hit the limit (v1); v2's ``max`` events."""
        if self.v2:
            return _keyed(self._read("memory.events"))["max"]
        memsw = self.path / "memory.memsw.failcnt"  # memory + swap: hit first at equal limits
        return int(self._read("memory.failcnt")) + (int(memsw.read_text()) if memsw.exists() else 0)

    def stat(self) -> dict[str, int]:
        """The group's ``memory.stat`` (v1: ``rss``, ``cache``, ``mapped_file``...; v2: ``anon``,
        ``file``...)."""
        return _keyed(self._read("memory.stat"))

    @property
    def oom_kills(self) -> int:
        text = self._read("memory.events" if self.v2 else "memory.oom_control")
        return _keyed(text).get("oom_kill", 0)


def _keyed(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in text.splitlines() if line.strip())}


def _v2() -> bool:
    controllers = V2_ROOT / "cgroup.controllers"
    return controllers.exists() and "memory" in controllers.read_text().split()


def create_group(limit: int) -> MemoryGroup:
    """A new memory group with a hard limit of ``limit`` bytes (and no swap to spill into)."""
    v2 = _v2()
    root = V2_ROOT if v2 else V1_ROOT
    limit_file = "memory.max" if v2 else "memory.limit_in_bytes"
    if not root.is_dir():
        raise CgroupUnavailable(f"no memory cgroup controller mounted at {root}")
    path = root / f"dctms-{uuid.uuid4().hex[:12]}"
    try:
        path.mkdir()
        (path / limit_file).write_text(str(limit))
        memsw = path / "memory.memsw.limit_in_bytes"  # v1 with swap accounting
        if not v2 and memsw.exists():
            memsw.write_text(str(limit))
    except OSError as err:
        if path.exists():
            path.rmdir()
        raise CgroupUnavailable(f"cgroups are not writable here ({root}: {err.strerror})") from None
    return MemoryGroup(path, v2)


def remove_group(group: MemoryGroup) -> None:
    """Remove the group; its processes must have exited (they may take a moment to leave)."""
    for _ in range(50):
        try:
            group.path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


@contextmanager
def memory_group(limit: int) -> Iterator[MemoryGroup]:
    group = create_group(limit)
    try:
        yield group
    finally:
        remove_group(group)
