"""The semantic verifier: ``verify_plan(plan)`` checks what the schema cannot.

It is a pure function of the plan, independent of the planner that produced it, so a planner bug
cannot hide behind the planner's own assumptions. Each check is a rule with a stable name (the
``RULES`` keys); every ``Problem`` it returns carries that name. Conventions it enforces:

- schedule time is in slots; ``Tensor.interval = [s, e]`` is inclusive, so two tensors are live
  together when ``s_a <= e_b and s_b <= e_a``; bytes ``[offset, offset + bytes)`` are half-open;
- a tensor lives at least until its last read (readers, and the ends of its views) and no longer
  than the first sync point at or after it (the compiler widens lifetimes for MLX's run-ahead; a
  sync point drains everything);
- arena tenants are tensors that are neither views nor of kind "state" (``sizes.is_arena_tenant``),
  scratch tensors included;
- ``view_of`` always names the root that owns the bytes (a non-view tensor, an input binding or a
  constant), never another view; a view has no buffer and no offset, and extends its root's interval;
  a tensor of kind "state" owns no arena bytes (by convention it is a view of the state input
  binding it updates);
- a scratch tensor is the temporary of the op its ``op`` field names: uint8 of shape
  ``[ops[op].scratch]``;
- a phase output (kind "output") lives until the phase's last slot and is evaluated at a sync point;
  what a sync point evaluates was made since the previous one.

At most ``MAX_PER_RULE`` problems are listed per rule, so a badly broken plan (every pair of tensors
overlapping) still gives a short report quickly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from dctms.schema import (
    rules_derived,
    rules_distributed,
    rules_donation,
    rules_draft,
    rules_fused,
    rules_gpu_matmul,
    rules_graph,
    rules_index,
    rules_lengths,
    rules_memory,
    rules_modules,
    rules_request,
    rules_runner,
    rules_sampling,
    rules_target,
    rules_totals,
    rules_vision,
)
from dctms.schema.draft import DRAFT, draft_view, part
from dctms.schema.errors import Problem
from dctms.schema.phase_index import PlanIndex, build_plan_index
from dctms.schema.types import Plan

MAX_PER_RULE = 50

# Rules ``read_plan`` leaves to ``dctms validate`` and the runner's ``load_checked_plan``: proving
# every index in bounds evaluates each phase at every length point (about 1.7 s of a 7B plan's
# 2 s read), and only running a plan needs it; showing, diffing or pooling one does not.
RUN_ONLY = frozenset({"index_safety"})

Rule = Callable[[PlanIndex], Iterable[tuple[str, str]]]

RULES: dict[str, Rule] = {
    "unique_ids": rules_graph.unique_ids,
    "op_inputs_defined": rules_graph.op_inputs_defined,
    "outputs_defined": rules_graph.outputs_defined,
    "slots_cover": rules_graph.slots_cover,
    "slot_bandwidth": rules_graph.slot_bandwidth,
    "sync_points": rules_graph.sync_points,
    "dtype_known": rules_memory.dtype_known,
    "tensor_bytes": rules_memory.tensor_bytes,
    "constant_size": rules_memory.constant_size,
    "constant_values": rules_memory.constant_values,
    "interval_bounds": rules_memory.interval_bounds,
    "interval_producer": rules_memory.interval_producer,
    "interval_last_use": rules_memory.interval_last_use,
    "view_root": rules_memory.view_root,
    "donation": rules_donation.donation,
    "state_in_place": rules_donation.state_in_place,
    "scratch": rules_memory.scratch,
    "arena_overlap": rules_memory.arena_overlap,
    "buffer_overlap": rules_memory.buffer_overlap,
    "buffer_holds_tenants": rules_memory.buffer_holds_tenants,
    "buffer_sized": rules_memory.buffer_sized,
    "arena_bounds": rules_memory.arena_bounds,
    "arena_claim": rules_memory.arena_claim,
    "bounds": rules_totals.bounds,
    "state_kind": rules_totals.state_kind,
    "weights_fingerprint": rules_totals.weights_fingerprint,
    "bindings": rules_totals.bindings,
    "fused_weights": rules_totals.fused_weights,
    "envelope_sum": rules_totals.envelope_sum,
    "stats": rules_totals.stats,
    "runner_names": rules_runner.runner_names,
    "quantized_start": rules_runner.quantized_start,
    "prefix_pool": rules_runner.prefix_pool,
    "sampling": rules_sampling.sampling,
    "vocabulary": rules_runner.vocabulary,
    "state_capacity": rules_runner.state_capacity,
    "op_arguments": rules_runner.op_arguments,
    "persistent_state": rules_derived.persistent_state,
    "runtime_floor": rules_derived.runtime_floor,
    "dynamic_scratch": rules_derived.dynamic_scratch,
    "fused_kernels": rules_fused.fused_kernels,
    "run_ahead": rules_derived.run_ahead,
    "memory_model": rules_target.memory_model,
    "gpu_matmul": rules_gpu_matmul.gpu_matmul,
    "lengths": rules_lengths.lengths,
    "index_safety": rules_index.index_safety,
    "compile_request": rules_request.compile_request,
    "speculative": rules_draft.speculative,
    "vision": rules_vision.vision_plan,
    "distributed": rules_distributed.distributed,
    "module_tree": rules_modules.module_tree,
    "module_runs": rules_modules.module_runs,
    "module_layer": rules_modules.module_layer,
}


def verify_plan(plan: Plan, *, for_run: bool = True) -> list[Problem]:
    """Every semantic problem of ``plan`` (empty when the plan is valid), in rule order; with
    ``for_run=False``, those of every rule but the ``RUN_ONLY`` ones."""
    index = build_plan_index(plan)
    problems: list[Problem] = []
    for name, rule in RULES.items():
        if not for_run and name in RUN_ONLY:
            continue
        for count, (path, message) in enumerate(rule(index)):
            if count == MAX_PER_RULE:
                problems.append(Problem("$", f"further {name} problems not listed", name))
                break
            problems.append(Problem(path, message, name))
    if plan.draft is not None:
        problems += _draft_problems(plan, for_run)
    return problems


# Where the draft view's parts are in the speculative plan.
_DRAFT_PATHS = {
    "$.phases": "$.draft.phases",
    "$.state": "$.draft.state",
    "$.model": "$.draft.model",
    "$.stats": "$.draft.stats",
    "$.modules": "$.draft.modules",
}


def _draft_problems(plan: Plan, for_run: bool) -> list[Problem]:
    """Every rule on the draft as a plan of its own (``draft.draft_view``), paths moved under
    ``$.draft`` (its envelope is the draft's envelope part)."""
    view = draft_view(plan)
    where = f"$.envelope.parts[{[p.model for p in plan.envelope.parts].index(DRAFT)}]" if part(
        plan, DRAFT
    ) else "$.envelope.parts"
    moved = []
    for p in verify_plan(view, for_run=for_run):
        path = "$.draft" if p.path == "$" else p.path
        for old, new in (*_DRAFT_PATHS.items(), ("$.envelope", where)):
            if path == old or path.startswith((old + ".", old + "[")):
                path = new + path[len(old) :]
                break
        moved.append(Problem(path, f"draft: {p.message}", p.rule))
    return moved
