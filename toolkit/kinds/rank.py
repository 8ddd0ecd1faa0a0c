"""Per-rank tracing: the model as one rank of mlx.distributed runs it, with its collectives as ops.

What the compiler needs to trace one rank; every rank's plan and the split are ``kinds.distributed``'s.

A rank's model is mlx-lm's own: ``model.shard(group)`` (tensor parallel) or
``model.model.pipeline(group, split)`` (pipeline parallel), called with a stand-in group that
answers ``rank()`` and ``size()`` exactly as the launched group will (mlx-lm reads nothing else
from it while building). The rank is then traced like any model, with two substitutions, both
active only while tracing:

* MLX's exporter cannot serialise distributed primitives ("Unable to get state for primitive
  Send"), so each collective call (``all_sum``, ``all_gather``, ``send``, ``recv``/``recv_like``)
  is made as a *marker*: an ordinary op that reads a scalar graph input reserved for that call
  (``collective.<k>``) and has the collective's output shape and dtype. After export every marker
  is replaced by the collective op (``AllReduce``, ``AllGather``, ``Send``, ``Recv``) on the same
  tensor ids, and the reserved inputs are dropped. The markers are found by those inputs, which
  nothing else reads, so the rewrite cannot mistake a model op for a collective.
* ``mlx.nn``'s ``sum_gradients`` (an identity whose *gradient* is an all_sum) is the identity:
  inference never differentiates.

How each weight of a tensor-parallel rank is cut from the stored tensor is recorded from the very
``mlx.nn.layers.distributed._shard`` calls ``shard`` makes (axis and segments per parameter), so
the runner slices the file exactly as mlx-lm would.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn
import msgspec
from mlx.utils import tree_flatten

from dctms.schema.errors import DctmsError, InternalError
from dctms.schema.fingerprint import HeaderTensor
from dctms.schema.types import Distributed, Plan, RankShard
from dctms.toolkit.trace import PhaseTracer, TracedBinding, TracedOp, TracedPhase

PARALLEL_MODES = ("pipeline", "tensor")
TAG = "collective."
COLLECTIVES = ("all_sum", "all_gather", "send", "recv")
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class RankSpec:
    """Which rank of which split to compile."""

    mode: str  # "pipeline" | "tensor"
    ranks: int
    rank: int
    split: tuple[int, ...] | None = None  # pipeline: layers per rank, rank order (None: by count)


def check_spec(spec: RankSpec) -> None:
    if spec.mode not in PARALLEL_MODES:
        raise DctmsError(f"--parallel must be one of {', '.join(PARALLEL_MODES)}, got {spec.mode}")
    if not 2 <= spec.ranks <= 1024:
        raise DctmsError(f"--ranks must be between 2 and 1024, got {spec.ranks}")
    if not 0 <= spec.rank < spec.ranks:
        raise DctmsError(f"rank {spec.rank} is not one of the {spec.ranks} ranks")
    if spec.split is not None:
        if spec.mode != "pipeline":
            raise DctmsError("--split applies to --parallel pipeline only")
        if len(spec.split) != spec.ranks or any(n < 1 for n in spec.split):
            raise DctmsError(
                f"--split needs {spec.ranks} positive layer counts (one per rank), got "
                f"{','.join(map(str, spec.split))}"
            )


class RankGroup:
    """Stands in for ``mx.distributed.Group`` while mlx-lm builds one rank's model."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def split(self, *_args, **_kwargs):
        raise DctmsError("not supported yet: the model splits the distributed group")


# ------------------------------------------------------------------------------------ the rank


