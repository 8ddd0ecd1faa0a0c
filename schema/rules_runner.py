"""Verifier rules for what the runner relies on: the names it looks up, and the indices it feeds.

The runner executes a plan by name: the phases "prefill" and "decode", the per-call inputs it makes
(``RUNNER_INPUTS``), the ``next_token`` output it reads, and the KV state it allocates and threads
from call to call. It bounds token ids by ``model.vocab_size`` and write positions by the plan's
bounds; MLX does not bounds-check gathers or dynamic slice updates, so the shapes must hold them
(``dctms.schema.access``). A plan that passes these rules cannot make the runner look up a name that
is not there, nor index past an array the plan declares.
"""

from __future__ import annotations

from collections.abc import Iterator

from dctms.schema.access import state_writes, token_gathers
from dctms.schema.phase_index import PlanIndex
from dctms.schema.sampling import INPUTS as SAMPLING_INPUTS
from dctms.schema.sampling import SAMPLED_PHASES, samples
from dctms.schema.slotted import MOVE_PHASE, slotted

Finding = tuple[str, str]

# The per-call arrays the runner makes for each phase, by binding name.
RUNNER_INPUTS = {
    "prefill": ("tokens", "position", "last_index"),
    "decode": ("tokens", "position"),
}
# Phases the runner executes when the plan has them: speculative decoding's verify call, a
# quantised KV cache's first call.
OPTIONAL_INPUTS = {
    "verify": ("tokens", "position"),
    "prefill_start": ("tokens", "position", "last_index"),
    "decode_start": ("tokens", "position"),  # a quantised cache's float steps before its switch
    "decode_one": ("tokens", "positions"),  # a batched plan's step of slot 0 alone
    # a prefix pool's block copies (toolkit.prefix_pool): no token, no result
    "save_block": ("slot", "position", "block"),
    "load_block": ("slot", "position", "block"),
    # a batched plan's slot move (toolkit.slot_move): row source of every KV array to row slot
    MOVE_PHASE: ("slot", "source"),
}
# Phases that copy state and return no token: they read state they do not write (the runner
# keeps what such a phase reads; runner.batch) and have no next_token.
BLOCK_PHASES = ("save_block", "load_block")
# A batched plan's (toolkit.slots): a prefill chunk of one sequence into its slot, a decode step
# of the first rows at their own positions.
BATCHED_INPUTS = {
    "prefill": ("tokens", "position", "last_index", "slot"),
    "decode": ("tokens", "positions"),
    "decode_one": ("tokens", "positions"),
}
RESULT = "next_token"
# What a vision-language plan's text phases are fed besides (see ``rules_vision``): the features
# table and each position's row in it; with 3-axis rotary positions (``vision.mrope``) those too.
VISION_INPUTS = {"prefill": ("image_features", "image_rows"), "decode": ()}
MROPE_INPUTS = ("rope_positions",)


def runnable(plan) -> bool:
    """Whether the plan has the phases the runner executes (the others can only be inspected)."""
    return set(RUNNER_INPUTS) <= {p.name for p in plan.phases}


