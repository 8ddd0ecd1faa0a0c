"""The inspector's view models over one plan, without Textual (unit-testable on their own).

Lookups by tensor and op, lifetime rows, buffer reuse, arena placements, schedule and op rows. The
figures the CLI shows too (overview, memory curve, diff) come from ``dctms.figures``; conventions are
the schema's (inclusive slot ranges, arena tenants and alignment from ``dctms.schema.sizes``).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from dctms.figures.memory import live_at, memory_curve, peak
from dctms.figures.units import human
from dctms.schema.modules import op_modules, path_layer
from dctms.schema.numbered import NumberedOp, numbered_ops
from dctms.schema.sizes import align_up, is_arena_tenant
from dctms.schema.types import Phase, Plan, Scratch, Tensor


def fmt_shape(shape: list[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


# -------------------------------------------------------------------------------------- phase index


class PhaseLookup:
    """Lookups over one phase, built once (linear time) and shared by every screen."""

    def __init__(self, phase: Phase, alignment: int, modules: list[str | None] | None = None):
        self.phase = phase
        # The module path that created each op (schema.modules.op_modules); None: not recorded.
        self.modules: list[str | None] = list(modules or [None] * len(phase.ops))
        self.alignment = alignment
        self.num_slots = len(phase.slots)
        self.tensor: dict[str, Tensor] = {t.id: t for t in phase.tensors}
        self.ops = numbered_ops(phase)
        self.op: dict[int, NumberedOp] = {op.index: op for op in self.ops}
        self.slot_of_op: dict[int, int] = {i: s for s, ops in enumerate(phase.slots) for i in ops}
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = defaultdict(list)
        for op in self.ops:
            for out in op.outputs:
                self.producer[out] = op.index
            for name in dict.fromkeys(op.inputs):  # an op reading x twice consumes it once
                self.consumers[name].append(op.index)
        for t in phase.tensors:
            # A temporary MLX allocates inside an op is no op output; its record names the op.
            if isinstance(t, Scratch) and t.op in self.op:
                self.producer.setdefault(t.id, t.op)
        self.shape: dict[str, tuple[list[int], str]] = {}
        # Input id -> the weight's parameter name or the state it reads ("model.norm.weight").
        self.bound_name: dict[str, str] = {
            b.id: b.name for b in phase.inputs if b.kind in ("weight", "state")
        }
        for binding in (*phase.inputs, *phase.outputs):
            self.shape[binding.id] = (binding.shape, binding.dtype)
        for constant in phase.constants:
            self.shape[constant.id] = (constant.shape, constant.dtype)
        for t in phase.tensors:
            self.shape[t.id] = (t.shape, t.dtype)
        self.tenants: dict[int, list[Tensor]] = defaultdict(list)
        for t in phase.tensors:
            if t.buffer is not None:
                self.tenants[t.buffer].append(t)
        for tenants in self.tenants.values():
            tenants.sort(key=lambda t: (t.interval[0], t.interval[1], t.id))
        self.sync_at: dict[int, str] = {}
        for sp in phase.sync_points:
            self.sync_at[sp.slot] = "; ".join(filter(None, (self.sync_at.get(sp.slot), sp.reason)))
        self._curve: list[int] | None = None

    def producer_op(self, tensor_id: str) -> NumberedOp | None:
        index = self.producer.get(tensor_id)
        return None if index is None else self.op.get(index)

    def consumer_ops(self, tensor_id: str) -> list[NumberedOp]:
        return [self.op[i] for i in self.consumers.get(tensor_id, ())]

    def op_module(self, op_index: int) -> str | None:
        return self.modules[op_index] if 0 <= op_index < len(self.modules) else None

    def op_layer(self, op_index: int) -> int | None:
        return path_layer(self.op_module(op_index))

    def module_of(self, tensor_id: str) -> str | None:
        """The module of the op that makes the tensor (None for graph inputs)."""
        index = self.producer.get(tensor_id)
        return None if index is None else self.op_module(index)

    def layer_of(self, tensor_id: str) -> int | None:
        return path_layer(self.module_of(tensor_id))

    def aligned(self, tensor: Tensor) -> int:
        return align_up(tensor.bytes, self.alignment)

    # ------------------------------------------------------------------------------ memory curve

    @property
    def curve(self) -> list[int]:
        """Aligned live bytes of the arena tenants in each slot (cached)."""
        if self._curve is None:
            self._curve = memory_curve(self.phase, self.alignment)
        return self._curve

    def peak(self) -> tuple[int, int]:
        """(first slot where live bytes are highest, those bytes); (0, 0) for an empty phase."""
        return peak(self.curve)

    def live_at(self, slot: int) -> list[Tensor]:
        """Arena tenants live in ``slot``, largest (aligned) first, then by id."""
        return live_at(self.phase, slot, self.alignment)


# ------------------------------------------------------------------------------------- lifetimes


@dataclass(frozen=True)
class Query:
    """A filter typed into a search box: ``layer:3 prim:matmul mod:q_proj t12`` (every term must
    match; a plain word matches an id, a primitive or a module path)."""

    layer: int | None = None
    primitive: str | None = None
    buffer: int | None = None
    kind: str | None = None
    words: tuple[str, ...] = ()
    module: str | None = None

    @property
    def empty(self) -> bool:
        return self == Query()


_TERM = re.compile(
    r"^(layer|l|prim|primitive|p|buffer|buf|b|kind|k|module|mod|m)[:=](.+)$", re.IGNORECASE
)


def parse_query(text: str) -> Query:
    """Parse a filter; a malformed number (``layer:x``) is taken as a plain word, never an error."""
    layer = buffer = None
    primitive = kind = module = None
    words: list[str] = []
    for term in text.split():
        match = _TERM.match(term)
        key, value = (match[1].lower(), match[2]) if match else ("", term)
        if key in ("layer", "l") and value.isdigit():
            layer = int(value)
        elif key in ("buffer", "buf", "b") and value.isdigit():
            buffer = int(value)
        elif key in ("prim", "primitive", "p"):
            primitive = value.lower()
        elif key in ("kind", "k"):
            kind = value.lower()
        elif key in ("module", "mod", "m"):
            module = value.lower()
        else:
            words.append(term.lower())
    return Query(layer, primitive, buffer, kind, tuple(words), module)


def tensor_matches(index: PhaseLookup, tensor: Tensor, query: Query) -> bool:
    if query.empty:
        return True
    op = index.producer_op(tensor.id)
    primitive = op.primitive.lower() if op is not None else ""
    module = (index.module_of(tensor.id) or "").lower()
    if query.layer is not None and index.layer_of(tensor.id) != query.layer:
        return False
    if query.module is not None and query.module not in module:
        return False
    if query.primitive is not None and query.primitive not in primitive:
        return False
    if query.buffer is not None and tensor.buffer != query.buffer:
        return False
    if query.kind is not None and not tensor.kind.startswith(query.kind):
        return False
    tensor_id = tensor.id.lower()
    return all(w in tensor_id or w in primitive or w in module for w in query.words)


@dataclass(frozen=True)
class Bar:
    """One tenant's lifetime in a chart row: slots ``start..end`` inclusive."""

    start: int
    end: int
    tensor: str
    buffer: int | None  # colour key; None for views and state (no bytes of their own)
    shade: int = 0  # alternates between neighbours sharing a row, so their boundary shows


