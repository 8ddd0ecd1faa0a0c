"""Why the envelope is this big, in the model's terms: what each component of M_max is made of and
which bound drives it, and the live tensors behind each phase's peak, by module.

Everything here comes from the plan alone (``dctms explain`` and the inspector's Overview). What a
knob would change needs real compiles: ``knob_effect`` compares a plan with one re-compiled with
one option changed (``dctms explain`` makes those compiles).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dctms.figures.memory import live_at, memory_curve, peak
from dctms.figures.overview import kv_storage
from dctms.figures.units import human
from dctms.schema.modules import op_modules, path_layer
from dctms.schema.sizes import align_up
from dctms.schema.types import Phase, Plan, Scratch

_PARAMETER_PARTS = ("weight", "scales", "biases", "bias")


@dataclass(frozen=True)
class Part:
    """One piece of an envelope component: ``bytes`` of ``what`` (``count`` tensors/layers)."""

    component: str  # weights | kv | persistent | intermediate | runtime
    what: str
    bytes: int
    count: int = 1
    detail: str = ""


@dataclass(frozen=True)
class Driver:
    """Which bounds drive a component, in one sentence."""

    component: str
    bytes: int
    bounds: tuple[str, ...]  # names among N, M, chunk, batch, dtype, model
    sentence: str


@dataclass(frozen=True)
class PeakTensor:
    """A tensor live at a phase's peak."""

    id: str
    module: str
    primitive: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int  # aligned, as the arena counts it


@dataclass(frozen=True)
class ModuleShare:
    """The bytes of one module's tensors live at a peak."""

    module: str
    bytes: int
    tensors: int
    shapes: tuple[str, ...]  # "[1,4,7,512,2304] bfloat16 (Matmul)", largest first


@dataclass(frozen=True)
class PhasePeak:
    phase: str
    slot: int
    slots: int
    bytes: int  # live aligned bytes at the peak (the phase's lower bound)
    arena: int
    modules: list[ModuleShare]
    tensors: list[PeakTensor]


@dataclass(frozen=True)
class Explanation:
    total: int
    parts: list[Part]
    drivers: list[Driver]
    peaks: list[PhasePeak]
    intermediate_phase: str  # the phase whose arena (+ slack) is M_intermediate
    findings: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------ weights


def _module_of_weight(name: str) -> str:
    head, _, last = name.rpartition(".")
    return head if head and last in _PARAMETER_PARTS else name


def weight_group(name: str) -> str:
    """A weight's module group: inside a decoder layer the layer becomes ``*`` and the path is cut
    one name below it (``model.layers.3.mlp.down_proj.scales`` -> ``model.layers.*.mlp``);
    elsewhere its module (``model.embed_tokens``)."""
    names = _module_of_weight(name).split(".")
    for i, n in enumerate(names):
        if n.isdigit():
            return ".".join([*names[:i], "*", *names[i + 1 : i + 2]])
    return ".".join(names)


def weight_parts(plan: Plan) -> list[Part]:
    """The weights by module group, largest first."""
    groups: dict[str, list[int]] = {}
    layers: dict[str, set[int]] = {}
    for w in plan.model.weights.tensors:
        g = weight_group(w.name)
        groups.setdefault(g, []).append(w.bytes)
        layer = path_layer(w.name)
        if layer is not None:
            layers.setdefault(g, set()).add(layer)
    parts = []
    for g, sizes in groups.items():
        n = len(layers.get(g, ()))
        detail = f"{len(sizes)} tensor{'s' * (len(sizes) != 1)}" + (f" over {n} layers" if n else "")
        parts.append(Part("weights", g, sum(sizes), n or 1, detail))
    parts.sort(key=lambda p: (-p.bytes, p.what))
    return parts


# ------------------------------------------------------------------------------------ KV cache


def kv_parts(plan: Plan) -> list[Part]:
    """The KV cache by layer, layers holding the same shapes merged into one row."""
    per_layer: dict[int, list] = {}
    for s in plan.state:
        if s.kind == "kv":
            layer = path_layer(s.name)
            per_layer.setdefault(-1 if layer is None else layer, []).append(s)
    rows: list[tuple[list[int], str, int]] = []  # layers, detail, bytes per layer
    for layer in sorted(per_layer):
        tensors = per_layer[layer]
        detail = " + ".join(
            f"{s.name.rpartition('.')[2]} {_shape(s.shape)} {s.dtype}" for s in tensors
        )
        size = sum(s.bytes for s in tensors)
        if rows and rows[-1][1] == detail and rows[-1][2] == size:
            rows[-1][0].append(layer)
        else:
            rows.append(([layer], detail, size))
    return [
        Part("kv", _layers_label(layers), size * len(layers), len(layers), f"each {detail}")
        for layers, detail, size in rows
    ]


def _layers_label(layers: list[int]) -> str:
    if layers == [-1]:
        return "cache"
    if len(layers) == 1:
        return f"layer {layers[0]}"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}-{layers[-1]}"
    return "layers " + ",".join(map(str, layers))


def _shape(shape) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


# ------------------------------------------------------------------------------------ peaks


