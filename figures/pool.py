"""Several plans in one process: their combined envelope (``dctms pool``, and ``dctms serve``'s
start-up check). Pure functions over plans; ``dctms.views.pool`` renders the result as text.

What each plan holds for the life of the process is *summed*: its weights, its KV cache (allocated at
plan capacity) and its persistent state (constants, the per-call input arrays). What only exists
while a call runs is *shared* when calls run one at a time: the arena of intermediates is freed at
the end of every call, so the next call (of any plan) reuses those bytes and the pool needs only the
largest arena; with ``concurrent`` calls can overlap, so the arenas are summed. The runtime
allowance has two parts: the process baseline (interpreter, MLX, tokenizers), paid once per process
whatever it serves, and MLX's buffer cache, a process-wide limit the runner sets to the running
plan's arena when its plan counts allocator slack (so, like the arena, the largest when serial and
the sum when concurrent).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dctms.figures.units import MIB
from dctms.schema.types import Plan


@dataclass(frozen=True)
class PoolMember:
    name: str
    weights: int
    kv: int
    persistent: int
    intermediate: int
    runtime: int  # the plan's own allowance (its process baseline + its buffer cache)
    cache: int  # MLX buffer-cache limit the runner sets for this plan (0: cache off)
    total: int  # the plan's own M_max
    # The graphs the runner records (runner.execute) when it has run at every verified length
    # point: held by the process outside MLX's count and outside M_max (see RECORDED_OP_BYTES).
    recorded: int = 0

    @property
    def held(self) -> int:
        """Bytes this plan keeps allocated between calls."""
        return self.weights + self.kv + self.persistent

    @property
    def baseline(self) -> int:
        """The runtime allowance less the buffer cache: the process the plan would run in."""
        return self.runtime - self.cache


@dataclass(frozen=True)
class Pool:
    members: tuple[PoolMember, ...]
    concurrent: bool
    budget: int | None
    # What the hosting process adds outside MLX beyond a runner's baseline (``dctms serve``: its
    # HTTP stack, transformers for chat templates): (what and where the figure comes from, bytes).
    extras: tuple[tuple[str, int], ...] = ()

    @property
    def held(self) -> int:
        return sum(m.held for m in self.members)

    @property
    def intermediate(self) -> int:
        """The arena bytes: the largest (one call at a time) or the sum (concurrent)."""
        sizes = [m.intermediate for m in self.members]
        return sum(sizes) if self.concurrent else max(sizes, default=0)

    @property
    def cache(self) -> int:
        sizes = [m.cache for m in self.members]
        return sum(sizes) if self.concurrent else max(sizes, default=0)

    @property
    def baseline(self) -> int:
        return max((m.baseline for m in self.members), default=0)

    @property
    def runtime(self) -> int:
        return self.baseline + self.cache + sum(b for _, b in self.extras)

    @property
    def provable(self) -> int:
        """What MLX's peak memory must never exceed while the pool serves."""
        return self.held + self.intermediate

    @property
    def total(self) -> int:
        return self.provable + self.runtime

    @property
    def separate_total(self) -> int:
        """The plans' M_max added up, as if each ran in its own process."""
        return sum(m.total for m in self.members)

    @property
    def free(self) -> int | None:
        return None if self.budget is None else self.budget - self.total

    @property
    def fits(self) -> bool:
        return self.budget is None or self.total <= self.budget

    def prefix_that_fits(self) -> int:
        """How many of the plans, taken in the order given, fit the budget together."""
        if self.budget is None:
            return len(self.members)
        for k in range(len(self.members), 0, -1):
            if compose(self.members[:k], self.concurrent, self.budget, self.extras).fits:
                return k
        return 0


# Resident bytes per op of a recorded graph (runner.execute records each length point's segments
# with mx.export_function / import_function): 155.6 MiB of RSS for the 200,220 ops of the 71
# points of SmolLM2-135M's 8-slot plan (N 256, M 64), 815 B per op, measured 2026-12-02 on the
# 2-core development machine (`python /tmp/rec.py`-style: RSS around BatchSession.prerecord());
# rounded up to 1 KiB.
RECORDED_OP_BYTES = 1024
RUNNER_PHASES = ("prefill", "decode", "decode_one", "prefill_start", "decode_start", "verify")


def recorded_bytes(plan: Plan) -> int:
    """What the runner's recorded graphs hold once every verified point of the phases it runs has
    been used (a long-running server's worst case)."""
    ops = 0
    for phase in [*plan.phases, *(plan.draft.phases if plan.draft else ())]:
        if phase.name in RUNNER_PHASES:
            points = len(phase.lengths.points) if phase.lengths else 1
            ops += len(phase.ops) * points
    return ops * RECORDED_OP_BYTES


def member(name: str, plan: Plan) -> PoolMember:
    env = plan.envelope
    cache = env.intermediate if plan.target.allocator_slack else 0
    return PoolMember(
        name=name,
        weights=env.weights,
        kv=env.kv,
        persistent=env.persistent,
        intermediate=env.intermediate,
        runtime=env.runtime,
        cache=cache,
        total=env.total,
        recorded=recorded_bytes(plan),
    )


def compose(members: tuple[PoolMember, ...] | list[PoolMember], concurrent: bool,
            budget: int | None, extras: tuple[tuple[str, int], ...] = ()) -> Pool:
    return Pool(tuple(members), concurrent, budget, tuple(extras))


def pool_of(named_plans: list[tuple[str, Plan]], concurrent: bool = False,
            budget: int | None = None, extras: tuple[tuple[str, int], ...] = ()) -> Pool:
    return compose([member(n, p) for n, p in named_plans], concurrent, budget, extras)


def explanation(pool: Pool) -> list[str]:
    """What is shared and what is summed, and why (printed by ``dctms pool``, served by /status)."""
    arena = (
        "summed: calls may run at the same time, so every arena can be live at once"
        if pool.concurrent
        else "shared: one call at a time, and a call's arena is free when it returns, so the "
        "largest arena serves every plan"
    )
    lines = [
        "weights, KV cache, persistent: summed (every plan holds them for the life of the process)",
        f"intermediate arena: {arena}",
        "runtime: the process baseline once per process (the largest plan's), plus MLX's buffer "
        "cache, a process-wide limit: " + ("summed" if pool.concurrent else "the largest"),
    ]
    lines += [f"runtime, once per process: + {what} ({size / MIB:.0f} MiB)" for what, size in pool.extras]
    return lines


def pool_summary(pool: Pool) -> dict:
    """Plain data for ``--json`` and the server's status endpoint."""
    return {
        "concurrent": pool.concurrent,
        "plans": [dict(asdict(m), held=m.held) for m in pool.members],
        "held": pool.held,
        "intermediate": pool.intermediate,
        "runtime": pool.runtime,
        "runtime_baseline": pool.baseline,
        "runtime_cache": pool.cache,
        "runtime_extras": [{"what": w, "bytes": b} for w, b in pool.extras],
        "provable": pool.provable,
        "total": pool.total,
        "separate_total": pool.separate_total,
        "budget": pool.budget,
        "free": pool.free,
        "fits": pool.fits,
        "plans_that_fit": pool.prefix_that_fits(),
        "composition": explanation(pool),
    }
