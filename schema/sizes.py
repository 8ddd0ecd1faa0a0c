"""Byte-count conventions shared by the compiler, the verifier and the runner.

One place decides what a dtype costs, how offsets are aligned and which tensors live in the arena,
so the planner and the verifier cannot disagree about them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

from dctms.schema.targets import overhead, run_ahead_budget
from dctms.schema.types import MemoryModel, Tensor, WeightTensor

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


def live_bytes(spans: Iterable[tuple[int, int, int]], num_slots: int) -> list[int]:
    """The one live-bytes sweep: bytes live in each slot, from ``(start, end, bytes)`` spans.

    Slot ranges are inclusive. Compiler (lower bound), verifier, figures (memory curve) and the TUI
    all use it. A span that is reversed or reaches outside ``[0, num_slots)`` is ignored (the
    verifier reports such intervals separately).
    """
    delta = [0] * (num_slots + 1)
    for start, end, size in spans:
        if 0 <= start <= end < num_slots:
            delta[start] += size
            delta[end + 1] -= size
    curve, live = [], 0
    for change in delta[:num_slots]:
        live += change
        curve.append(live)
    return curve


def tenant_spans(
    tensors: Iterable[Tensor], weight: Callable[[Tensor], int]
) -> Iterator[tuple[int, int, int]]:
    """``(start, end, weight(t))`` of every arena tenant with a two-element interval."""
    for tensor in tensors:
        iv = tensor.interval
        if is_arena_tenant(tensor) and len(iv) == 2:
            yield iv[0], iv[1], weight(tensor)


def arena_curve(tensors: Iterable[Tensor], num_slots: int, alignment: int) -> list[int]:
    """Aligned bytes of the arena tenants live in each slot: the memory curve of a phase."""
    return live_bytes(tenant_spans(tensors, lambda t: align_up(t.bytes, alignment)), num_slots)


def lower_bound_bytes(tensors: Iterable[Tensor], num_slots: int, alignment: int) -> int:
    """Max over slots of the aligned bytes of the arena tenants live in that slot.

    No arena can be smaller: tenants live at the same time need disjoint bytes. Tenants with a
    malformed interval are ignored (the verifier reports them separately).
    """
    return max(arena_curve(tensors, num_slots, alignment), default=0)


def slack_bytes(
    tensors: Iterable[Tensor],
    num_slots: int,
    allocator_slack: int,
    model: MemoryModel | None = None,
) -> int:
    """Max over slots of what the allocator can add to the live tenants: with a GPU target's
    ``model`` (``schema.targets``) its rounding and cache reuse, else sum of min(bytes, slack)."""
    if model is None and allocator_slack <= 0:
        return 0
    spans = tenant_spans(tensors, lambda t: overhead(model, t.bytes, allocator_slack))
    return max(live_bytes(spans, num_slots), default=0)


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


# MLX's CPU run-ahead (mlx/transforms.cpp, mlx/backend/cpu/encoder.h): the host waits after an op
# while more than MAX_ACTIVE_TASKS = 10 full tasks of DISPATCHES_PER_TASK = 10 dispatches are
# outstanding, so when it schedules an op at most 10 full tasks and the partial one (<= 9) of the
# phase's stream have not run: about 110 dispatches. Measured: a chain of matmuls (two dispatches
# each) holds 55-57 outputs alive at once (tests/test_compiler_passes.py); 120 leaves a margin. That
# holds always ("free" run-ahead). Under the runner's memory-limit throttle the worker lags at most
# the partial task ("throttled": 10, the reading op's own dispatch included).
FREE_RUN_AHEAD = 120
THROTTLED_RUN_AHEAD = 10
RUN_AHEAD = {"free": FREE_RUN_AHEAD, "throttled": THROTTLED_RUN_AHEAD}


def recorded_run_ahead(backend: str, mode: str, model: MemoryModel | None = None) -> int:
    """``Target.run_ahead_dispatches`` of a plan compiled with run-ahead ``mode``: MLX's CPU
    run-ahead; a GPU target's command-buffer bound (``schema.targets``, in kernel ops); 0 for a GPU
    plan traced natively (not modelled)."""
    if model is not None:
        return run_ahead_budget(model)
    return RUN_AHEAD[mode] if backend == "cpu" else 0


def run_ahead_end(prefix: list[int], k: int, end: int, budget: int) -> int:
    """The last execution position a tensor read last at ``k`` may stay alive to: the largest
    j <= ``end`` (its segment's sync point) with fewer than ``budget`` encoder dispatches between
    them (``prefix``: running sums of the ops' dispatches, ``prefix[q]`` before op q)."""
    lo, hi = k, end
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prefix[mid] - prefix[k + 1] < budget:
            lo = mid
        else:
            hi = mid - 1
    return lo
