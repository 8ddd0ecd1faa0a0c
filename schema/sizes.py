"""Byte-count conventions shared by the compiler, the verifier and the runner.

One place decides what a dtype costs, how offsets are aligned and which tensors live in the arena,
so the planner and the verifier cannot disagree about them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from dctms.schema.types import Tensor, WeightTensor

# MLX dtypes by name; bytes per element.
ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
}


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype``; raises ``KeyError`` for a name MLX does not have."""
    return ITEMSIZE[dtype]


def num_elements(shape: Iterable[int]) -> int:
    """Elements of an array of ``shape`` (1 for a scalar, shape ``[]``)."""
    return math.prod(shape)


def nbytes(shape: Iterable[int], dtype: str) -> int:
    """Bytes of a dense row-major array of ``shape`` and ``dtype``."""
    return num_elements(shape) * itemsize(dtype)


def align_up(value: int, alignment: int) -> int:
    """``value`` rounded up to a multiple of ``alignment`` (alignment >= 1)."""
    return -(-value // alignment) * alignment


def is_arena_tenant(tensor: Tensor) -> bool:
    """Whether ``tensor`` owns bytes in the phase's arena.

    Views alias their root's bytes and tensors of kind "state" alias persistent state (KV cache;
    they are views of the state input binding they update), so neither is a tenant; every other
    primitive output (kind "intermediate" or "output") is, and so is every scratch tensor.
    """
    return tensor.view_of is None and tensor.kind != "state"


def lower_bound_bytes(tensors: Iterable[Tensor], num_slots: int, alignment: int) -> int:
    """Max over slots of the aligned bytes of the arena tenants live in that slot.

    No arena can be smaller: tenants live at the same time need disjoint bytes. Tenants with a
    malformed interval are ignored (the verifier reports them separately).
    """
    return _max_live(tensors, num_slots, lambda t: align_up(t.bytes, alignment))


def slack_bytes(tensors: Iterable[Tensor], num_slots: int, allocator_slack: int) -> int:
    """Max over slots of what cache reuse can add to the live tenants: sum of min(bytes, slack)."""
    if allocator_slack <= 0:
        return 0
    return _max_live(tensors, num_slots, lambda t: min(t.bytes, allocator_slack))


def _max_live(tensors: Iterable[Tensor], num_slots: int, weight: Callable[[Tensor], int]) -> int:
    # Sweep: +weight where a tenant's interval starts, -weight after it ends; the running sum's max.
    delta = [0] * (num_slots + 1)
    for tensor in tensors:
        iv = tensor.interval
        if not is_arena_tenant(tensor) or len(iv) != 2 or not 0 <= iv[0] <= iv[1] < num_slots:
            continue
        w = weight(tensor)
        delta[iv[0]] += w
        delta[iv[1] + 1] -= w
    best = live = 0
    for change in delta:
        live += change
        best = max(best, live)
    return best


def cast_order(tensors: Iterable[WeightTensor]) -> list[WeightTensor]:
    """The weights a plan casts at load (``stored_dtype`` set), in the order the runner casts them:
    largest stored copy first, so each stored copy in flight is covered by weights not yet loaded."""
    cast = [w for w in tensors if w.stored_dtype is not None]
    return sorted(cast, key=lambda w: (-nbytes(w.shape, w.stored_dtype or w.dtype), w.name))


def cast_overshoot(tensors: list[WeightTensor]) -> int:
    """Bytes by which loading with casts can exceed the resident weights: casting tensor i holds
    the resident copies cast so far, its stored copy and its new copy, while the weights cast later
    and those loaded as stored are not loaded yet."""
    order = cast_order(tensors)
    total = sum(w.bytes for w in tensors)
    done, worst = 0, 0
    for w in order:
        done += w.bytes
        worst = max(worst, done + nbytes(w.shape, w.stored_dtype or w.dtype) - total)
    return worst
