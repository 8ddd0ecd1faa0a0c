"""The weights in one arena: one allocation of exactly M_weights, read straight from the files, on
2 MiB pages where Linux gives them.

mlx-lm (and ``mx.load``) allocates every weight on its own: a few hundred buffers of a few MB,
each on 4 KiB pages. A decode step streams all of them, so every 4 KiB of weights costs a TLB
miss and a page walk. The plan knows every weight's shape and dtype before anything is read, so
the runner allocates them once, as one array of their total size, and reads each tensor's bytes
from its safetensors file into its place (no stored copy in between: the load never holds more
than M_weights). Each weight is then a view of that array (a slice, reinterpreted in its dtype,
reshaped): MLX shares the buffer, so its active memory is the arena's size, M_weights exactly.

On Linux the arena's 2 MiB-aligned interior is first handed back to the kernel (``MADV_DONTNEED``:
the freshly zeroed pages, read again as zeros) and marked ``MADV_HUGEPAGE``, so the reads fault it
in on transparent huge pages. Measured on SmolLM2-135M (fp32, 540 MB, this 2-core machine): median
decode step 43.6 ms with one buffer per weight, 41.8 ms in one arena on 4 KiB pages, 40.5 ms on
2 MiB pages.

Used where it is exact: the CPU backend, weights read as stored (no ``--dtype`` cast, no
tensor-parallel slice), every offset aligned to its dtype without padding. Otherwise, or with
``DCTMS_WEIGHT_ARENA=off``, each weight is its own buffer as before (``runner.load``).
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from dctms.runner.primitives import dtype_from_name
from dctms.schema.errors import DctmsError, InternalError
from dctms.schema.fingerprint import HeaderTensor
from dctms.schema.types import FusedWeight

SWITCH = "DCTMS_WEIGHT_ARENA"  # "on" (default) | "off": one buffer per weight, as mlx-lm
HUGE_PAGE = 2 * 2**20
_MADV_DONTNEED, _MADV_HUGEPAGE = 4, 14
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_READ_BLOCK = 64 * 2**20  # one readinto at most this much (a short read is retried)


@dataclass(frozen=True)
class Placed:
    name: str
    offset: int  # in the arena
    source: HeaderTensor  # where its bytes are (file, start, size) and its stored dtype, shape


@dataclass(frozen=True)
class ArenaInfo:
    """What the run report says about how the weights were allocated."""

    arena_bytes: int  # 0: one buffer per weight
    huge_page_bytes: int  # of the arena, on 2 MiB pages (Linux's AnonHugePages)
    reason: str  # why not one arena, or which pages

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if not self.arena_bytes:
            return f"one buffer per weight ({self.reason})"
        return (
            f"one arena of {self.arena_bytes:,} bytes, {self.huge_page_bytes:,} of them on "
            f"2 MiB pages ({self.reason})"
        )


def layout(names: Sequence[str], sources: dict[str, HeaderTensor]) -> list[Placed] | None:
    """Every weight at the end of the one before, in ``names`` order; None when some offset would
    not be a multiple of its dtype's size (the arena would need padding the plan does not count)."""
    placed, offset = [], 0
    for name in names:
        src = sources[name]
        if offset % dtype_from_name(src.dtype).size:
            return None
        placed.append(Placed(name, offset, src))
        offset += src.bytes
    return placed


def read_arena(
    placed: list[Placed], files: dict[str, Path], fused: Sequence[FusedWeight] = ()
) -> tuple[dict[str, mx.array], ArenaInfo]:
    """Allocate the arena, read every tensor into its place, return the weights as views of it:
    each fused weight one view of its parts (laid out end to end), in place of them."""
    total = sum(p.source.bytes for p in placed)
    arena = mx.zeros((max(total, 1),), dtype=mx.uint8)
    mx.eval(arena)
    view = memoryview(arena)  # writable: MLX's CPU buffer itself
    try:
        pages = _ask_for_huge_pages(view)
        for path, members in _by_file(placed, files):
            _read_file(path, members, view)
        huge = _huge_page_bytes(view) if pages else 0
    finally:
        view.release()
    at = {p.name: p for p in placed}
    weights = {}
    for fw in fused:
        parts = [at.pop(name) for name in fw.parts]
        for a, b in zip(parts, parts[1:], strict=False):
            if a.offset + a.source.bytes != b.offset:
                raise InternalError(f"the parts of {fw.name} are not laid out end to end")
        rows = sum(p.source.shape[0] for p in parts)
        end = parts[-1].offset + parts[-1].source.bytes
        weights[fw.name] = _view(arena, parts[0].offset, end, parts[0].source, rows)
    for p in at.values():
        weights[p.name] = _view(arena, p.offset, p.offset + p.source.bytes, p.source)
    mx.eval(list(weights.values()))
    reason = (
        "transparent huge pages asked for (MADV_HUGEPAGE)"
        if pages
        else "no transparent huge pages here"
    )
    return weights, ArenaInfo(total, huge, reason)


def _view(arena: mx.array, start: int, end: int, src: HeaderTensor, rows: int | None = None):
    """Bytes ``start:end`` of the arena as ``src``'s dtype and shape (``rows`` on axis 0)."""
    shape = src.shape if rows is None else (rows, *src.shape[1:])
    return arena[start:end].view(dtype_from_name(src.dtype)).reshape(shape)


def switched_off() -> bool:
    value = os.environ.get(SWITCH, "on").strip().lower()
    if value not in ("on", "off"):
        raise DctmsError(f"{SWITCH} must be on or off, got {value!r}")
    return value == "off"


def _by_file(placed: list[Placed], files: dict[str, Path]):
    groups: dict[str, list[Placed]] = {}
    for p in placed:
        groups.setdefault(p.source.file, []).append(p)
    for name in sorted(groups):
        yield files[name], sorted(groups[name], key=lambda p: p.source.start)


def _read_file(path: Path, members: list[Placed], view: memoryview) -> None:
    try:
        with open(path, "rb", buffering=0) as f:
            for p in members:
                f.seek(p.source.start)
                done, size = 0, p.source.bytes
                while done < size:
                    end = p.offset + min(size, done + _READ_BLOCK)
                    got = f.readinto(view[p.offset + done : end])
                    if not got:
                        raise DctmsError(
                            f"{path}: tensor {p.name} ends early ({done} of {size} bytes read): "
                            "the file is truncated"
                        )
                    done += got
    except OSError as err:
        raise DctmsError(f"{path}: cannot read weights: {err.strerror}") from None


def _libc():
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _aligned_interior(view: memoryview) -> tuple[int, int]:
    """The arena's address range from its first to its last whole 2 MiB page."""
    base = ctypes.addressof(ctypes.c_char.from_buffer(view))
    start = -(-base // HUGE_PAGE) * HUGE_PAGE
    end = (base + view.nbytes) // HUGE_PAGE * HUGE_PAGE
    return start, end


def _ask_for_huge_pages(view: memoryview) -> bool:
    """Give the zeroed interior back and mark it for huge pages (its reads fault it in again)."""
    libc = _libc()
    try:
        setting = _THP_SETTING.read_text()
    except OSError:
        return False
    if libc is None or "[never]" in setting:
        return False
    start, end = _aligned_interior(view)
    if end <= start:
        return False
    if libc.madvise(start, end - start, _MADV_DONTNEED):
        return False  # nothing was given back: the zeros stay, on small pages
    return libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0


def _huge_page_bytes(view: memoryview) -> int:
    """AnonHugePages of the mappings that hold the arena (``/proc/self/smaps``)."""
    start, end = _aligned_interior(view)
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo < end and hi > start
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return total
