"""A plan on the roofline: per phase and op class, FLOPs, bytes moved and the time the target's peak
figures allow; from those, the predicted time per decode token, TTFT and tok/s.

Each op takes ``max(FLOPs / peak_flops, bytes / bandwidth)`` (its roofline time) and the ops of a
phase run one after another, so a phase's time is the sum over its ops. That is a *lower bound* on a
real run: dispatch overhead, cache effects and kernels below peak only add to it, which is what the
predicted/measured ratio shows.

Predictions default to ``prediction_profile(plan)``: the plan's own target profile, except where
that profile describes a BLAS dctms does not run with. The CPU scheduling profile
``cpu-x86-2core`` was measured on MLX's bundled reference BLAS (4.5 GFLOP/s), while every ``dctms``
command that computes preloads OpenBLAS (``dctms.runner.blas``); its predictions use
``cpu-x86-2core-openblas``, the same machine through OpenBLAS. The plan itself (its slots, which
the scheduling profile decides) is unchanged. A fixed, recorded profile keeps every prediction the
same on every machine; ``dctms roofline --measure`` measures the machine it runs on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dctms.figures.op_costs import BYTE_KINDS, CLASSES, OpCost, phase_costs
from dctms.schema.types import Phase, Plan, TargetProfile

# The development machine through the BLAS dctms runs with (see the module docstring).
CPU_OPENBLAS = TargetProfile(
    name="cpu-x86-2core-openblas",
    peak_flops=102e9,
    peak_flops_source=(
        "measured 2026-12-02: best of 15 MLX float32 2048x2048 matmuls through OpenBLAS 0.3.21 "
        "(2 threads, preloaded as dctms does) on the 2-core AVX-512 Xeon this project is developed "
        "on, 102 GFLOP/s (dctms roofline --measure re-measures)"
    ),
    bandwidth_bytes_per_s=21.0e9,
    bandwidth_source=(
        "measured: best of 10 numpy copies of 256 MiB on the same machine, 21 GB/s read+write "
        "(as cpu-x86-2core; dctms roofline --measure re-measures)"
    ),
)
# Scheduling profiles whose BLAS is not the one dctms runs with -> the profile to predict on.
PREDICT_ON = {"cpu-x86-2core": CPU_OPENBLAS}


def prediction_profile(plan: Plan) -> TargetProfile:
    """The profile predicted times use by default (module docstring): the plan's own, or for a
    plan scheduled on the reference-BLAS CPU profile, the same machine through OpenBLAS."""
    own = plan.target.profile
    return PREDICT_ON.get(own.name, own) if plan.target.backend == "cpu" else own


@dataclass
class ClassRow:
    """One op class of one phase."""

    op_class: str
    ops: int = 0
    flops: float = 0.0
    weights: int = 0
    kv: int = 0
    activations: int = 0
    scratch: int = 0
    seconds: float = 0.0  # sum of the ops' roofline times
    memory_bound_ops: int = 0

    @property
    def bytes(self) -> int:
        return self.weights + self.kv + self.activations + self.scratch

    @property
    def intensity(self) -> float | None:
        """FLOPs per byte moved (None when nothing is moved)."""
        return self.flops / self.bytes if self.bytes else None

    def bound(self, ridge: float) -> str:
        if self.bytes == 0 and self.flops == 0:
            return "-"
        intensity = self.intensity
        return "memory" if intensity is not None and intensity < ridge else "compute"

    def add(self, cost: OpCost, seconds: float, memory_bound: bool) -> None:
        self.ops += 1
        self.flops += cost.flops
        self.weights += cost.weights
        self.kv += cost.kv
        self.activations += cost.activations
        self.scratch += cost.scratch
        self.seconds += seconds
        self.memory_bound_ops += memory_bound


@dataclass
class PhaseRoofline:
    name: str
    tokens: int  # tokens per call
    rows: list[ClassRow]  # op classes present, in CLASSES order
    total: ClassRow = field(default_factory=lambda: ClassRow("total"))

    @property
    def seconds(self) -> float:
        """Roofline time of one call of the phase."""
        return self.total.seconds


@dataclass
class Roofline:
    profile: TargetProfile
    batch: int
    phases: list[PhaseRoofline]
    prompt_tokens: int
    prefill_calls: list[tuple[str, int]]  # (phase, calls) that a prompt of prompt_tokens takes
    ttft_s: float
    decode_s: float  # one decode call (batch sequences, one token each)

    @property
    def ridge(self) -> float:
        return ridge_point(self.profile)

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second per sequence at the roofline."""
        return 1.0 / self.decode_s if self.decode_s > 0 else None

    def phase(self, name: str) -> PhaseRoofline:
        return next(p for p in self.phases if p.name == name)


def ridge_point(profile: TargetProfile) -> float:
    """FLOPs per byte above which an op is compute-bound on ``profile``."""
    return profile.peak_flops / profile.bandwidth_bytes_per_s


def op_seconds(cost: OpCost, profile: TargetProfile) -> float:
    compute = cost.flops / profile.peak_flops if profile.peak_flops > 0 else 0.0
    memory = (
        cost.bytes / profile.bandwidth_bytes_per_s if profile.bandwidth_bytes_per_s > 0 else 0.0
    )
    return max(compute, memory)


