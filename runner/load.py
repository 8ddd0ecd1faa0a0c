"""Load a plan and the weights it was compiled for; refuse any mismatch before allocating anything."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from dctms.runner import weight_arena
from dctms.runner.primitives import SUPPORTED, dtype_from_name
from dctms.runner.weight_arena import ArenaInfo
from dctms.schema.errors import DctmsError
from dctms.schema.fingerprint import canonical_config_sha256, config_differences, file_sha256
from dctms.schema.io import read_plan
from dctms.schema.model_folder import ModelFolder
from dctms.schema.rules_runner import RUNNER_INPUTS
from dctms.schema.sizes import cast_order
from dctms.schema.types import Plan


def load_checked_plan(path: str | Path) -> Plan:
    """Schema + every verifier rule, the run-only ones included (``read_plan(for_run=True)``:
    index safety), and the runtime's own compatibility checks."""
    plan = read_plan(path, for_run=True)
    check_runtime(plan)
    return plan


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def check_runtime(plan: Plan) -> None:
    """The plan's primitive encoding, backend and phases must be this runner's. Pure: it reads MLX's
    version and devices and changes nothing (``configure_mlx`` does, when a Session opens)."""
    if _minor(plan.generator.mlx) != _minor(mx.__version__):
        raise DctmsError(
            f"plan was compiled with mlx {plan.generator.mlx}, this runner has mlx {mx.__version__}: "
            "primitive encodings differ between MLX minor versions; recompile the plan"
        )
    refusal = device_refusal(plan)
    if refusal is not None:
        raise DctmsError(refusal)
    names = [p.name for p in plan.phases]
    for name in RUNNER_INPUTS:
        if name not in names:
            raise DctmsError(
                f"plan has no phase named {name!r} (it has {', '.join(names) or 'none'}); "
                "the runner executes prefill and decode"
            )
    for phase in plan.phases:
        for index, op in enumerate(phase.ops):
            if op.primitive not in SUPPORTED:
                raise DctmsError(
                    f"plan uses primitive {op.primitive} (phase {phase.name}, op {index}), "
                    f"which this runner cannot execute (mlx {mx.__version__})"
                )


def runner_device() -> str:
    """The GPU this MLX drives ("metal", "cuda"), or "cpu" when it has none."""
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def device_refusal(plan: Plan) -> str | None:
    """Why this MLX cannot run the plan's target, naming both (a GPU plan needs its own GPU: a
    metal plan on CUDA, or any GPU plan on a CPU-only MLX, is refused), or None."""
    if plan.target.backend != "gpu":
        return None
    model = plan.target.memory_model
    want = model.name if model is not None else "gpu"
    have = runner_device()
    if have == "cpu" or (model is not None and have != model.name):
        mine = "has no GPU (it runs on cpu)" if have == "cpu" else f"runs on {have}"
        return (
            f"plan targets {want} (the gpu backend), this runner's MLX {mine}: run it on a "
            f"{want} machine, or compile the model with --target {have}"
        )
    return None


def configure_mlx(plan: Plan) -> None:
    """Select the plan's device: its primitives are those of its backend (a CPU trace decomposes
    the fast kernels). The memory limits follow in ``Session.apply_limits``."""
    mx.set_default_device(mx.gpu if plan.target.backend == "gpu" else mx.cpu)


def check_fingerprint(plan: Plan, model: ModelFolder, verify_hashes: bool = False) -> None:
    """Config hash, then every weight's name, shape and dtype (and sha256 with ``verify_hashes``).

    Raises with the first difference, before any weight is read."""
    if canonical_config_sha256(model.config) != plan.model.config_sha256:
        recorded = _recorded_config(plan)
        what = (
            config_differences(model.config, recorded)
            if recorded is not None
            else f"sha256 {canonical_config_sha256(model.config)[:12]} vs "
            f"{plan.model.config_sha256[:12]}"
        )
        raise DctmsError(
            f"{model.path}/config.json differs from the config the plan was compiled for "
            f"(this folder's vs the plan's: {what})"
        )
    have = {h.name: h for h in model.headers()}
    want = {w.name: w for w in plan.model.weights.tensors}
    # A pipeline rank's plan names the other ranks' weights it does not load.
    others = set(plan.distributed.skipped_weights) if plan.distributed else set()
    for name in sorted(set(have) | set(want)):
        if name not in have:
            raise DctmsError(f"{model.path}: weight {name} is missing (the plan needs it)")
        if name not in want:
            if name in others:
                continue
            raise DctmsError(f"{model.path}: weight {name} is not in the plan")
        h, w = have[name], want[name]
        stored = w.stored_dtype or w.dtype
        shape = w.shard.stored_shape if w.shard else w.shape  # a tensor-parallel rank's slice
        if list(h.shape) != list(shape) or h.dtype != stored:
            raise DctmsError(
                f"{model.path}: weight {name} is {h.dtype}{list(h.shape)}, "
                f"the plan has {stored}{list(shape)}"
            )
    if verify_hashes:
        recorded = plan.model.weights.files_sha256
        if not recorded:
            raise DctmsError("plan records no weight hashes; recompile with --hash-weights")
        for f in model.weight_files:
            digest = file_sha256(f)
            if recorded.get(f.name) != digest:
                raise DctmsError(f"{f}: sha256 {digest[:12]} differs from the plan's")