@dataclass
class Rank:
    """One rank's model as mlx-lm split it, and what the plan must say about it."""

    spec: RankSpec
    model: nn.Module
    layers: tuple[int, int]  # [start, end) in the model's layer numbering
    total_layers: int
    split: tuple[int, ...]  # pipeline: layers per rank (rank order); () for tensor
    shards: dict[str, RankShard]  # parameter path -> how it is cut from the stored tensor
    skipped: tuple[str, ...]  # parameters of the full model this rank does not hold
    recorder: CollectiveRecorder = field(init=False)

    def __post_init__(self) -> None:
        self.recorder = CollectiveRecorder(self.spec.ranks)

    def tracer(self, num_layers: int, *, batch: int, capacity: int, **cache) -> RankTracer:
        """``cache``: PhaseTracer's cache options (kv_quant, rings), passed through."""
        return RankTracer(
            self.model, num_layers, batch=batch, capacity=capacity, rank=self, **cache
        )

    def headers(self, headers: list[HeaderTensor] | None) -> list[HeaderTensor] | None:
        """The safetensors headers as this rank sees them: only the tensors it holds, each with
        its shard's shape (the stored shape is checked against ``RankShard.stored_shape``)."""
        if headers is None:
            return None
        skipped = set(self.skipped)
        out = []
        for h in headers:
            if h.name in skipped:
                continue
            s = self.shards.get(h.name)
            if s is not None:
                if list(h.shape) != s.stored_shape:
                    raise DctmsError(
                        f"weights: {h.name} is stored as {list(h.shape)}, the model expects "
                        f"{s.stored_shape} before sharding"
                    )
                shape = list(h.shape)
                shape[s.axis] //= s.parts
                h = replace(h, shape=tuple(shape), bytes=h.bytes // s.parts)
            out.append(h)
        return out

    def annotate(self, plan: Plan) -> Plan:
        """The rank's plan: its ``distributed`` section, and the model's own layer count (the
        layers numbered in ops and weights are the model's, whichever this rank runs)."""
        tensors = [
            msgspec.structs.replace(w, shard=self.shards[w.name]) if w.name in self.shards else w
            for w in plan.model.weights.tensors
        ]
        weights = msgspec.structs.replace(plan.model.weights, tensors=tensors)
        model = msgspec.structs.replace(plan.model, num_layers=self.total_layers, weights=weights)
        return msgspec.structs.replace(plan, model=model, distributed=self.section())

    def section(self) -> Distributed:
        return Distributed(
            mode=self.spec.mode,
            ranks=self.spec.ranks,
            rank=self.spec.rank,
            layers=list(self.layers),
            split=list(self.split),
            skipped_weights=sorted(self.skipped),
        )


def split_model(model: nn.Module, spec: RankSpec) -> Rank:
    """``model`` (built as usual, lazy weights) turned into rank ``spec.rank`` by mlx-lm itself."""
    check_spec(spec)
    group = RankGroup(spec.rank, spec.ranks)
    before = dict(tree_flatten(model.parameters()))
    total_layers = len(getattr(getattr(model, "model", model), "layers", []) or [])
    if spec.mode == "tensor":
        if not hasattr(model, "shard"):
            raise DctmsError(
                f"not supported: {getattr(model, 'model_type', 'this model')} has no shard(group) "
                "in mlx-lm (tensor parallelism)"
            )
        shards = _recording_shards(model, group, before)
        return Rank(spec, model, (0, total_layers), total_layers, (), shards, ())
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "pipeline"):
        raise DctmsError(
            f"not supported: {getattr(model, 'model_type', 'this model')} has no "
            "pipeline(group) in mlx-lm (the model does not support pipelining)"
        )
    try:
        inner.pipeline(group, split=list(spec.split) if spec.split else None)
    except ValueError as err:
        raise DctmsError(f"--split: {err}") from None
    layers = (inner.start_idx, inner.end_idx)
    split = tuple(_layers_per_rank(total_layers, spec))
    after = set(dict(tree_flatten(model.parameters())))
    skipped = tuple(sorted(set(before) - after))
    for name in skipped:
        m = LAYER.search(name)
        if m is None or layers[0] <= int(m.group(1)) < layers[1]:
            raise InternalError(f"internal error: pipeline rank dropped {name} of its own layers")
    return Rank(spec, model, layers, total_layers, split, {}, skipped)


