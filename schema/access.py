"""Where a phase indexes memory with run-time values: token ids into weights, positions into state.

MLX's ``Gather`` and ``DynamicSliceUpdate`` do not bounds-check: an index past the array is a write
into freed memory (a segmentation fault, a corrupted heap) or silent garbage, never an error. The
runner bounds the values it feeds (token ids below ``model.vocab_size``, write positions inside the
plan's bounds); these helpers find the ops those values reach so that the verifier can check the
plan's shapes hold them and the runner can check the arrays it allocated do.

A value "reaches" an op through shape-only ops (reshapes, which change no element), so
``ExpandDims(tokens) -> Gather`` counts and ``Add(position, 1) -> ...`` does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from dctms.schema.slotted import MOVE_PHASE
from dctms.schema.types import Phase

# Primitives that only rearrange their single input's elements: indices pass through unchanged.
PASS_THROUGH = frozenset({"Reshape", "Flatten", "Unflatten", "ExpandDims", "Squeeze"})


@dataclass(frozen=True)
class TokenGather:
    """``Gather`` of rows of a weight by token ids: ``weight.shape[axis]`` must exceed every id."""

    op_position: int
    weight: str  # the weight's name (Binding.name)
    axis: int


@dataclass(frozen=True)
class PositionWrite:
    """``DynamicSliceUpdate`` of a state array at the position input: writes ``extent`` entries
    along ``axis`` starting at the position -- or, with ``modulus``, at the position modulo it (a
    sliding-window ring, ``StateTensor.window``)."""

    op_position: int
    state: str  # the state's name (Binding.name)
    axis: int
    extent: int
    modulus: int | None = None
    clamp: int | None = None  # at min(position, clamp): a rotating cache's kept tokens
    # a batched plan's prefill (toolkit.slots): also at the slot input along this axis, one row
    slot_axis: int | None = None


@dataclass(frozen=True)
class StrayStateWrite:
    """A ``DynamicSliceUpdate`` of state whose start does not come from the position input."""

    op_position: int
    state: str


def derived_ids(phase: Phase, input_name: str) -> set[str]:
    """Ids holding the values of the input binding named ``input_name``, unchanged (see
    ``PASS_THROUGH``); empty when the phase has no such input."""
    ids = {b.id for b in phase.inputs if b.kind == "input" and b.name == input_name}
    changed = True
    while changed:  # ops are not necessarily in dataflow order in a broken plan
        changed = False
        for op in phase.ops:
            if op.primitive in PASS_THROUGH and len(op.inputs) == 1 and op.inputs[0] in ids:
                for out in op.outputs:
                    if out not in ids:
                        ids.add(out)
                        changed = True
    return ids


def ring_positions(phase: Phase, primitive: str = "Remainder") -> dict[str, int]:
    """Ids holding ``position mod m`` for a constant scalar ``m`` >= 1 (``Remainder`` of the
    position by a one-element constant, then shape-only ops), with their ``m``; with primitive
    "Minimum", ids holding ``min(position, m)``."""
    positions = derived_ids(phase, "position")
    constants = {c.id: c.value for c in phase.constants}
    found: dict[str, int] = {}
    for op in phase.ops:
        if op.primitive != primitive or len(op.inputs) != 2 or op.inputs[0] not in positions:
            continue
        value = constants.get(op.inputs[1])
        if value is not None and len(value) == 1 and type(value[0]) is int and value[0] >= 1:
            found.update((out, value[0]) for out in op.outputs)
    changed = True
    while changed:
        changed = False
        for op in phase.ops:
            if op.primitive in PASS_THROUGH and len(op.inputs) == 1 and op.inputs[0] in found:
                for out in op.outputs:
                    if out not in found:
                        found[out] = found[op.inputs[0]]
                        changed = True
    return found


def _axes(args: list) -> list[int] | None:
    if args and isinstance(args[0], list) and all(type(a) is int for a in args[0]):
        return args[0]
    return None


def token_gathers(phase: Phase) -> list[TokenGather]:
    """Every gather from a weight whose indices are the token ids."""
    tokens = derived_ids(phase, "tokens")
    weights = {b.id: b.name for b in phase.inputs if b.kind == "weight"}
    found = []
    for k, op in enumerate(phase.ops):
        if op.primitive != "Gather" or not op.inputs or op.inputs[0] not in weights:
            continue
        indices = op.inputs[1:]
        axes = _axes(op.args)
        if axes is None or len(axes) != len(indices):
            continue  # malformed: the runner's first run refuses it with MLX's own message
        for axis, index in zip(axes, indices, strict=True):
            if index in tokens:
                found.append(TokenGather(k, weights[op.inputs[0]], axis))
    return found


def state_writes(phase: Phase) -> tuple[list[PositionWrite], list[StrayStateWrite]]:
    """Dynamic writes into state: those at the position input, and any others (a valid plan has
    none)."""
    positions = derived_ids(phase, "position")
    rings = ring_positions(phase)
    clamps = ring_positions(phase, "Minimum")
    state = {b.id: b.name for b in phase.inputs if b.kind == "state"}
    shapes = {t.id: t.shape for t in phase.tensors}
    shapes.update({b.id: b.shape for b in phase.inputs})
    shapes.update({c.id: c.shape for c in phase.constants})
    writes: list[PositionWrite] = []
    stray: list[StrayStateWrite] = []
    slot_starts = _slot_starts(phase, positions)
    blocks = derived_ids(phase, "block")
    slots = derived_ids(phase, "slot")
    for k, op in enumerate(phase.ops):
        if op.primitive != "DynamicSliceUpdate" or not op.inputs or op.inputs[0] not in state:
            continue
        axes = _axes(op.args)
        name = state[op.inputs[0]]
        update = shapes.get(op.inputs[1]) if len(op.inputs) == 3 else None
        start = op.inputs[2] if len(op.inputs) == 3 else None
        known = positions | set(rings) | set(clamps)
        if axes == [0] and start in blocks:
            continue  # a prefix-pool block at the block input: rule index_safety bounds it
        if axes == [0] and start in slots and phase.name == MOVE_PHASE:
            continue  # a slot move's whole row at the slot input: index_safety bounds it too
        if axes is not None and len(axes) == 2 and update is not None and start in slot_starts:
            slot_axis, axis = axes
            if 0 <= axis < len(update) and 0 <= slot_axis < len(update) and update[slot_axis] == 1:
                writes.append(PositionWrite(k, name, axis, update[axis], slot_axis=slot_axis))
            else:
                stray.append(StrayStateWrite(k, name))
            continue
        if axes is None or len(axes) != 1 or update is None or start not in known:
            stray.append(StrayStateWrite(k, name))
            continue
        axis = axes[0]
        if not 0 <= axis < len(update):
            stray.append(StrayStateWrite(k, name))
            continue
        writes.append(
            PositionWrite(k, name, axis, update[axis], rings.get(start), clamps.get(start))
        )
    return writes, stray


def _slot_starts(phase: Phase, positions: set[str]) -> set[str]:
    """Ids holding ``[slot, position]``: a ``Concatenate`` of the slot input and the position
    input, each as one element (a batched plan's prefill writes its sequence's row there)."""
    slots = derived_ids(phase, "slot")
    shapes = {t.id: t.shape for t in phase.tensors}
    shapes.update({b.id: b.shape for b in phase.inputs})
    found = set()
    for op in phase.ops:
        if op.primitive != "Concatenate" or len(op.inputs) != 2:
            continue
        first, second = op.inputs
        if first in slots and second in positions and all(
            shapes.get(i) == [1] or shapes.get(i) == (1,) for i in op.inputs
        ):
            found.update(op.outputs)
    return found
