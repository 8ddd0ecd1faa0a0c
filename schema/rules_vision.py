"""Verifier rule for vision-language plans (``Plan.vision``): what the runner relies on.

The runner allocates the features table at ``feature_rows`` x ``hidden_size``, runs the ``vision``
phase once per image with ``row = k * tokens_per_image`` (k < ``images``) and feeds prefill
``image_rows`` below ``feature_rows``. MLX bounds-checks neither the table's slice update nor the
row gather, so the plan's shapes must hold those indices; and every phase must be on a stream.
"""

from __future__ import annotations

from collections.abc import Iterator

from dctms.schema.phase_index import PlanIndex

Finding = tuple[str, str]

VISION_INPUTS = ("pixel_values", "image_features", "row")
TABLE = "image_features"


def vision_plan(ix: PlanIndex) -> Iterator[Finding]:
    """A vision phase exists exactly in a plan with a ``vision`` section, takes the inputs the
    runner feeds, returns only the features table, writes ``tokens_per_image`` rows per call at
    ``row``; prefill reads a table of the same shape; the streams cover the phases."""
    plan = ix.plan
    v = plan.vision
    phases = {px.phase.name: px for px in ix.phases}
    if v is None:
        for name, px in phases.items():
            if name == "vision" or name.startswith("vision."):
                yield px.path, "a vision phase, but the plan has no vision section"
        return
    if v.feature_rows != v.images * v.tokens_per_image:
        yield "$.vision.feature_rows", (
            f"{v.feature_rows}, but images x tokens_per_image = {v.images * v.tokens_per_image}"
        )
    table = [v.feature_rows, v.hidden_size]
    if not v.variants:
        yield "$.vision.variants", "no image size has a vision phase"
    if v.variants and v.tokens_per_image != max(x.tokens for x in v.variants):
        yield "$.vision.tokens_per_image", (
            f"{v.tokens_per_image}, but the largest variant fills "
            f"{max(x.tokens for x in v.variants)} rows"
        )
    for k, variant in enumerate(v.variants):
        where = f"$.vision.variants[{k}]"
        if variant.height > v.image_size[0] or variant.width > v.image_size[1]:
            yield where, (
                f"{variant.height}x{variant.width} is over the bound "
                f"{v.image_size[0]}x{v.image_size[1]}"
            )
        px = phases.get(variant.phase)
        if px is None:
            yield f"{where}.phase", f"no phase named {variant.phase!r}"
        else:
            yield from _vision_phase(px, variant, table)
    known = {x.phase for x in v.variants} | {"prefill", "decode"}
    for name, px in phases.items():
        if name not in known:
            yield px.path, f"phase {name!r} is neither a vision variant nor prefill or decode"
    prefill = phases.get("prefill")
    if prefill is not None:
        given = {b.name: b for b in prefill.phase.inputs if b.kind == "input"}
        for name, shape in ((TABLE, table), ("image_rows", [1, plan.bounds.prefill_chunk])):
            b = given.get(name)
            if b is None:
                yield f"{prefill.path}.inputs", f"no input binding named {name!r}"
            elif b.shape != shape:
                yield f"{prefill.path}.inputs", f"{name} has shape {b.shape}, expected {shape}"
    named = [p for s in v.streams for p in s.phases if s.name != "output"]
    for name in phases:
        if named.count(name) != 1:
            yield "$.vision.streams", (
                f"phase {name!r} is on {named.count(name)} of the vision/text streams (want 1)"
            )
    for name in set(named) - set(phases):
        yield "$.vision.streams", f"names phase {name!r}, which the plan does not have"


def _vision_phase(px, v, table: list[int]) -> Iterator[Finding]:
    """``v``: the variant (its pixel shape and tokens) the phase encodes."""
    phase = px.phase
    given = [b.name for b in phase.inputs if b.kind == "input"]
    if sorted(given) != sorted(VISION_INPUTS):
        yield f"{px.path}.inputs", (
            f"takes {', '.join(sorted(given)) or 'nothing'}; the runner feeds the vision phase "
            f"{', '.join(VISION_INPUTS)}"
        )
    if any(b.kind == "state" for b in phase.inputs):
        yield f"{px.path}.inputs", "the vision phase reads state (only the features table lives on)"
    outs = [(b.name, b.kind, b.shape) for b in phase.outputs]
    if outs != [(TABLE, "output", table)]:
        yield f"{px.path}.outputs", f"are {outs}, expected only {TABLE} of shape {table}"
    pixels = next((b for b in phase.inputs if b.name == "pixel_values"), None)
    if pixels is not None and pixels.shape != v.pixel_shape:
        yield f"{px.path}.inputs", (
            f"pixel_values has shape {pixels.shape}, its variant says {v.pixel_shape}"
        )
    table_in = next((b for b in phase.inputs if b.name == TABLE), None)
    if table_in is not None and table_in.shape != table:
        yield f"{px.path}.inputs", f"{TABLE} has shape {table_in.shape}, expected {table}"
    if phase.tokens != v.tokens:
        yield f"{px.path}.tokens", f"{phase.tokens}, but one image fills {v.tokens} rows"
    # The table's update: at the row input, tokens_per_image rows along axis 0.
    row = {b.id for b in phase.inputs if b.name == "row"}
    shapes = {t.id: t.shape for t in phase.tensors}
    shapes.update({b.id: b.shape for b in phase.inputs})
    reshaped = set(row)
    for op in phase.ops:
        if op.primitive in ("Reshape", "ExpandDims", "Squeeze", "Flatten") and op.inputs[0] in reshaped:
            reshaped.update(op.outputs)
    table_ids = {b.id for b in phase.inputs if b.name == TABLE}
    writes = [(k, op) for k, op in enumerate(phase.ops) if op.primitive == "DynamicSliceUpdate"]
    for k, op in writes:
        if len(op.inputs) != 3 or op.inputs[2] not in reshaped or op.inputs[0] not in table_ids:
            yield px.op_path(k), "a dynamic update that is not the table's write at row"
            continue
        update = shapes.get(op.inputs[1], [])
        if op.args[:1] != [[0]] or not update or update[0] != v.tokens:
            yield px.op_path(k), (
                f"writes {update[:1]} rows along {op.args[:1]}; one image writes "
                f"{v.tokens} rows along axis 0"
            )
    if not writes:
        yield px.path, "never writes the features table"