def _layers_per_rank(total: int, spec: RankSpec) -> list[int]:
    if spec.split:
        return list(spec.split)
    base, extra = divmod(total, spec.ranks)  # mlx-lm's own default (the low ranks get extras)
    return [base + (1 if r < extra else 0) for r in range(spec.ranks)]


def _recording_shards(
    model: nn.Module, group: RankGroup, before: dict[str, mx.array]
) -> dict[str, RankShard]:
    """Run ``model.shard(group)`` and record, for every parameter it cuts, the axis and segments
    mlx.nn's ``_shard`` used (looked up by the parameter's array, whose path we know)."""
    import mlx.nn.layers.distributed as nn_dist

    path_of = {id(v): k for k, v in before.items()}
    cuts: dict[str, tuple[int, object]] = {}
    original = nn_dist._shard

    def recording(parameters, predicate, group_=None):
        def wrapped(path, weight):
            s = predicate(path, weight)
            if s is not None and id(weight) in path_of:
                axis, segments = (s, 1) if isinstance(s, int) else s
                cuts[path_of[id(weight)]] = (axis % weight.ndim, segments)
            return s

        return original(parameters, wrapped, group_)

    nn_dist._shard = recording
    try:
        model.shard(group)
    except ValueError as err:
        raise DctmsError(f"--parallel tensor: {err}") from None
    finally:
        nn_dist._shard = original
    after = dict(tree_flatten(model.parameters()))
    shards = {}
    for name, (axis, segments) in sorted(cuts.items()):
        if not isinstance(segments, int):
            raise DctmsError(
                f"not supported yet: {name} is sharded in fractional segments {segments}"
            )
        full = list(before[name].shape)
        if name not in after or full[axis] % group.size():
            raise InternalError(f"internal error: cannot follow the shard of {name}")
        shards[name] = RankShard(
            stored_shape=full, axis=axis, parts=group.size(), index=group.rank(), segments=segments
        )
    return shards


# ------------------------------------------------------------------------------------ tracing


@dataclass(frozen=True)
class Call:
    kind: str  # one of COLLECTIVES
    peer: int | None  # send: destination, recv: source
    dtype: mx.Dtype


class CollectiveRecorder:
    """mx.distributed's collectives, made as marker ops while tracing (see the module doc)."""

    def __init__(self, size: int):
        self.size = size
        self.calls: list[Call] = []  # as the probe call made them, in call order
        self._kw: dict | None = None
        self._next = 0
        self._probing = False

    def tag_inputs(self) -> dict[str, mx.array]:
        """One scalar graph input per collective call, of the call's output dtype."""
        return {
            f"{TAG}{k:05d}": mx.broadcast_to(mx.zeros((), c.dtype), ())
            for k, c in enumerate(self.calls)
        }

    def start(self, kw: dict) -> None:
        """A traced call begins; its reserved inputs are in ``kw``."""
        self._kw, self._next = kw, 0

    @contextlib.contextmanager
    def active(self, probing: bool = False):
        import mlx.nn.layers.distributed as nn_dist

        names = ("all_sum", "all_gather", "send", "recv", "recv_like")
        saved = {n: getattr(mx.distributed, n) for n in names}
        saved_grad = nn_dist.sum_gradients
        self._probing = probing
        for n in names:
            setattr(mx.distributed, n, getattr(self, n))
        nn_dist.sum_gradients = _no_gradient_hook
        try:
            yield self
        finally:
            for n, f in saved.items():
                setattr(mx.distributed, n, f)
            nn_dist.sum_gradients = saved_grad
            self._probing, self._kw = False, None

    # The stand-ins, with mx.distributed's signatures.
    def all_sum(self, x, *, group=None, stream=None):
        return self._mark("all_sum", None, x.dtype, lambda t: x + t, lambda: x)

    def all_gather(self, x, *, group=None, stream=None):
        rest = ((self.size - 1) * x.shape[0], *x.shape[1:])
        return self._mark(
            "all_gather",
            None,
            x.dtype,
            lambda t: mx.concatenate([x, mx.broadcast_to(t, rest)], axis=0),
            lambda: mx.concatenate([x] * self.size, axis=0),
        )

    def send(self, x, dst, *, group=None, stream=None):
        return self._mark("send", int(dst), x.dtype, lambda t: x + t, lambda: x)

    def recv(self, shape, dtype, src, *, group=None, stream=None):
        shape = tuple(shape)
        return self._mark(
            "recv",
            int(src),
            dtype,
            lambda t: mx.broadcast_to(t, shape),
            lambda: mx.zeros(shape, dtype),
        )

    def recv_like(self, x, src, *, group=None, stream=None):
        return self.recv(x.shape, x.dtype, src)

    def _mark(self, kind, peer, dtype, marker, plain):
        if self._probing:
            self.calls.append(Call(kind, peer, dtype))
            return plain()
        k = self._next
        self._next += 1
        if self._kw is None or k >= len(self.calls) or self.calls[k].kind != kind:
            raise InternalError(
                f"internal error: the traced call makes collective {k} ({kind}), the probe did not"
            )
        return marker(self._kw[f"{TAG}{k:05d}"])


