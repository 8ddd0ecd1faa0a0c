"""``dctms simulate PLAN``: replay a plan's allocations and frees through a model of its target's
allocator and report MLX's active-memory peak, which must not exceed the plan's provable envelope.

Independent of the compiler's lifetime pass: the simulator derives when each buffer is freed from
the ops alone, by playing MLX's host and a worker that is as slow as MLX allows.

* Allocation: the host allocates an op's arena outputs and scratch when it encodes the op, through
  the target's allocator (``schema.targets``): metal and cuda round requests, and their buffer cache
  hands out the smallest cached buffer s with r <= s < min(2 r, r + 2 pages) and counts s
  (mlx/backend/common/buffer_cache.h:30-46). The CPU's allocator counts requests as asked
  (mlx/backend/no_gpu/allocator.cpp:102-107); the runner disables its cache.
* Free: a buffer returns when the host holds it no more (after its last reader is encoded; a
  phase output at the phase end) *and* the unit of work that holds it has completed. CPU: every op
  ends with a holder dispatch keeping its inputs and temporaries (mlx/backend/cpu/eval.cpp:38-51);
  every 10th dispatch is a counted task (mlx/backend/cpu/encoder.h:13, 44-56), and the worker runs
  dispatches in order. GPU: an op's inputs are held until the command buffer it was encoded in
  completes (metal eval.cpp:47-68, cuda eval.cpp:60-76), committed past ``ops_per_buffer`` kernel ops.
* The worker is as slow as MLX allows: nothing completes until, after an op, the host finds more
  than 10 counted tasks outstanding (mlx/transforms.cpp:25, 271-285) and waits for one, or active
  memory is above MLX's memory limit (modelled only for a throttled CPU plan: the runner's
  ``throttle_limit``, the provable envelope minus the largest op allocation; a plan with free
  run-ahead claims never to reach its limit); a sync point drains everything.
* Static memory: every weight and KV array allocated once through the allocator, plus the runner's
  persistent blocks (constants and call inputs) as planned.

Two peaks per phase: *replay* (the cache as replaying the phase twice leaves it) and *worst reuse*
(every request served by the largest cached buffer the cache may hand out). On the CPU the task
boundaries depend on dispatches before the phase, so all 10 offsets are replayed.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from dctms.schema.errors import DctmsError
from dctms.schema.rules_derived import op_dispatches
from dctms.schema.sizes import FREE_RUN_AHEAD, is_arena_tenant
from dctms.schema.targets import MAX_ACTIVE_TASKS, counted, rounded
from dctms.schema.types import MemoryModel, Phase, Plan, Scratch

DISPATCHES_PER_TASK = 10  # mlx/backend/cpu/encoder.h:13
ROUNDING_BLOCK = "allocator.rounding"  # the compiler's block (toolkit.targets), replayed instead


class Allocator:
    """MLX's active-memory count with its buffer cache (``cache`` off: the runner's CPU setting)."""

    def __init__(self, model: MemoryModel | None, cache: bool, worst: bool = False) -> None:
        self.model, self.cache, self.worst = model, cache, worst
        self.pool: list[int] = []  # cached buffer sizes, sorted
        self.active = 0
        self.peak = 0

    def malloc(self, n: int) -> int:
        if n <= 0:
            return 0
        m = self.model
        r = rounded(m, n) if m is not None else n
        size = r
        if self.worst and m is not None:
            size = counted(m, n)
        elif self.cache and m is not None:
            k = bisect.bisect_left(self.pool, r)
            if k < len(self.pool) and self.pool[k] < min(2 * r, r + 2 * m.page_bytes):
                size = self.pool.pop(k)
        self.active += size
        self.peak = max(self.peak, self.active)
        return size

    def free(self, size: int) -> None:
        self.active -= size
        if self.cache and size:
            bisect.insort(self.pool, size)


@dataclass(frozen=True)
class PhasePeak:
    name: str
    replay: int  # static + the phase's peak, cache as replays leave it
    worst: int  # static + the phase's peak, every request served the largest reusable buffer


@dataclass(frozen=True)
class Simulation:
    target: str  # cpu | metal | cuda | gpu
    static: int  # weights, KV and the runner's persistent blocks, as allocated
    phases: list[PhasePeak]
    provable: int

    @property
    def peak(self) -> int:
        return max([self.static, *(p.replay for p in self.phases), *(p.worst for p in self.phases)])

    @property
    def ok(self) -> bool:
        return self.peak <= self.provable


@dataclass(frozen=True)
class _Events:
    """A phase's ops in execution order, as the simulator needs them."""

    order: list[int]
    weight: list[int]  # dispatches (CPU) or kernel ops (GPU) per position
    allocs: list[list[tuple[str, int]]]  # per position: (tensor, bytes) it allocates
    holds: list[list[str]]  # per position: the arena tensors its unit holds
    host_free: list[list[str]]  # per position: tensors the host lets go once it is encoded
    outputs: list[str]  # freed at the phase end
    sync_after: set[int]  # positions after which the runner evaluates (a sync point)


