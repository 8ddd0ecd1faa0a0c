"""Verifier rule ``memory_model``: a GPU target's allocator model is the one its name says.

The figures a plan records for its GPU allocator (``Target.memory_model``) are re-derived from the
model's name, the MLX version its source is from and the target profile (``schema.targets``): the
page, the small-buffer bound, the ops per command buffer, the outstanding-buffer bound and the list
of what the model leaves out; and from them the target's ``allocator_slack`` and
``run_ahead_dispatches``. An edited figure (a smaller budget, a caveat dropped) is refused. The
rules that follow from the model (rounding and reuse in ``slack_bytes`` and ``persistent_state``,
kernel-op widening in ``run_ahead``) are re-derived by those rules.
"""

from __future__ import annotations

from collections.abc import Iterator

from dctms.schema.phase_index import PlanIndex
from dctms.schema.targets import (
    GPU_TARGETS,
    SUPPORTED_MLX,
    allocator_slack,
    derive,
    run_ahead_budget,
)

Finding = tuple[str, str]


def memory_model(ix: PlanIndex) -> Iterator[Finding]:
    target = ix.plan.target
    model = target.memory_model
    request = ix.plan.compile
    asked = request.target if request is not None and request.target is not None else None
    name = asked.split("-", 1)[0] if asked is not None else None
    if model is None:
        if name in GPU_TARGETS:
            yield "$.target.memory_model", f"absent, but compile.target is {asked!r}"
        return
    where = "$.target.memory_model"
    if target.backend != "gpu":
        yield "$.target.backend", f"is {target.backend!r}, but a {model.name} model runs on the gpu"
    if (
        model.name not in GPU_TARGETS
    ):  # msgspec's Literal refuses it at decode; a built plan may not
        yield (
            f"{where}.name",
            f"{model.name!r} is no target memory model ({', '.join(GPU_TARGETS)})",
        )
        return
    if model.mlx not in SUPPORTED_MLX:
        yield (
            f"{where}.mlx",
            f"{model.mlx!r}: no {model.name} model from that MLX's source (known: "
            f"{', '.join(SUPPORTED_MLX)})",
        )
        return
    want = derive(model.name, target.profile.name)
    for field in ("page_bytes", "small_bytes", "ops_per_buffer", "active_tasks", "not_modelled"):
        have, need = getattr(model, field), getattr(want, field)
        if have != need:
            yield (
                f"{where}.{field}",
                f"{have!r}, but MLX {model.mlx}'s {model.name} allocator for profile "
                f"{target.profile.name} gives {need!r}",
            )
    budget = run_ahead_budget(want)
    if target.run_ahead_dispatches != budget:
        yield (
            "$.target.run_ahead_dispatches",
            f"{target.run_ahead_dispatches}, but {want.active_tasks} + 1 command buffers of "
            f"{want.ops_per_buffer} + 1 kernel ops give {budget}",
        )
    slack = allocator_slack(want)
    if target.allocator_slack != slack:
        yield (
            "$.target.allocator_slack",
            f"{target.allocator_slack}, but MLX's buffer cache reuses up to 2 pages: {slack}",
        )
    if asked is not None and name != model.name:
        yield "$.compile.target", f"is {asked!r}, but the model is {model.name!r}"