def _no_gradient_hook(_group):
    return _identity


def _identity(x):
    return x


class RankTracer(PhaseTracer):
    """``PhaseTracer`` for one rank: collectives traced as markers, then rewritten into ops."""

    def __init__(
        self, model: nn.Module, num_layers: int, *, batch: int, capacity: int, rank: Rank, **cache
    ):
        self.rank = rank
        rec = rank.recorder
        with rec.active(probing=True):  # the cache probe is a plain call: it counts the collectives
            super().__init__(model, num_layers, batch=batch, capacity=capacity, **cache)
        # Passed to the exporter with the state (as keywords); never a weight of the plan.
        self.state = {**self.state, **rec.tag_inputs()}

    def _step(self, tokens, position, last_index, window, kw, *rest):
        self.rank.recorder.start(kw)
        return super()._step(tokens, position, last_index, window, kw, *rest)

    def prefill(self, tokens: int, window: int, *rest, paths: bool = False) -> TracedPhase:
        with self.rank.recorder.active():
            phase = super().prefill(tokens, window, *rest, paths=paths)
        return rewrite_collectives(phase, self.rank.recorder.calls)

    def decode(
        self, window: int, name: str = "decode", paths: bool = False, rows: int | None = None
    ) -> TracedPhase:
        with self.rank.recorder.active():
            phase = super().decode(window, name=name, paths=paths, rows=rows)
        return rewrite_collectives(phase, self.rank.recorder.calls)