def phase_roofline(phase: Phase, profile: TargetProfile) -> PhaseRoofline:
    ridge = ridge_point(profile)
    rows = {c: ClassRow(c) for c in CLASSES}
    total = ClassRow("total")
    for cost in phase_costs(phase):
        seconds = op_seconds(cost, profile)
        bound = cost.bytes > 0 and cost.flops / cost.bytes < ridge
        rows[cost.op_class].add(cost, seconds, bound)
        total.add(cost, seconds, bound)
    return PhaseRoofline(phase.name, phase.tokens, [r for r in rows.values() if r.ops], total)


def prefill_phases(plan: Plan) -> list[Phase]:
    """The phases that take prompt tokens (named ``prefill``…), largest first."""
    return sorted((p for p in plan.phases if p.name.startswith("prefill")), key=lambda p: -p.tokens)


def prefill_calls(plan: Plan, prompt_tokens: int) -> list[tuple[str, int]]:
    """How the runner covers a prompt: full calls of the largest prefill phase, then the remainder
    with the smallest phase that holds it (one padded call). With a single prefill phase this is
    ``ceil(P / prefill_chunk)`` calls of it."""
    phases = prefill_phases(plan)
    if not phases or prompt_tokens <= 0:
        return []
    largest = phases[0]
    full, rest = divmod(prompt_tokens, largest.tokens)
    calls: dict[str, int] = {}
    if full:
        calls[largest.name] = full
    if rest:
        tail = min((p for p in phases if p.tokens >= rest), key=lambda p: p.tokens)
        calls[tail.name] = calls.get(tail.name, 0) + 1
    return list(calls.items())


def plan_roofline(
    plan: Plan, profile: TargetProfile | None = None, prompt_tokens: int | None = None
) -> Roofline:
    """The plan on ``profile`` (default: ``prediction_profile(plan)``); TTFT for a prompt of
    ``prompt_tokens`` (default: the plan's N)."""
    profile = profile or prediction_profile(plan)
    prompt = plan.bounds.input_tokens if prompt_tokens is None else prompt_tokens
    phases = [phase_roofline(p, profile) for p in plan.phases]
    by_name = {p.name: p for p in phases}
    calls = prefill_calls(plan, prompt)
    ttft = math.fsum(by_name[name].seconds * n for name, n in calls)
    decode = by_name["decode"].seconds if "decode" in by_name else 0.0
    return Roofline(profile, plan.bounds.batch, phases, prompt, calls, ttft, decode)


def roofline_summary(roof: Roofline) -> dict:
    """The headline figures, JSON-ready (what ``dctms roofline``, ``fit`` and the TUI show)."""
    decode = next((p for p in roof.phases if p.name == "decode"), None)
    return {
        "profile": roof.profile.name,
        "ridge_flops_per_byte": roof.ridge,
        "prompt_tokens": roof.prompt_tokens,
        "ttft_s": roof.ttft_s,
        "decode_s_per_token": roof.decode_s,
        "decode_tokens_per_s": roof.decode_tokens_per_s,
        "decode_bound": decode.total.bound(roof.ridge) if decode else None,
        "decode_bytes": decode.total.bytes if decode else None,
    }


def _row_doc(row: ClassRow, ridge: float) -> dict:
    return {
        "op_class": row.op_class,
        "ops": row.ops,
        "flops": row.flops,
        "bytes": {kind: getattr(row, kind) for kind in BYTE_KINDS} | {"total": row.bytes},
        "intensity_flops_per_byte": row.intensity,
        "bound": row.bound(ridge),
        "memory_bound_ops": row.memory_bound_ops,
        "seconds": row.seconds,
    }


def roofline_doc(roof: Roofline) -> dict:
    """Everything ``dctms roofline --json`` prints."""
    p = roof.profile
    return {
        "format": "dctms-roofline/1",
        "profile": {
            "name": p.name,
            "peak_flops": p.peak_flops,
            "peak_flops_source": p.peak_flops_source,
            "bandwidth_bytes_per_s": p.bandwidth_bytes_per_s,
            "bandwidth_source": p.bandwidth_source,
            "ridge_flops_per_byte": roof.ridge,
        },
        "batch": roof.batch,
        "phases": [
            {
                "name": ph.name,
                "tokens_per_call": ph.tokens,
                "seconds_per_call": ph.seconds,
                "classes": [_row_doc(r, roof.ridge) for r in ph.rows],
                "total": _row_doc(ph.total, roof.ridge),
            }
            for ph in roof.phases
        ],
        "prefill_calls": [{"phase": name, "calls": n} for name, n in roof.prefill_calls],
        "summary": roofline_summary(roof),
    }


def seconds_text(seconds: float) -> str:
    """A duration with a unit that keeps 3-4 significant digits."""
    if seconds >= 100:
        return f"{seconds:,.0f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def tokens_per_s_text(rate: float | None) -> str:
    if rate is None:
        return "-"
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"


@dataclass(frozen=True)
class PhaseLine:
    """One phase of a plan on the roofline, as the inspector's Overview lists it."""

    name: str
    tokens: int
    flops: float
    bytes: int
    intensity: float | None
    bound: str
    seconds: float


def phase_lines(roof: Roofline) -> list[PhaseLine]:
    return [
        PhaseLine(
            p.name,
            p.tokens,
            p.total.flops,
            p.total.bytes,
            p.total.intensity,
            p.total.bound(roof.ridge),
            p.seconds,
        )
        for p in roof.phases
    ]