def phase_peak(plan: Plan, phase: Phase, top: int = 12) -> PhasePeak:
    """The live tensors at ``phase``'s peak slot, by module (largest first)."""
    align = plan.target.alignment
    slot, live_bytes = peak(memory_curve(phase, align))
    by_op = op_modules(plan, phase)
    made_by: dict[str, int] = {}
    for k, op in enumerate(phase.ops):
        for t in op.outputs:
            made_by.setdefault(t, k)
    tensors = []
    for t in live_at(phase, slot, align):
        k = t.op if isinstance(t, Scratch) else made_by.get(t.id)
        op = phase.ops[k] if k is not None and k < len(phase.ops) else None
        module = (by_op[k] if k is not None and k < len(by_op) else None) or "(unknown)"
        primitive = (op.primitive if op else "?") + (" scratch" if isinstance(t, Scratch) else "")
        tensors.append(
            PeakTensor(t.id, module, primitive, tuple(t.shape), t.dtype, align_up(t.bytes, align))
        )
    shares: dict[str, list[PeakTensor]] = {}
    for t in tensors:
        shares.setdefault(t.module, []).append(t)
    modules = [
        ModuleShare(
            m,
            sum(t.bytes for t in ts),
            len(ts),
            tuple(f"{_shape(t.shape)} {t.dtype} ({t.primitive})" for t in ts[:4]),
        )
        for m, ts in shares.items()
    ]
    modules.sort(key=lambda s: (-s.bytes, s.module))
    return PhasePeak(
        phase.name, slot, len(phase.slots), live_bytes, phase.arena_bytes, modules, tensors[:top]
    )


# ------------------------------------------------------------------------------------ drivers