def rewrite_collectives(phase: TracedPhase, calls: list[Call]) -> TracedPhase:
    """Every marker op becomes its collective (same output ids); the reserved inputs go."""
    tag_of = {b.id: int(b.name[len(TAG) :]) for b in phase.inputs if b.name.startswith(TAG)}
    spread: dict[str, int] = {}  # the broadcast of a reserved input -> its call
    used: list[int] = []
    ops: list[TracedOp] = []
    # The module path of each kept op: a collective is the module's whose call made its marker.
    path_of: dict[str, str] = {}
    traced_paths = phase.module_paths or [""] * len(phase.ops)
    for op, path in zip(phase.ops, traced_paths, strict=True):
        path_of[op.outputs[0]] = path
        tags = [t for t in op.inputs if t in tag_of]
        via = [t for t in op.inputs if t in spread]
        if not tags and not via:
            ops.append(op)
            continue
        k = tag_of[tags[0]] if tags else spread[via[0]]
        call = calls[k]
        others = tuple(t for t in op.inputs if t not in tag_of and t not in spread)
        if call.kind in ("all_sum", "send") and op.primitive == "Add" and len(others) == 1:
            name = "AllReduce" if call.kind == "all_sum" else "Send"
            args = ["sum"] if call.kind == "all_sum" else [call.peer]
            ops.append(TracedOp(name, args, others, op.outputs))
        elif call.kind == "recv" and op.primitive == "Broadcast" and not others:
            ops.append(TracedOp("Recv", [call.peer], (), op.outputs))
        elif op.primitive == "Broadcast" and tags and not others:
            # MLX broadcasts the scalar before the Add / Concatenate that is the marker.
            spread[op.outputs[0]] = k
            continue
        elif call.kind == "all_gather" and op.primitive == "Concatenate" and len(others) == 1:
            ops.append(TracedOp("AllGather", [], others, op.outputs))
        else:
            raise InternalError(
                f"internal error: collective {k} ({call.kind}) traced as {op.primitive}"
            )
        used.append(k)
    if sorted(used) != list(range(len(calls))):
        raise InternalError(
            f"internal error: {phase.name} made {len(used)} of the {len(calls)} collectives"
        )
    gone = set(tag_of) | set(spread)
    ops, outputs, dropped = _drop_state_depends(ops, phase.outputs)
    return TracedPhase(
        phase.name,
        phase.tokens,
        [b for b in phase.inputs if b.id not in tag_of],
        outputs,
        phase.constants,
        ops,
        {t: v for t, v in phase.tensors.items() if t not in gone | dropped},
        None if phase.module_paths is None else [path_of[op.outputs[0]] for op in ops],
    )


def _drop_state_depends(
    ops: list[TracedOp], outputs: list[TracedBinding]
) -> tuple[list[TracedOp], list[TracedBinding], set[str]]:
    """mlx-lm's pipeline stage ends with ``cache.keys = mx.depends(cache.keys, h)`` so that
    evaluating the cache alone (its chunked prefill) also runs the ``send`` of ``h``. A phase of
    the plan evaluates ``next_token`` with the cache at every sync point, and ``next_token`` reads
    the sent ``h`` (through the all_gather), so that order already holds: the Depends op goes and
    the state output is the updated cache itself (checked, else the plan is not emitted)."""
    state_out = {b.id: b for b in outputs if b.kind == "state"}
    produced = {t: op for op in ops for t in op.outputs}
    drop = [
        op
        for op in ops
        if op.primitive == "Depends" and len(op.outputs) == 1 and op.outputs[0] in state_out
    ]
    if not drop:
        return ops, outputs, set()
    token = next(b.id for b in outputs if b.name == "next_token")
    ancestors = _ancestors(token, produced)
    renamed = {}
    for op in drop:
        if any(t not in ancestors for t in op.inputs[1:]):
            raise InternalError(
                "internal error: a pipeline Depends orders a tensor next_token does not read"
            )
        renamed[op.outputs[0]] = op.inputs[0]
    kept = [op for op in ops if op not in drop]
    outputs = [replace(b, id=renamed.get(b.id, b.id)) for b in outputs]
    return kept, outputs, set(renamed)


def _ancestors(tensor: str, produced: dict[str, TracedOp]) -> set[str]:
    seen, stack = set(), [tensor]
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        op = produced.get(t)
        if op is not None:
            stack.extend(op.inputs)
    return seen


def rank_spec(opts) -> RankSpec:
    """The rank a ``CompileOptions`` asks for."""
    if opts.parallel is None:
        raise DctmsError(f"--ranks {opts.ranks} needs --parallel {' or '.join(PARALLEL_MODES)}")
    if getattr(opts, "kv_bits", None) is not None or getattr(opts, "max_kv_size", None):
        raise DctmsError(
            "not supported yet: --ranks with a quantised or rotating KV cache (--kv-bits, "
            "--max-kv-size)"
        )
    split = tuple(opts.split) if opts.split is not None else None
    return RankSpec(opts.parallel, opts.ranks, opts.rank, split)
