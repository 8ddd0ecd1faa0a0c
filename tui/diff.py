"""What changed between two plans: envelope, bounds, model fingerprint, Table 1, phases (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from dctms.schema.types import Plan
from dctms.tui.data import COMPONENTS, MIB, bounds_rows


@dataclass(frozen=True)
class Delta:
    """A numeric figure in both plans; ``None`` where a plan does not have it (e.g. no device)."""

    name: str
    old: int | float | None
    new: int | float | None

    @property
    def delta(self) -> int | float | None:
        if self.old is None or self.new is None:
            return None
        return self.new - self.old

    @property
    def delta_mib(self) -> float | None:
        d = self.delta
        return None if d is None else d / MIB

    @property
    def percent(self) -> float | None:
        """Change relative to the old value; ``None`` when the old value is 0 or missing."""
        d = self.delta
        if d is None or not self.old:
            return None
        return 100.0 * d / self.old

    @property
    def changed(self) -> bool:
        return self.old != self.new


@dataclass(frozen=True)
class Change:
    """A non-numeric field in both plans (text, hashes)."""

    name: str
    old: str
    new: str

    @property
    def changed(self) -> bool:
        return self.old != self.new


@dataclass(frozen=True)
class PlanDiff:
    envelope: list[Delta]
    bounds: list[Change]
    fingerprint: list[Change]
    table1: list[Delta]
    phases: list[Delta]

    @property
    def changed(self) -> int:
        """How many figures differ (0: the plans agree on everything shown)."""
        rows = [*self.envelope, *self.bounds, *self.fingerprint, *self.table1, *self.phases]
        return sum(1 for r in rows if r.changed)


def envelope_deltas(old: Plan, new: Plan) -> list[Delta]:
    a, b = old.envelope, new.envelope
    rows = [Delta(name, getattr(a, name), getattr(b, name)) for name in COMPONENTS]
    rows.append(Delta("total = M_max", a.total, b.total))
    if a.device is not None or b.device is not None:
        rows.append(Delta("device", a.device, b.device))
    if a.free is not None or b.free is not None:
        rows.append(Delta("free", a.free, b.free))
    return rows


def bounds_changes(old: Plan, new: Plan) -> list[Change]:
    return [
        Change(name, before, after)
        for (name, before), (_, after) in zip(bounds_rows(old), bounds_rows(new), strict=True)
    ]


def _quantization(plan: Plan) -> str:
    q = plan.model.quantization
    return "none" if q is None else f"{q.bits}-bit {q.mode}, groups of {q.group_size}"


def _files(plan: Plan) -> str:
    files = plan.model.weights.files_sha256
    if not files:
        return "unknown"
    return ", ".join(f"{name} {sha[:12]}" for name, sha in sorted(files.items()))


def fingerprint_changes(old: Plan, new: Plan) -> list[Change]:
    def fields(p: Plan) -> list[tuple[str, str]]:
        m, w = p.model, p.model.weights
        return [
            ("model architecture", m.architecture),
            ("config sha256", m.config_sha256),
            ("layers", str(m.num_layers)),
            ("vocab size", str(m.vocab_size)),
            ("quantization", _quantization(p)),
            ("weights count", f"{w.count:,}"),
            ("weights bytes", f"{w.total_bytes:,}"),
            ("weights layout sha256", w.layout_sha256),
            ("weights files", _files(p)),
            ("target", f"{p.target.backend}, alignment {p.target.alignment}"),
            ("generator", f"dctms {p.generator.dctms}, mlx {p.generator.mlx}"),
        ]

    return [
        Change(name, before, after)
        for (name, before), (_, after) in zip(fields(old), fields(new), strict=True)
    ]


def table1_deltas(old: Plan, new: Plan) -> list[Delta]:
    a, b = old.stats, new.stats
    return [
        Delta("logical tensors", a.logical_tensors, b.logical_tensors),
        Delta("physical buffers", a.physical_buffers, b.physical_buffers),
        Delta("reduction", a.reduction, b.reduction),
        Delta("arena bytes", a.arena_bytes, b.arena_bytes),
        Delta("lower bound bytes", a.lower_bound_bytes, b.lower_bound_bytes),
    ]


def phase_deltas(old: Plan, new: Plan) -> list[Delta]:
    """Per phase (matched by name): arena, lower bound, ops, tensors, slots."""
    before = {p.name: p for p in old.phases}
    after = {p.name: p for p in new.phases}
    names = list(before) + [n for n in after if n not in before]
    rows = []
    for name in names:
        a, b = before.get(name), after.get(name)
        for label, get in (
            ("arena", lambda p: p.arena_bytes),
            ("lower bound", lambda p: p.lower_bound_bytes),
            ("ops", lambda p: len(p.ops)),
            ("tensors", lambda p: len(p.tensors)),
            ("slots", lambda p: len(p.slots)),
        ):
            rows.append(
                Delta(
                    f"{name} {label}", None if a is None else get(a), None if b is None else get(b)
                )
            )
    return rows


def plan_diff(old: Plan, new: Plan) -> PlanDiff:
    return PlanDiff(
        envelope_deltas(old, new),
        bounds_changes(old, new),
        fingerprint_changes(old, new),
        table1_deltas(old, new),
        phase_deltas(old, new),
    )
