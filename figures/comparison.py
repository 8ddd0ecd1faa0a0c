"""What changed between two plans, computed once: ``dctms diff`` and the inspector's Diff draw it.

Every row has a ``key`` (the stable machine name ``dctms diff --format json`` uses) and a ``name``
(the label a person reads). Numeric figures are ``Delta`` rows, other fields ``Change`` rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dctms.figures.cache_layout import cache_summary
from dctms.figures.lengths import grid_brief
from dctms.figures.overview import COMPONENTS, kv_storage
from dctms.figures.roofline import plan_roofline
from dctms.figures.units import MIB
from dctms.schema.types import Phase, Plan

# Labels that differ from the key.
ENVELOPE_LABELS = {"total": "total = M_max"}
ENVELOPE_FIELDS = (*COMPONENTS, "total")


@dataclass(frozen=True)
class Delta:
    """A numeric figure in both plans; ``None`` where a plan does not have it (e.g. no device)."""

    key: str
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
class PhaseDelta(Delta):
    """A per-phase figure; phases are matched by name."""

    phase: str = ""
    figure: str = ""  # "arena", "lower bound", "ops", "tensors", "slots"


@dataclass(frozen=True)
class Change:
    """A field compared as a whole (text, hashes, settings); ``old``/``new`` are the plan's values."""

    key: str
    name: str
    old: Any
    new: Any

    @property
    def changed(self) -> bool:
        return self.old != self.new

    @property
    def old_text(self) -> str:
        return value_text(self.old)

    @property
    def new_text(self) -> str:
        return value_text(self.new)