@dataclass(frozen=True)
class Row:
    key: str  # tensor id, or "buffer N"
    label: str
    bars: tuple[Bar, ...]
    buffer: int | None = None


def short_module(path: str | None) -> str:
    """A module path as a row label has room for: the layer and the last names
    (``model.layers.3.self_attn.q_proj`` -> ``3.self_attn.q_proj``)."""
    if not path:
        return ""
    names = path.split(".")
    cut = next((i for i, n in enumerate(names) if n.isdigit()), max(0, len(names) - 1))
    return ".".join(names[cut:])


MODULE_ROW = "module "  # key prefix of a grouped chart's heading row (tensor ids have no space)


def tensor_rows(index: PhaseLookup, query: Query = Query(), by_module: bool = False) -> list[Row]:
    """One row per tensor matching ``query``, in order of first slot (then plan order); with
    ``by_module``, grouped by the module that made it (module paths in order of first use), each
    group after a heading row whose key is ``MODULE_ROW`` + the module path."""
    rows = []
    ordered = sorted(enumerate(index.phase.tensors), key=lambda p: (p[1].interval[0], p[0]))
    if by_module:
        first: dict[str, int] = {}
        for k, (_, t) in enumerate(ordered):
            first.setdefault(index.module_of(t.id) or "", k)
        ordered.sort(
            key=lambda p: first[index.module_of(p[1].id) or ""]
        )  # stable: slot order within
    heading: str | None = None
    for _, t in ordered:
        if not tensor_matches(index, t, query):
            continue
        op = index.producer_op(t.id)
        what = op.primitive if op is not None else t.kind
        path = index.module_of(t.id) or ""
        if by_module and path != heading:  # a heading row (no bars) opens each module's group
            heading = path
            rows.append(Row(f"{MODULE_ROW}{path}", f"▸ {path or '(no module recorded)'}", ()))
        label = f"{t.id:<6.6} {what:<14.14} {short_module(path)}"
        bar = Bar(t.interval[0], t.interval[1], t.id, t.buffer)
        rows.append(Row(t.id, label, (bar,), t.buffer))
    return rows


def buffer_rows(index: PhaseLookup, query: Query = Query()) -> list[Row]:
    """One row per physical buffer: its tenants (those matching ``query``) over time."""
    rows = []
    for buffer in sorted(index.phase.buffers, key=lambda b: b.id):
        tenants = [t for t in index.tenants.get(buffer.id, ()) if tensor_matches(index, t, query)]
        if not tenants and not query.empty:
            continue
        bars = tuple(
            Bar(t.interval[0], t.interval[1], t.id, buffer.id, shade=i % 2)
            for i, t in enumerate(tenants)
        )
        label = f"buf {buffer.id:<3} {human(buffer.bytes, 1):>9} {len(tenants):>3} tenants"
        rows.append(Row(f"buffer {buffer.id}", label, bars, buffer.id))
    return rows