def _recorded_config(plan: Plan) -> dict | None:
    """The config the plan records for its model (a draft view's is the request's draft_config),
    or None when it records none that hashes to ``model.config_sha256``."""
    request = plan.compile
    if request is None:
        return None
    for config in (request.config, request.draft_config):
        if config is not None and canonical_config_sha256(config) == plan.model.config_sha256:
            return config
    return None


def load_weights(model: ModelFolder, plan: Plan) -> tuple[dict[str, mx.array], ArenaInfo]:
    """Every weight, resident in the plan's dtype, and how they were allocated: in one arena
    where that is exact (``runner.weight_arena``), else one buffer each (:func:`_load_each`)."""
    why = _no_arena(model, plan)
    if why is None:
        sources = {h.name: h for h in model.headers()}
        names = weight_use_order(plan, [w.name for w in plan.model.weights.tensors])
        placed = weight_arena.layout(names, sources)
        if placed is not None:
            files = {f.name: f for f in model.weight_files}
            return weight_arena.read_arena(placed, files, plan.model.weights.fused)
        why = "an offset would need padding"
    return _load_each(model, plan), ArenaInfo(0, 0, why)


def _no_arena(model: ModelFolder, plan: Plan) -> str | None:
    """Why the weights cannot be one arena read as stored, or None."""
    if weight_arena.switched_off():
        return f"{weight_arena.SWITCH}=off"
    if plan.target.backend != "cpu":
        return f"the {plan.target.backend} backend"
    if plan.distributed is not None:
        return "a rank's plan"
    if cast_order(plan.model.weights.tensors):
        return "weights cast at load"
    return None


def _load_each(model: ModelFolder, plan: Plan) -> dict[str, mx.array]:
    """Every weight in a buffer of its own. ``mx.load`` is lazy: a weight the plan casts
    (``compile --dtype``) is read and cast one at a time, largest stored copy first
    (``sizes.cast_order``; the compiler checks the envelope covers the overshoot), then the rest is
    read as stored."""
    loaded: dict[str, mx.array] = {}
    for f in model.weight_files:
        try:
            loaded.update(mx.load(str(f)))
        except (RuntimeError, ValueError, OSError) as err:
            raise DctmsError(f"{f}: cannot load weights: {err}") from None
    weights: dict[str, mx.array] = {}
    if plan.distributed is not None:
        weights.update(_rank_weights(model, plan, loaded))
    # Fused weights first, each read and concatenated at once, its parts dropped: while the
    # weights not read yet are at least one group's size, the load never holds more than M_weights.
    for fw in plan.model.weights.fused:
        array = mx.concatenate([loaded.pop(p) for p in fw.parts], axis=0)
        mx.eval(array)
        weights[fw.name] = array
    for w in cast_order([w for w in plan.model.weights.tensors if w.name not in weights]):
        array = loaded.pop(w.name).astype(dtype_from_name(w.dtype))
        mx.eval(array)  # the stored copy is freed here: nothing else refers to it
        weights[w.name] = array
    # The rest in one evaluation, in the order a decode step reads them (mx.load's dict order is
    # a hash order): each is allocated and read in turn, so the weights lie in memory in the
    # order the step streams them, as mlx-lm's (its parameter tree is in layer order).
    for name in weight_use_order(plan, loaded):
        weights[name] = loaded.pop(name)
    weights.update(loaded)
    mx.eval(list(weights.values()))
    return weights


def weight_use_order(plan: Plan, names) -> list[str]:
    """``names`` in the order of their first read by the decode phase's ops (then the rest)."""
    wanted = set(names)
    parts = {fw.name: fw.parts for fw in plan.model.weights.fused}
    decode = next((p for p in plan.phases if p.name == "decode"), None)
    order: dict[str, None] = {}
    if decode is not None:
        by_id = {b.id: b.name for b in decode.inputs if b.kind == "weight"}
        for op in decode.ops:
            for t in op.inputs:
                # a fused weight's parts end to end, where it is first read
                for name in parts.get(by_id.get(t), (by_id.get(t),)):
                    if name in wanted:
                        order.setdefault(name, None)
    order.update((n, None) for n in sorted(wanted - set(order)))
    return list(order)


def _rank_weights(model: ModelFolder, plan: Plan, loaded: dict[str, mx.array]) -> dict:
    """A rank's own weights: the other ranks' (still unread) are dropped, and every shard is cut
    from its stored tensor one at a time (``runner.shards``); returns the shards."""
    from dctms.runner.shards import read_shard, tensor_offsets

    for name in plan.distributed.skipped_weights:
        loaded.pop(name, None)
    sharded = [w for w in plan.model.weights.tensors if w.shard is not None]
    if not sharded:
        return {}
    folder = {f.name: f for f in model.weight_files}
    file_of = {h.name: folder[h.file] for h in model.headers()}
    offsets = {f: tensor_offsets(f) for f in {file_of[w.name] for w in sharded}}
    out = {}
    for w in sharded:
        loaded.pop(w.name, None)
        start, entries = offsets[file_of[w.name]]
        out[w.name] = read_shard(file_of[w.name], start, entries[w.name], w)
    return out