def value_text(value: Any) -> str:
    """A field value for people: counts with separators, a files map as ``name sha[:12]`` pairs."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, dict):
        return ", ".join(f"{name} {sha[:12]}" for name, sha in sorted(value.items()))
    return str(value)


@dataclass(frozen=True)
class PlanDiff:
    envelope: list[Delta]
    table1: list[Delta]
    phases: list[PhaseDelta]
    bounds: list[Change]
    fingerprint: list[Change]
    roofline: list[Delta]  # predicted speed, each plan on its prediction profile

    @property
    def changed(self) -> int:
        """How many figures differ (0: the plans agree on everything shown)."""
        rows = [*self.envelope, *self.bounds, *self.fingerprint, *self.table1, *self.phases]
        rows += self.roofline
        return sum(1 for r in rows if r.changed)


def envelope_deltas(old: Plan, new: Plan) -> list[Delta]:
    """The components and M_max; the device budget and what is left when either plan has one."""
    a, b = old.envelope, new.envelope
    names = list(ENVELOPE_FIELDS)
    names += [
        f for f in ("device", "free") if getattr(a, f) is not None or getattr(b, f) is not None
    ]
    rows = [Delta(f, ENVELOPE_LABELS.get(f, f), getattr(a, f), getattr(b, f)) for f in names]
    if a.parts or b.parts:
        rows += part_deltas(old, new)
    return rows


PART_FIELDS = ("weights", "kv", "persistent", "intermediate")


def part_deltas(old: Plan, new: Plan) -> list[Delta]:
    """Each model's share (speculative plans: ``Envelope.parts``); a plan of one model is all
    target, and has no draft."""

    def share(plan: Plan, model: str):
        if not plan.envelope.parts:
            return plan.envelope if model == "target" else None
        return next((p for p in plan.envelope.parts if p.model == model), None)

    rows = []
    for model in ("target", "draft"):
        a, b = share(old, model), share(new, model)
        for f in PART_FIELDS:
            rows.append(
                Delta(
                    f"{model}.{f}",
                    f"{model} {f}",
                    None if a is None else getattr(a, f),
                    None if b is None else getattr(b, f),
                )
            )
    return rows


def table1_deltas(old: Plan, new: Plan) -> list[Delta]:
    a, b = old.stats, new.stats
    return [
        Delta(f, f.replace("_", " "), getattr(a, f), getattr(b, f))
        for f in (
            "logical_tensors",
            "physical_buffers",
            "reduction",
            "arena_bytes",
            "lower_bound_bytes",
        )
    ]


_PHASE_FIGURES: tuple[tuple[str, Callable[[Phase], int]], ...] = (
    ("arena", lambda p: p.arena_bytes),
    ("lower bound", lambda p: p.lower_bound_bytes),
    ("ops", lambda p: len(p.ops)),
    ("tensors", lambda p: len(p.tensors)),
    ("slots", lambda p: len(p.slots)),
)


def phase_deltas(old: Plan, new: Plan) -> list[PhaseDelta]:
    """Per phase (matched by name, the old plan's order first): arena, lower bound, ops, tensors,
    slots."""
    before, after = _phases_by_name(old), _phases_by_name(new)
    rows = []
    for name in list(before) + [n for n in after if n not in before]:
        a, b = before.get(name), after.get(name)
        for figure, get in _PHASE_FIGURES:
            rows.append(
                PhaseDelta(
                    f"{figure.replace(' ', '_')} {name}",
                    f"{name} {figure}",
                    None if a is None else get(a),
                    None if b is None else get(b),
                    phase=name,
                    figure=figure,
                )
            )
    return rows


def _phases_by_name(plan: Plan) -> dict[str, Phase]:
    """The plan's phases by name, a draft model's after them as "draft NAME"."""
    phases = {p.name: p for p in plan.phases}
    if plan.draft is not None:
        phases.update({f"draft {p.name}": p for p in plan.draft.phases})
    return phases


def _bounds(plan: Plan, vision: bool = False) -> list[tuple[str, str, Any]]:
    """``vision``: with the image bounds and streams rows (when either plan has them)."""
    b, t, g = plan.bounds, plan.target, plan.generator
    return [
        ("input_tokens", "input tokens (N)", b.input_tokens),
        ("output_tokens", "output tokens (M)", b.output_tokens),
        ("batch", "batch", b.batch),
        ("prefill_chunk", "prefill chunk", b.prefill_chunk),
        ("dtype", "dtype", b.dtype),
        ("kv", "KV storage", kv_storage(plan)),
        ("kv_capacity", "KV capacity", b.kv_capacity),
        ("cache_layers", "cache layers", cache_summary(plan)),
        ("backend", "backend", t.backend),
        ("alignment", "alignment", t.alignment),
        ("profile", "roofline profile", t.profile.name),
        ("run_ahead_dispatches", "run-ahead dispatches", t.run_ahead_dispatches),
        *_grids(plan),
        ("generator", "generator", f"dctms {g.dctms}, mlx {g.mlx}, mlx-lm {g.mlx_lm}"),
        ("num_draft", "draft tokens (K)", plan.draft.num_draft if plan.draft else None),
        *(_vision(plan) if vision else []),
    ]


def _vision(plan: Plan) -> list[tuple[str, str, Any]]:
    """A vision-language plan's image bounds and streams (None in a text plan)."""
    v = plan.vision
    streams = None
    if v is not None:
        streams = "; ".join(
            f"{s.name} (MLX {s.mlx_stream}): {len(s.phases)} phases" for s in v.streams
        )
    return [
        ("images", "images per call (K)", v.images if v else None),
        ("image_size", "image bound", f"{v.image_size[0]}x{v.image_size[1]}" if v else None),
        ("vision_overlap", "vision overlaps prefill", v.overlap if v else None),
        ("streams", "streams", streams),
    ]


def _grids(plan: Plan) -> list[tuple[str, str, Any]]:
    """The length grid of prefill and decode (``figures.lengths``)."""
    phases = {p.name: p for p in plan.phases}
    return [
        (f"length_grid_{name}", f"{name} length grid", grid_brief(phases.get(name)))
        for name in ("prefill", "decode")
    ]


def _fingerprint(plan: Plan) -> list[tuple[str, str, Any]]:
    m, w, q = plan.model, plan.model.weights, plan.model.quantization
    files = w.files_sha256
    d = plan.draft.model if plan.draft else None
    draft = [
        ("draft_architecture", "draft architecture", d.architecture if d else None),
        ("draft_config_sha256", "draft config sha256", d.config_sha256 if d else None),
        ("draft_num_layers", "draft layers", d.num_layers if d else None),
        ("draft_weights_total_bytes", "draft weights bytes", d.weights.total_bytes if d else None),
    ]
    return [
        ("architecture", "model architecture", m.architecture),
        ("config_sha256", "config sha256", m.config_sha256),
        ("num_layers", "layers", m.num_layers),
        ("vocab_size", "vocab size", m.vocab_size),
        ("weights_count", "weights count", w.count),
        ("weights_total_bytes", "weights bytes", w.total_bytes),
        ("weights_layout_sha256", "weights layout sha256", w.layout_sha256),
        (
            "weights_files_sha256",
            "weights files",
            None if files is None else dict(sorted(files.items())),
        ),
        (
            "quantization",
            "quantization",
            None if q is None else f"{q.bits}-bit, group {q.group_size}, {q.mode}",
        ),
        *draft,
    ]


def _changes(a: list[tuple[str, str, Any]], b: list[tuple[str, str, Any]]) -> list[Change]:
    return [Change(key, name, x, y) for (key, name, x), (_, _, y) in zip(a, b, strict=True)]


def roofline_deltas(old: Plan, new: Plan) -> list[Delta]:
    """Predicted decode tok/s and ms per token, and TTFT for a prompt both plans accept (the
    smaller N), each plan on its prediction profile (``figures.roofline.prediction_profile``)."""
    prompt = min(old.bounds.input_tokens, new.bounds.input_tokens)
    a, b = plan_roofline(old, prompt_tokens=prompt), plan_roofline(new, prompt_tokens=prompt)
    return [
        Delta(
            "decode_tokens_per_s",
            "decode tok/s",
            a.decode_tokens_per_s,
            b.decode_tokens_per_s,
        ),
        Delta("decode_ms_per_token", "decode ms/token", a.decode_s * 1e3, b.decode_s * 1e3),
        Delta("ttft_s", f"TTFT s, {prompt:,}-token prompt", a.ttft_s, b.ttft_s),
    ]


def plan_diff(old: Plan, new: Plan) -> PlanDiff:
    vision = old.vision is not None or new.vision is not None
    return PlanDiff(
        envelope_deltas(old, new),
        table1_deltas(old, new),
        phase_deltas(old, new),
        _changes(_bounds(old, vision), _bounds(new, vision)),
        _changes(_fingerprint(old), _fingerprint(new)),
        roofline_deltas(old, new),
    )