@dataclass(frozen=True)
class TensorDetails:
    tensor: Tensor
    producer: NumberedOp | None
    consumers: list[NumberedOp]
    layer: int | None
    slot_of_producer: int | None


def tensor_details(index: PhaseLookup, tensor_id: str) -> TensorDetails | None:
    tensor = index.tensor.get(tensor_id)
    if tensor is None:
        return None
    producer = index.producer_op(tensor_id)
    slot = index.slot_of_op.get(producer.index) if producer is not None else None
    return TensorDetails(
        tensor, producer, index.consumer_ops(tensor_id), index.layer_of(tensor_id), slot
    )


# --------------------------------------------------------------------------------------- buffers


@dataclass(frozen=True)
class BufferSummary:
    id: int
    bytes: int
    tenants: int
    first_slot: int | None
    last_slot: int | None
    busy_slots: int  # slots in which some tenant is live
    largest_tenant: int


def buffer_summaries(index: PhaseLookup) -> list[BufferSummary]:
    rows = []
    for buffer in sorted(index.phase.buffers, key=lambda b: b.id):
        tenants = index.tenants.get(buffer.id, [])
        busy: set[int] = set()
        for t in tenants:
            busy.update(range(t.interval[0], t.interval[1] + 1))
        rows.append(
            BufferSummary(
                buffer.id,
                buffer.bytes,
                len(tenants),
                min((t.interval[0] for t in tenants), default=None),
                max((t.interval[1] for t in tenants), default=None),
                len(busy),
                max((t.bytes for t in tenants), default=0),
            )
        )
    return rows


@dataclass(frozen=True)
class Placement:
    """A tenant's rectangle in the arena: bytes ``[offset, end)`` during slots ``start..end_slot``."""

    tensor: str
    offset: int
    end: int
    start: int
    end_slot: int
    buffer: int | None


def arena_placements(index: PhaseLookup) -> list[Placement]:
    return [
        Placement(t.id, t.offset, t.offset + t.bytes, t.interval[0], t.interval[1], t.buffer)
        for t in index.phase.tensors
        if is_arena_tenant(t) and t.offset is not None
    ]


def arena_bands(placements: list[Placement], arena_bytes: int, bands: int) -> list[list[Placement]]:
    """The placements overlapping each of ``bands`` equal byte ranges of the arena (top = offset 0)."""
    out: list[list[Placement]] = [[] for _ in range(max(bands, 0))]
    if bands <= 0 or arena_bytes <= 0:
        return out
    for p in placements:
        if p.end <= p.offset:
            continue
        first = min(bands - 1, p.offset * bands // arena_bytes)
        last = min(bands - 1, (p.end - 1) * bands // arena_bytes)
        for band in range(first, last + 1):
            out[band].append(p)
    return out


# -------------------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class SlotRow:
    slot: int
    ops: list[NumberedOp]
    live_bytes: int
    sync: str  # reason of the sync point after this slot, "" when none

    @property
    def memory_bound(self) -> int:
        return sum(1 for op in self.ops if op.memory_bound)


def slot_rows(index: PhaseLookup) -> list[SlotRow]:
    curve = index.curve
    return [
        SlotRow(s, [index.op[i] for i in ops if i in index.op], curve[s], index.sync_at.get(s, ""))
        for s, ops in enumerate(index.phase.slots)
    ]


# ------------------------------------------------------------------------------------------- ops


def describe_value(index: PhaseLookup, name: str) -> str:
    """``id[1,512,448] bfloat16`` for an op input/output; the bare id when its shape is unknown."""
    known = index.shape.get(name)
    if known is None:
        return name
    shape, dtype = known
    return f"{name}{fmt_shape(shape)} {dtype}"


def op_matches(op: NumberedOp, query: Query, module: str | None = None) -> bool:
    """Whether ``op`` (made in ``module``) passes the filter."""
    if query.empty:
        return True
    if query.layer is not None and path_layer(module) != query.layer:
        return False
    primitive = op.primitive.lower()
    if query.primitive is not None and query.primitive not in primitive:
        return False
    where = (module or "").lower()
    if query.module is not None and query.module not in where:
        return False
    names = [n.lower() for n in (*op.inputs, *op.outputs)]
    return all(w in primitive or w in where or any(w in n for n in names) for w in query.words)


def op_rows(index: PhaseLookup, query: Query = Query()) -> list[NumberedOp]:
    return [op for op in index.ops if op_matches(op, query, index.op_module(op.index))]


@dataclass
class PlanLookup:
    """Per-phase lookups of one plan, built on first use (a 7B phase takes ~30 ms)."""

    plan: Plan
    _phases: dict[int, PhaseLookup] = field(default_factory=dict)

    def phase(self, number: int) -> PhaseLookup:
        if number not in self._phases:
            phase = self.plan.phases[number]
            modules = op_modules(self.plan, phase)
            self._phases[number] = PhaseLookup(phase, self.plan.target.alignment, modules)
        return self._phases[number]