def simulate(plan: Plan) -> Simulation:
    """The active-memory peaks of ``plan`` replayed through its target's allocator model."""
    target = plan.target
    if target.backend == "gpu" and target.memory_model is None:
        raise DctmsError(
            "plan was traced on a GPU without a target memory model: nothing to simulate "
            "(compile with --target metal or --target cuda)"
        )
    model = target.memory_model
    name = model.name if model is not None else target.backend
    static = _static(plan, model)
    limit = _memory_limit(plan)
    # A speculative plan's draft phases run between the target's, never beside them.
    phases = [(p.name, p) for p in plan.phases]
    if plan.draft is not None:
        phases += [(f"draft {p.name}", p) for p in plan.draft.phases]
    peaks = [
        PhasePeak(
            name,
            _phase_peak(p, model, static, limit, worst=False),
            _phase_peak(p, model, static, limit, worst=True),
        )
        for name, p in phases
    ]
    return Simulation(name, static, peaks, plan.envelope.provable)


def _static(plan: Plan, model: MemoryModel | None) -> int:
    """Both models' weights and KV arrays allocated once, plus the runner's persistent blocks."""
    alloc = Allocator(model, cache=False)
    weights = list(plan.model.weights.tensors)
    state = list(plan.state)
    if plan.draft is not None:
        weights += plan.draft.model.weights.tensors
        state += plan.draft.state
    for w in weights:
        alloc.malloc(w.bytes)
    for s in state:
        if s.kind == "kv":
            alloc.malloc(s.bytes)
        elif s.name != ROUNDING_BLOCK:
            alloc.active += s.bytes  # constants and call inputs: planned with their own slack
    return alloc.active


def _memory_limit(plan: Plan) -> int | None:
    """MLX's memory limit during a run: the runner's (runner.session.throttle_limit) on the CPU;
    none modelled on a GPU target (MLX's default is far above any plan that fits)."""
    if plan.target.backend != "cpu" or plan.target.run_ahead_dispatches >= FREE_RUN_AHEAD:
        return None  # free run-ahead: the plan claims the runner's limit is never reached
    largest = 0
    for phase in [*plan.phases, *(plan.draft.phases if plan.draft else ())]:
        ev = _events(phase, False)
        largest = max([largest, *(sum(b for _, b in a) for a in ev.allocs)])
    return plan.envelope.provable - largest


def _events(phase: Phase, kernels: bool) -> _Events:
    order = [i for members in phase.slots for i in members]
    slot_of = {i: s for s, members in enumerate(phase.slots) for i in members}
    by_id = {t.id: t for t in phase.tensors}
    tenants = {t.id for t in phase.tensors if is_arena_tenant(t)}

    def root(t: str) -> str:
        v = by_id.get(t)
        return v.view_of if v is not None and v.view_of is not None else t

    scratch_of: dict[int, list[Scratch]] = {}
    for t in phase.tensors:
        if isinstance(t, Scratch):
            scratch_of.setdefault(t.op, []).append(t)
    last: dict[str, int] = {}
    allocs, holds = [], []
    for pos, i in enumerate(order):
        op = phase.ops[i]
        made = [(t, by_id[t].bytes) for t in op.outputs if t in tenants]
        made += [(s.id, s.bytes) for s in scratch_of.get(i, ())]
        allocs.append(made)
        held = {root(t) for t in op.inputs} & tenants
        held |= {s.id for s in scratch_of.get(i, ())}
        # an output nobody reads is let go once its op is encoded
        held |= {t for t in op.outputs if t in tenants}
        holds.append(sorted(held))
        for t in held:
            last[t] = pos
    outputs = sorted({root(b.id) for b in phase.outputs} & tenants)
    host_free: list[list[str]] = [[] for _ in order]
    for t, pos in last.items():
        if t not in outputs:
            host_free[pos].append(t)
    position = {i: p for p, i in enumerate(order)}
    sync_after = set()
    for sp in phase.sync_points:
        members = [position[i] for s, ms in enumerate(phase.slots) if s <= sp.slot for i in ms]
        if members:
            sync_after.add(max(members))
    del slot_of
    return _Events(
        order,
        op_dispatches(phase, order, kernels),
        allocs,
        holds,
        host_free,
        outputs,
        sync_after,
    )


def _phase_peak(
    phase: Phase, model: MemoryModel | None, static: int, limit: int | None, worst: bool
) -> int:
    ev = _events(phase, model is not None)
    if model is None:
        return max(_cpu_replay(ev, static, limit, offset) for offset in range(DISPATCHES_PER_TASK))
    alloc = Allocator(model, cache=True, worst=worst)
    peak = 0
    for _ in range(2):  # the second replay meets the cache the first one left
        alloc.peak = alloc.active = 0
        peak = max(peak, _gpu_replay(ev, alloc, model))
    return static + peak