def runner_names(ix: PlanIndex) -> Iterator[Finding]:
    """In a runnable plan (one with both the prefill and the decode phase: the runner refuses any
    other, and a plan of one phase can still be inspected), those phases take exactly the inputs
    the runner feeds, return ``next_token``, and read only KV state, which they also write back."""
    plan = ix.plan
    if not runnable(plan):
        return
    kv = {s.name for s in plan.state if s.kind == "kv"}
    for px in ix.phases:
        phase = px.phase
        fed = RUNNER_INPUTS.get(phase.name) or OPTIONAL_INPUTS.get(phase.name)
        if slotted(plan.bounds) and phase.name in BATCHED_INPUTS:
            fed = BATCHED_INPUTS[phase.name]
        if fed is None:
            continue  # not executed by the runner (a vision phase: see rules_vision)
        if plan.vision is not None:
            fed = fed + VISION_INPUTS[phase.name] + (MROPE_INPUTS if plan.vision.mrope else ())
        if samples(plan) and phase.name in SAMPLED_PHASES:
            fed = fed + tuple(SAMPLING_INPUTS)
        given = [b.name for b in phase.inputs if b.kind == "input"]
        for k, b in enumerate(phase.inputs):
            where = f"{px.path}.inputs[{k}]"
            if b.kind == "input" and b.name not in fed:
                yield f"{where}.name", f"the runner feeds {phase.name} only {', '.join(fed)}"
            if b.kind == "state" and b.name not in kv:
                yield f"{where}.name", f"state {b.name!r} is not KV state (the runner allocates KV)"
        for name in fed:
            if name not in given:
                yield f"{px.path}.inputs", f"no input binding named {name!r}"
        results = [b.name for b in phase.outputs if b.kind == "output"]
        if phase.name in BLOCK_PHASES:
            yield from _block_phase(px, plan)
            continue
        if phase.name == MOVE_PHASE:
            yield from _move_phase(px, plan)
            continue
        if RESULT not in results:
            yield f"{px.path}.outputs", f"no output binding named {RESULT!r}"
        written = {b.name for b in phase.outputs if b.kind == "state"}
        for k, b in enumerate(phase.inputs):
            if b.kind == "state" and b.name not in written:
                yield (
                    f"{px.path}.inputs[{k}].name",
                    f"state {b.name!r} is read but not written back by {phase.name}",
                )
        for k, b in enumerate(phase.outputs):
            if b.kind == "state" and b.name not in {i.name for i in phase.inputs}:
                yield f"{px.path}.outputs[{k}].name", f"state {b.name!r} is written but never read"
    for px in ix.phases:
        if (
            px.phase.name in ("prefill", "prefill_start")
            and px.phase.tokens != plan.bounds.prefill_chunk
        ):
            yield (
                f"{px.path}.tokens",
                f"{px.phase.tokens}, but the runner feeds prefill_chunk = "
                f"{plan.bounds.prefill_chunk} tokens per prefill call",
            )
        if px.phase.name == "decode_one" and plan.bounds.batch == 1:
            yield f"{px.path}.name", "decode_one is a batched plan's phase, but bounds.batch is 1"
        if px.phase.name in ("decode", "decode_start", "decode_one") and px.phase.tokens != 1:
            yield f"{px.path}.tokens", f"{px.phase.tokens}, but decode processes one token per call"


def _block_phase(px, plan) -> Iterator[Finding]:
    """A prefix pool's copy: it returns state only, each a pool array (save_block) or a slot
    array (load_block) it also reads, and exists only in a plan with a pool."""
    phase = px.phase
    if plan.bounds.prefix_blocks < 1:
        yield f"{px.path}.name", f"{phase.name} copies prefix-pool blocks, but bounds.prefix_blocks is 0"
    yield from _copies_state(px)
    pool = phase.name == "save_block"
    for k, b in enumerate(phase.outputs):
        if b.kind == "state" and b.name.endswith(".pool") != pool:
            what = "pool blocks" if pool else "slots"
            yield f"{px.path}.outputs[{k}].name", f"{phase.name} writes {what}, not {b.name!r}"
    if px.phase.tokens != plan.bounds.prefill_chunk:
        yield f"{px.path}.tokens", (
            f"{px.phase.tokens}, but a pool block is one prefill chunk "
            f"({plan.bounds.prefill_chunk} positions)"
        )


def _copies_state(px) -> Iterator[Finding]:
    """A phase that copies state returns state only, each array one it also reads."""
    phase = px.phase
    read = {b.name for b in phase.inputs if b.kind == "state"}
    for k, b in enumerate(phase.outputs):
        where = f"{px.path}.outputs[{k}]"
        if b.kind != "state":
            yield where, f"{phase.name} returns state only, not {b.kind} {b.name!r}"
        elif b.name not in read:
            yield f"{where}.name", f"state {b.name!r} is written but never read"


def _move_phase(px, plan) -> Iterator[Finding]:
    """A slot move (``toolkit.slot_move``): it exists only in a batched plan and returns state
    only: every KV array of the slots, each of which it also reads."""
    phase = px.phase
    if plan.bounds.batch < 2:
        yield f"{px.path}.name", f"{phase.name} moves a slot, but bounds.batch is {plan.bounds.batch}"
    yield from _copies_state(px)
    slots = {s.name for s in plan.state if s.kind == "kv" and not s.name.endswith(".pool")}
    written = {b.name for b in phase.outputs if b.kind == "state"}
    if written != slots:
        missing = sorted(slots - written) or sorted(written - slots)
        yield f"{px.path}.outputs", (
            f"{phase.name} must move every slot array, and only those: not so for {missing[0]!r}"
        )


