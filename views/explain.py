"""``dctms explain``'s text and JSON: the figures of ``dctms.figures.explain``, laid out."""

from __future__ import annotations

import dataclasses
from typing import Any

from dctms.figures.explain import Explanation, KnobEffect, peak_sentence
from dctms.figures.units import MIB

_TOP_WEIGHTS = 8


def explain_text(ex: Explanation, knobs: list[KnobEffect] | None) -> str:
    """Sentences first, then the component table, each peak's tensors by module, the knobs."""
    out = ["findings"] + [f"  - {line}" for line in ex.findings]
    out += ["", f"{'what M_max is made of':<52} {'MiB':>12}  detail"]
    shown = 0
    for part in ex.parts:
        if part.component == "weights":
            shown += 1
            if shown > _TOP_WEIGHTS:
                continue
        label = f"{part.component}: {part.what}"
        out.append(f"  {label:<50} {part.bytes / MIB:>12,.2f}  {part.detail}")
    rest = [p for p in ex.parts if p.component == "weights"][_TOP_WEIGHTS:]
    if rest:
        size = sum(p.bytes for p in rest)
        out.append(f"  {'weights: ' + str(len(rest)) + ' smaller groups':<50} {size / MIB:>12,.2f}")
    out.append(f"  {'total = M_max':<50} {ex.total / MIB:>12,.2f}")
    out += ["", "which bounds drive each component"]
    for d in ex.drivers:
        out.append(f"  {d.component:<13} [{', '.join(d.bounds)}] {d.sentence}")
    for pk in ex.peaks:
        out += ["", peak_sentence(pk)]
        out.append(f"  {'module':<44} {'MiB':>10} {'tensors':>8}  largest")
        for m in pk.modules[:8]:
            shape = m.shapes[0] if m.shapes else ""
            out.append(f"  {m.module:<44} {m.bytes / MIB:>10,.2f} {m.tensors:>8}  {shape}")
        out.append(
            f"  {'tensor':<8} {'module':<36} {'primitive':<16} {'shape':<22} {'dtype':<9} {'MiB':>9}"
        )
        for t in pk.tensors:
            shape = "[" + ",".join(map(str, t.shape)) + "]"
            out.append(
                f"  {t.id:<8} {t.module:<36} {t.primitive:<16} {shape:<22} {t.dtype:<9} "
                f"{t.bytes / MIB:>9,.2f}"
            )
    if knobs is not None:
        out += ["", "what each knob changes (measured: a re-compile per knob against a baseline)"]
        out += [f"  - {k.sentence()}" for k in knobs] or ["  (no knob can be changed)"]
    return "\n".join(line.rstrip() for line in out) + "\n"


def explain_data(ex: Explanation, knobs: list[KnobEffect] | None) -> dict[str, Any]:
    """The same figures as JSON values (integer bytes)."""
    data = dataclasses.asdict(ex)
    if knobs is not None:
        data["knobs"] = [{**dataclasses.asdict(k), "sentence": k.sentence()} for k in knobs]
    return data