class _Held:
    """Buffers held by the host and by units of work not yet completed."""

    def __init__(self, alloc: Allocator) -> None:
        self.alloc = alloc
        self.size: dict[str, int] = {}
        self.units: dict[str, int] = {}  # tensor -> units holding it not yet completed
        self.host: set[str] = set()

    def make(self, t: str, n: int) -> None:
        self.size[t] = self.alloc.malloc(n)
        self.host.add(t)

    def hold(self, t: str) -> None:
        self.units[t] = self.units.get(t, 0) + 1

    def release(self, t: str) -> None:
        self.units[t] -= 1
        self._maybe_free(t)

    def let_go(self, t: str) -> None:
        self.host.discard(t)
        self._maybe_free(t)

    def _maybe_free(self, t: str) -> None:
        if t not in self.host and self.units.get(t, 0) == 0 and t in self.size:
            self.alloc.free(self.size.pop(t))


def _gpu_replay(ev: _Events, alloc: Allocator, model: MemoryModel) -> int:
    held = _Held(alloc)
    committed: deque[list[str]] = deque()  # counted command buffers not yet completed
    open_buf: list[str] = []
    open_ops = 0

    def complete(buf: list[str]) -> None:
        for t in buf:
            held.release(t)

    for pos in range(len(ev.order)):
        for t, n in ev.allocs[pos]:
            held.make(t, n)
        for t in ev.holds[pos]:
            held.hold(t)
            open_buf.append(t)
        for t in ev.host_free[pos]:
            held.let_go(t)
        open_ops += ev.weight[pos]
        if open_ops > model.ops_per_buffer:  # needs_commit, then commit (metal device.cpp:511-562)
            committed.append(open_buf)
            open_buf, open_ops = [], 0
        if len(committed) > model.active_tasks:  # transforms.cpp:271-285: wait for one
            complete(committed.popleft())
        if pos in ev.sync_after:  # mx.eval returns: everything completed
            while committed:
                complete(committed.popleft())
            complete(open_buf)
            open_buf, open_ops = [], 0
    while committed:
        complete(committed.popleft())
    complete(open_buf)
    for t in ev.outputs:
        held.let_go(t)
    return alloc.peak


def _cpu_replay(ev: _Events, static: int, limit: int | None, offset: int) -> int:
    alloc = Allocator(None, cache=False)
    alloc.active = alloc.peak = static
    held = _Held(alloc)
    # the worker's queue: (holds released when it runs, counted-task marker after it)
    queue: deque[tuple[list[str], bool]] = deque()
    markers = 0
    count = offset

    def run_one() -> None:
        nonlocal markers
        holds, marker = queue.popleft()
        for t in holds:
            held.release(t)
        if marker:
            markers -= 1

    def wait_for_one() -> None:
        while queue:
            marker = queue[0][1]
            run_one()
            if marker:
                return

    for pos in range(len(ev.order)):
        for t, n in ev.allocs[pos]:
            held.make(t, n)
        for t in ev.holds[pos]:
            held.hold(t)
        for t in ev.host_free[pos]:
            held.let_go(t)
        d = max(1, ev.weight[pos])
        for k in range(d):
            count = (count + 1) % DISPATCHES_PER_TASK
            marker = count == 0
            markers += marker
            # the holder dispatch is the op's last (cpu/eval.cpp:50-51)
            queue.append((ev.holds[pos] if k == d - 1 else [], marker))
        over = limit is not None and alloc.active > limit
        if markers > MAX_ACTIVE_TASKS or (over and markers > 0):
            wait_for_one()
            while limit is not None and alloc.active > limit and markers > 0:
                wait_for_one()
        if pos in ev.sync_after:
            while queue:
                run_one()
    while queue:
        run_one()
    for t in ev.outputs:
        held.let_go(t)
    return alloc.peak


def report_lines(sim: Simulation, human: Callable[[int], str]) -> list[str]:
    """``dctms simulate``'s text: one line per phase, then the verdict."""
    how = (
        "MLX's CPU allocator: dctms run measures its real peak"
        if sim.target == "cpu"
        else "modelled from MLX's allocator source, not measured"
    )
    lines = [
        f"target {sim.target} ({how}); static (weights, KV, persistent) {sim.static:,} B",
        f"  {'phase':<16} {'replay peak':>16} {'worst-reuse peak':>18}",
    ]
    for p in sim.phases:
        lines.append(f"  {p.name:<16} {p.replay:>16,} {p.worst:>18,}")
    verdict = "within" if sim.ok else "EXCEEDS"
    lines.append(
        f"simulated peak {sim.peak:,} B ({human(sim.peak)}) {verdict} the provable envelope "
        f"{sim.provable:,} B ({human(sim.provable)})"
    )
    return lines