def prefix_pool(ix: PlanIndex) -> Iterator[Finding]:
    """A plan with ``bounds.prefix_blocks`` K has both block phases and pool arrays of K blocks of
    one prefill chunk each (what ``runner.prefix_cache`` indexes), and a plan without has none."""
    plan = ix.plan
    k = plan.bounds.prefix_blocks
    names = {p.name for p in plan.phases}
    pools = [s for s in plan.state if s.name.endswith(".pool")]
    if k > 0 and runnable(plan) and not set(BLOCK_PHASES) <= names:
        yield "$.phases", f"bounds.prefix_blocks is {k}, but the plan lacks {' or '.join(BLOCK_PHASES)}"
    if k > 0 and runnable(plan) and not pools:
        yield "$.state", f"bounds.prefix_blocks is {k}, but no state is a pool"
    if k == 0 and pools:
        yield "$.state", f"state {pools[0].name!r} is a prefix pool, but bounds.prefix_blocks is 0"
    for i, s in enumerate(plan.state):
        if not s.name.endswith(".pool"):
            continue
        if len(s.shape) != 4 or s.shape[0] < k or s.shape[2] < plan.bounds.prefill_chunk:
            yield f"$.state[{i}].shape", (
                f"{list(s.shape)} does not hold {k} blocks of {plan.bounds.prefill_chunk} positions"
            )


def quantized_start(ix: PlanIndex) -> Iterator[Finding]:
    """A quantised KV cache (``bounds.kv.bits``) has the ``prefill_start`` phase its first call runs
    (float attention, as mlx-lm's call before it quantises its cache), and only such a plan has."""
    plan = ix.plan
    kv = plan.bounds.kv
    names = {p.name for p in plan.phases}
    has = "prefill_start" in names
    if kv.bits is not None and not has and runnable(plan):
        yield "$.phases", "a quantised KV cache needs the prefill_start phase (its first call)"
    if kv.bits is None and has:
        yield (
            "$.phases",
            "prefill_start is the first call of a quantised KV cache, but bounds.kv has no bits",
        )
    later = kv.bits is not None and kv.quantized_start > 0
    if later != ("decode_start" in names) and runnable(plan):
        yield "$.phases", (
            "decode_start (the float steps before a quantised cache's switch) belongs exactly to "
            f"plans with bounds.kv bits and quantized_start > 0 (got {kv.bits}, {kv.quantized_start})"
        )


def vocabulary(ix: PlanIndex) -> Iterator[Finding]:
    """``model.vocab_size`` >= 1 and every weight gathered by token id has that many rows."""
    plan = ix.plan
    vocab = plan.model.vocab_size
    if vocab < 1:
        yield "$.model.vocab_size", f"must be >= 1, got {vocab}"
        return
    weights = {w.name: w for w in plan.model.weights.tensors}
    for px in ix.phases:
        for g in token_gathers(px.phase):
            w = weights.get(g.weight)
            if w is None:
                continue  # the bindings rule reports it
            rows = w.shape[g.axis] if 0 <= g.axis < len(w.shape) else 0
            if rows < vocab:
                yield (
                    f"{px.op_path(g.op_position)}",
                    f"gathers token ids from {g.weight} along axis {g.axis} of size {rows}, "
                    f"smaller than model.vocab_size {vocab}",
                )