def drivers(plan: Plan, intermediate_phase: str) -> list[Driver]:
    b, e = plan.bounds, plan.envelope
    q = plan.model.quantization
    stored = f"{q.bits}-bit {q.mode}, groups of {q.group_size}" if q else b.dtype
    padded = -(-b.input_tokens // b.prefill_chunk) * b.prefill_chunk
    positions = (
        f"N + M + 1 = {b.input_tokens} + {b.output_tokens} + 1"
        if b.input_tokens + b.output_tokens >= padded
        else f"the padded prompt {padded} + 1"
    )
    inter = next((p for p in plan.phases if p.name == intermediate_phase), None)
    if intermediate_phase == "prefill":
        inter_bounds: tuple[str, ...] = ("chunk", "N", "batch", "dtype")
        how = (
            f"a {b.prefill_chunk}-token chunk attending to up to {min(padded, b.kv_capacity - 1)} "
            "positions"
        )
    else:
        inter_bounds = ("N", "M", "batch", "dtype")
        how = f"one token attending to up to {b.kv_capacity - 1} positions (N + M)"
    arena = inter.arena_bytes if inter else 0
    return [
        Driver(
            "weights",
            e.weights,
            ("model", "dtype"),
            f"the model's {plan.model.weights.count} parameters as stored ({stored}); "
            "no bound changes them",
        ),
        Driver(
            "kv",
            e.kv,
            ("N", "M", "batch", "dtype"),
            f"{plan.model.num_layers} layers x {b.kv_capacity} positions ({positions}) x "
            + (f"batch {b.batch}" if b.batch == 1 else f"{b.batch} slots of {e.kv // b.batch:,} B")
            + f", {kv_storage(plan)}",
        ),
        Driver(
            "persistent",
            e.persistent,
            ("chunk", "batch"),
            "each phase's constants and the input arrays of two calls",
        ),
        Driver(
            "intermediate",
            e.intermediate,
            inter_bounds,
            f"the {intermediate_phase} arena ({human(arena)}) for {how}"
            + (
                f", plus {human(e.intermediate - arena)} allocator slack"
                if e.intermediate > arena
                else ""
            ),
        ),
        Driver("runtime", e.runtime, ("backend",), e.runtime_source or "backend allowance"),
    ]


# ------------------------------------------------------------------------------------ the whole


def explain(plan: Plan, phase: str | None = None) -> Explanation:
    """Parts, drivers and peaks of ``plan`` (only ``phase``'s peak when named)."""
    e = plan.envelope
    inter = max(plan.phases, key=lambda p: (p.arena_bytes + p.slack_bytes, p.name == "prefill"))
    parts = weight_parts(plan) + kv_parts(plan)
    blocks = [s for s in plan.state if s.kind == "persistent"]
    if blocks:
        detail = ", ".join(f"{s.name} {human(s.bytes)}" for s in blocks)
        parts.append(
            Part("persistent", "constants and call inputs", e.persistent, len(blocks), detail)
        )
    parts.append(Part("intermediate", f"{inter.name} arena", inter.arena_bytes))
    if inter.slack_bytes:
        parts.append(Part("intermediate", f"{inter.name} allocator slack", inter.slack_bytes))
    parts.append(Part("runtime", "allowance", e.runtime, detail=e.runtime_source))
    chosen = [p for p in plan.phases if phase is None or p.name == phase]
    peaks = [phase_peak(plan, p) for p in chosen]
    ex = Explanation(e.total, parts, drivers(plan, inter.name), peaks, inter.name)
    return Explanation(**{**ex.__dict__, "findings": findings(plan, ex)})


def subtree_bytes(modules: list[ModuleShare]) -> dict[str, int]:
    """Bytes under every module path and each of its ancestors (``model.layers.3`` holds its
    ``self_attn``'s and ``mlp``'s); the empty path is the whole."""
    total: dict[str, int] = {}
    for share in modules:
        names = share.module.split(".")
        for depth in range(len(names) + 1):
            key = ".".join(names[:depth])
            total[key] = total.get(key, 0) + share.bytes
    return total


def where_it_lives(pk: PhasePeak) -> tuple[str, int, list[tuple[str, int]]]:
    """(module path, its bytes, its largest parts) where most of the peak lives: from the whole
    down, into the one child holding more than half of the peak while there is one. Its parts are
    its children (and its own tensors, as the path itself), largest first."""
    under = subtree_bytes(pk.modules)
    path = ""
    while True:
        prefix = f"{path}." if path else ""
        children = {
            k: b
            for k, b in under.items()
            if k and k.startswith(prefix) and "." not in k[len(prefix) :]
        }
        own = sum(m.bytes for m in pk.modules if m.module == path) if path else 0
        parts = sorted(
            [(k[len(prefix) :], b) for k, b in children.items()] + ([(path, own)] if own else []),
            key=lambda kv: (-kv[1], kv[0]),
        )
        big = [(k, b) for k, b in children.items() if 2 * b > pk.bytes]
        if not big:
            return path, under.get(path, 0), parts
        path = big[0][0]


def peak_sentence(pk: PhasePeak) -> str:
    """``prefill peak 202.63 MiB (slot 1585 of 1651): 86.4 % in model.layers.26 (self_attn 40.5 %,
    mlp 29.1 %, ...); largest module model.layers.26.self_attn: [shapes] (63.00 MiB in 5 tensors)``."""
    if not pk.modules:
        return f"{pk.phase}: no arena tenants"
    path, held, parts = where_it_lives(pk)

    def pct(n: int) -> str:
        return f"{100 * n / pk.bytes:.1f} %" if pk.bytes else "n/a"

    inside = ", ".join(f"{name} {pct(b)}" for name, b in parts[:3])
    more = f", +{len(parts) - 3} more" if len(parts) > 3 else ""
    where = f"{pct(held)} in {path} ({inside}{more})" if path else f"across {inside}{more}"
    top = pk.modules[0]
    share = f"{human(top.bytes)} in {top.tensors} tensor{'s' * (top.tensors != 1)}"
    return (
        f"{pk.phase} peak {human(pk.bytes)} (slot {pk.slot} of {pk.slots}): {where}; largest "
        f"module {top.module}: {'; '.join(top.shapes[:3])} ({share})"
    )


def findings(plan: Plan, ex: Explanation) -> list[str]:
    """The top findings, as sentences (the inspector's Overview shows these)."""
    e = plan.envelope
    comps = sorted(
        (
            (name, getattr(e, name))
            for name in ("weights", "kv", "persistent", "intermediate", "runtime")
        ),
        key=lambda kv: -kv[1],
    )
    lead = comps[0]
    out = [
        f"M_max {human(e.total)}: {lead[0]} {human(lead[1])} ({100 * lead[1] / e.total:.1f} %) "
        f"is the largest part"
        if e.total
        else "M_max is 0"
    ]
    weights = [p for p in ex.parts if p.component == "weights"]
    if weights:
        w = weights[0]
        out.append(f"largest weights: {w.what} {human(w.bytes)} ({w.detail})")
    for d in ex.drivers:
        if d.component in ("kv", "intermediate"):
            out.append(f"{d.component} {human(d.bytes)}: {d.sentence}")
    out += [peak_sentence(pk) for pk in ex.peaks]
    return out


# ------------------------------------------------------------------------------------ knobs


@dataclass(frozen=True)
class KnobEffect:
    """What one changed compile option does to the envelope, from two real compiles."""

    knob: str  # chunk | N | M | batch
    old: int
    new: int
    changes: dict[str, int]  # envelope component (and "total") -> new - old bytes

    def sentence(self) -> str:
        # the largest change first
        moved = sorted(
            ((k, v) for k, v in self.changes.items() if v and k != "total"),
            key=lambda kv: -abs(kv[1]),
        )
        if not moved:
            return f"{self.knob} {self.old} -> {self.new}: no change to M_max"
        words = ", ".join(
            f"{'lowers' if v < 0 else 'raises'} M_{k} by {human(abs(v))}" for k, v in moved
        )
        total = self.changes.get("total", 0)
        sign = "-" if total < 0 else "+"
        return f"{self.knob} {self.old} -> {self.new} {words} (M_max {sign}{human(abs(total))})"


def knob_effect(knob: str, old: int, new: int, base: Plan, changed: Plan) -> KnobEffect:
    components = ("weights", "kv", "persistent", "intermediate", "runtime", "total")
    return KnobEffect(
        knob,
        old,
        new,
        {c: getattr(changed.envelope, c) - getattr(base.envelope, c) for c in components},
    )
