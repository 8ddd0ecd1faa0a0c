"""Intermediate bytes by module between two plans (``dctms diff`` and its JSON).

Modules are compared with their layer written ``*`` (``model.layers.*.self_attn``), so a peak that
moved from layer 0 to layer 5 still lines up. Per phase and module: the bytes live at the phase's
peak that the module made, and the aligned bytes of every arena tenant it makes (all layers).
"""

from __future__ import annotations

from dataclasses import dataclass

from dctms.figures.memory import live_at, memory_curve, peak
from dctms.schema.modules import op_modules
from dctms.schema.sizes import align_up, is_arena_tenant
from dctms.schema.types import Phase, Plan, Scratch


@dataclass(frozen=True)
class ModuleDelta:
    phase: str
    module: str  # layer written as "*"
    old_peak: int  # bytes live at the phase's peak made by the module
    new_peak: int
    old_bytes: int  # aligned bytes of all its arena tenants
    new_bytes: int

    @property
    def peak_delta(self) -> int:
        return self.new_peak - self.old_peak

    @property
    def bytes_delta(self) -> int:
        return self.new_bytes - self.old_bytes


def layer_wildcard(path: str) -> str:
    """``model.layers.3.self_attn`` -> ``model.layers.*.self_attn`` (paths outside layers kept)."""
    names = path.split(".")
    for i, n in enumerate(names):
        if n.isdigit():
            names[i] = "*"
            break
    return ".".join(names)


def _by_module(plan: Plan, phase: Phase) -> tuple[dict[str, int], dict[str, int]]:
    """(peak bytes, all tenant bytes) per wildcarded module of one phase."""
    align = plan.target.alignment
    modules = op_modules(plan, phase)
    made_by: dict[str, int] = {}
    for k, op in enumerate(phase.ops):
        for t in op.outputs:
            made_by.setdefault(t, k)

    def module_of(t) -> str:
        k = t.op if isinstance(t, Scratch) else made_by.get(t.id)
        path = modules[k] if k is not None and k < len(modules) else None
        return layer_wildcard(path) if path else "(unknown)"

    total: dict[str, int] = {}
    for t in phase.tensors:
        if is_arena_tenant(t):
            m = module_of(t)
            total[m] = total.get(m, 0) + align_up(t.bytes, align)
    slot, _ = peak(memory_curve(phase, align))
    at_peak: dict[str, int] = {}
    for t in live_at(phase, slot, align):
        m = module_of(t)
        at_peak[m] = at_peak.get(m, 0) + align_up(t.bytes, align)
    return at_peak, total


def module_deltas(old: Plan, new: Plan) -> list[ModuleDelta]:
    """The modules whose intermediate bytes differ, per phase both plans have; largest peak
    change first. Empty when either plan has no module paths."""
    if old.modules is None or new.modules is None:
        return []
    rows = []
    new_phases = {p.name: p for p in new.phases}
    for op in old.phases:
        np_ = new_phases.get(op.name)
        if np_ is None:
            continue
        (op_peak, op_total), (np_peak, np_total) = _by_module(old, op), _by_module(new, np_)
        for m in sorted(set(op_total) | set(np_total)):
            row = ModuleDelta(
                op.name,
                m,
                op_peak.get(m, 0),
                np_peak.get(m, 0),
                op_total.get(m, 0),
                np_total.get(m, 0),
            )
            if row.peak_delta or row.bytes_delta:
                rows.append(row)
    rows.sort(key=lambda r: (-abs(r.peak_delta), -abs(r.bytes_delta), r.phase, r.module))
    return rows