def state_capacity(ix: PlanIndex) -> Iterator[Finding]:
    """Every dynamic write into state is at the position input, writes at most the phase's tokens,
    and lands in a state array that holds ``bounds.kv_capacity`` positions along its axis."""
    plan = ix.plan
    capacity = plan.bounds.kv_capacity
    state = {s.name: s for s in plan.state}
    for px in ix.phases:
        writes, stray = state_writes(px.phase)
        for w in writes:
            if w.slot_axis is None:
                continue
            rows = state[w.state].shape[w.slot_axis] if w.state in state else 0
            if rows < plan.bounds.batch:
                yield px.op_path(w.op_position), (
                    f"writes {w.state!r} at a slot along axis {w.slot_axis} of size {rows}, "
                    f"fewer than bounds.batch {plan.bounds.batch} slots"
                )
        for s in stray:
            yield (
                px.op_path(s.op_position),
                f"writes state {s.state!r} at an index that is not the position input",
            )
        for w in writes:
            where = px.op_path(w.op_position)
            if w.extent > px.phase.tokens:
                yield (
                    where,
                    (
                        f"writes {w.extent} positions of {w.state!r} per call, "
                        f"more than the phase's {px.phase.tokens} tokens"
                    ),
                )
            target = state.get(w.state)
            if target is None:
                continue  # the bindings rule reports it
            size = target.shape[w.axis] if w.axis < len(target.shape) else 0
            if w.clamp is not None:
                if size < w.clamp + w.extent:
                    yield where, (
                        f"writes {w.extent} positions of {w.state!r} at up to {w.clamp}, past its "
                        f"{size} positions along axis {w.axis}"
                    )
            elif w.modulus is not None or target.window is not None:
                yield from _ring_write(px, w, target, size, plan.bounds.prefill_chunk)
            elif size < capacity and not _float_before_switch(plan, px.phase.name, size):
                yield (
                    where,
                    (
                        f"writes {w.state!r} along axis {w.axis} of size {size}, "
                        f"smaller than bounds.kv_capacity {capacity}"
                    ),
                )


def _float_before_switch(plan, phase: str, size: int) -> bool:
    """A quantised cache's float state is written only by the float phases, which the runner
    calls below bounds.kv.quantized_start T: their writes end by ceil(T / chunk) * chunk."""
    kv, chunk = plan.bounds.kv, plan.bounds.prefill_chunk
    if kv.bits is None or kv.quantized_start < 1 or phase not in ("prefill_start", "decode_start"):
        return False
    return size >= -(-kv.quantized_start // chunk) * chunk


# The phases whose calls start at a multiple of bounds.prefill_chunk (the runner's prompt pieces).
CHUNK_ALIGNED = ("prefill", "prefill_start")


def _ring_write(px, w, target, size: int, chunk: int) -> Iterator[Finding]:
    """A sliding-window ring is written at ``position mod window.slots`` and the write never wraps:
    one position per call, or a prompt piece (starting at a multiple of the chunk) in a ring that
    is a whole number of chunks."""
    where = px.op_path(w.op_position)
    ring = target.window
    if ring is None:
        yield where, f"writes {w.state!r} modulo {w.modulus}, but the state has no window"
        return
    if w.modulus != ring.slots:
        yield (
            where,
            (
                f"writes ring {w.state!r} at the position"
                + (f" modulo {w.modulus}" if w.modulus is not None else "")
                + f", not modulo its {ring.slots} slots"
            ),
        )
        return
    if size < ring.slots:
        yield (
            where,
            f"ring {w.state!r} has {size} positions along axis {w.axis}, fewer than its {ring.slots} slots",
        )
    aligned = px.phase.name in CHUNK_ALIGNED and ring.slots % chunk == 0
    if w.extent > 1 and not aligned:
        yield (
            where,
            (
                f"writes {w.extent} positions of ring {w.state!r} per call where a write may wrap "
                f"(slots {ring.slots}, prefill_chunk {chunk}, phase {px.phase.name})"
            ),
        )


INT32_MAX = 2**31 - 1


def op_arguments(ix: PlanIndex) -> Iterator[Finding]:
    """Integers in op arguments fit MLX's 32-bit shapes, axes and indices (a larger one is an
    OverflowError in MLX's binding: no plan MLX traced has one)."""
    for px in ix.phases:
        for k, op in enumerate(px.phase.ops):
            bad = _outside_int32(op.args)
            if bad is not None:
                yield (
                    f"{px.op_path(k)}.args",
                    f"argument {bad} of {op.primitive} is outside MLX's 32-bit integer range",
                )


def _outside_int32(args: object) -> int | None:
    stack = [args]
    while stack:
        value = stack.pop()
        if isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif type(value) is int and not -INT32_MAX - 1 <= value <= INT32_MAX:
            return value
    return None
