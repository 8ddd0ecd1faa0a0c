"""Lookup tables over one phase, built once and shared by the verifier's rules.

Every table tolerates a broken phase (duplicate ids, ops missing from the slots, ...): it records the
first occurrence and leaves the complaint to the rule that owns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dctms.schema.types import Binding, Phase, Plan, Scratch, Tensor


@dataclass
class PhaseIndex:
    phase: Phase
    path: str  # "$.phases[i]"
    # An op's index is its position in ``ops``: the valid indices, each mapped to itself (a slot or
    # scratch tensor naming another index names no op).
    op_at_index: dict[int, int] = field(default_factory=dict)
    slot_of: dict[int, int] = field(default_factory=dict)  # op position -> slot
    producer: dict[str, int] = field(default_factory=dict)  # tensor id -> producing op position
    consumers: dict[str, list[int]] = field(default_factory=dict)  # id -> consuming op positions
    tensor_at: dict[str, int] = field(default_factory=dict)  # tensor id -> position in tensors
    views_of: dict[str, list[int]] = field(default_factory=dict)  # view_of id -> view positions
    inputs: dict[str, Binding] = field(default_factory=dict)  # phase input bindings by id
    constants: set[str] = field(default_factory=set)

    @property
    def num_slots(self) -> int:
        return len(self.phase.slots)

    def tensor_path(self, position: int) -> str:
        return f"{self.path}.tensors[{position}]"

    def op_path(self, position: int) -> str:
        return f"{self.path}.ops[{position}]"

    def is_external(self, tensor_id: str) -> bool:
        """Whether the id is defined outside the ops: a phase input binding or a constant."""
        return tensor_id in self.inputs or tensor_id in self.constants

    def shapes_and_dtypes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every id the phase defines (tensors, input bindings, constants): its shape and dtype."""
        phase = self.phase
        known = {t.id: (tuple(t.shape), t.dtype) for t in phase.tensors}
        known.update({b.id: (tuple(b.shape), b.dtype) for b in phase.inputs})
        known.update({c.id: (tuple(c.shape), c.dtype) for c in phase.constants})
        return known

    def output_ids(self, kind: str) -> set[str]:
        return {b.id for b in self.phase.outputs if b.kind == kind}


def valid_interval(tensor: Tensor, num_slots: int) -> bool:
    """Whether ``tensor.interval`` is a well-formed ``[s, e]`` inside the schedule."""
    iv = tensor.interval
    return len(iv) == 2 and 0 <= iv[0] <= iv[1] < num_slots


def scratch_owner(tensor: Tensor, op_at_index: dict[int, int]) -> int | None:
    """Position of the op owning a scratch tensor (None for other tensors or an unknown op)."""
    if not isinstance(tensor, Scratch):
        return None
    return op_at_index.get(tensor.op)


def build_index(phase: Phase, path: str) -> PhaseIndex:
    index = PhaseIndex(phase=phase, path=path)
    for position, op in enumerate(phase.ops):
        index.op_at_index[position] = position
        for tensor_id in op.outputs:
            index.producer.setdefault(tensor_id, position)
        for tensor_id in op.inputs:
            index.consumers.setdefault(tensor_id, []).append(position)
    for slot, members in enumerate(phase.slots):
        for op_index in members:
            position = index.op_at_index.get(op_index)
            if position is not None:
                index.slot_of.setdefault(position, slot)
    for position, tensor in enumerate(phase.tensors):
        index.tensor_at.setdefault(tensor.id, position)
        if tensor.view_of is not None:
            index.views_of.setdefault(tensor.view_of, []).append(position)
    for tensor in phase.tensors:
        op_position = scratch_owner(tensor, index.op_at_index)
        if op_position is not None:
            index.producer.setdefault(tensor.id, op_position)
    for binding in phase.inputs:
        index.inputs.setdefault(binding.id, binding)
    index.constants = {c.id for c in phase.constants}
    return index


@dataclass
class PlanIndex:
    """The plan and one ``PhaseIndex`` per phase: what every verifier rule receives."""

    plan: Plan
    phases: list[PhaseIndex]


def build_plan_index(plan: Plan) -> PlanIndex:
    return PlanIndex(plan, [build_index(p, f"$.phases[{i}]") for i, p in enumerate(plan.phases)])
