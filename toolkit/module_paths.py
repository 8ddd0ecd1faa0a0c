"""Module paths: which mlx-lm module created each traced primitive (``model.layers.3.self_attn``).

MLX's exporter names arrays but knows nothing of modules, so the phase is traced a second time
with every module's ``__call__`` wrapped: each call records its path (from ``named_modules``) and
the arrays it took and returned, and those arrays are added as extra outputs of the traced
function, which makes the exporter tell us their ids. Extra outputs that are already part of the
graph change no primitive and no order (the exporter's tape is built from the outputs in order),
so the second trace's primitives pair up one to one with the plain trace's; that is checked, and
on any difference no paths are reported rather than wrong ones. Arrays a module made that the
outputs never read become extra primitives after all of the plain trace's (the tape reaches them
last); they are not in the plan and are ignored.

An op belongs to the innermost module call that created it: calls are visited as they return
(inner ones first), and each claims the not yet claimed ops between its outputs and its inputs.
Ops created in the model's own ``__call__`` outside any child are ``ROOT``'s; ops created outside
the model call (dctms's greedy sampling) are ``SAMPLER``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

ROOT = "(root)"  # the model's own __call__, outside every child module
STEP = "(step)"  # ops dctms adds around the model call (token reshape, greedy next token)


class _OpLike(Protocol):
    primitive: str
    args: list
    outputs: tuple[str, ...]


class _Recorder:
    def __init__(self, model: nn.Module):
        self.path_of = {id(m): (path or ROOT) for path, m in model.named_modules()}
        self.stack: list[nn.Module] = []
        # (path, argument arrays, returned arrays), in the order the calls returned
        self.calls: list[tuple[str, list[mx.array], list[mx.array]]] = []


_active: _Recorder | None = None


def _arrays(value: Any) -> list[mx.array]:
    """Every mx.array in a (nested) call argument or result; other objects are skipped."""
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays(v)]
    if isinstance(value, dict):
        return [a for v in value.values() for a in _arrays(v)]
    return []


def _wrap(call: Callable) -> Callable:
    def recorded(self, *args, **kwargs):
        rec = _active
        # Unknown modules (made on the fly) and super().__call__ chains add no frame of their own.
        if rec is None or id(self) not in rec.path_of or (rec.stack and rec.stack[-1] is self):
            return call(self, *args, **kwargs)
        rec.stack.append(self)
        try:
            out = call(self, *args, **kwargs)
        finally:
            rec.stack.pop()
        rec.calls.append((rec.path_of[id(self)], _arrays((args, kwargs)), _arrays(out)))
        return out

    recorded.__wrapped__ = call  # type: ignore[attr-defined]
    return recorded


@contextmanager
def _recording(model: nn.Module) -> Iterator[_Recorder]:
    """Wrap ``__call__`` of every module class in ``model`` (restored afterwards, even on error)."""
    global _active
    classes = {
        cls
        for _, m in model.named_modules()
        for cls in type(m).__mro__
        if "__call__" in cls.__dict__ and issubclass(cls, nn.Module)
    }
    saved = {cls: cls.__dict__["__call__"] for cls in classes}
    rec = _Recorder(model)
    try:
        for cls, call in saved.items():
            cls.__call__ = _wrap(call)
        _active = rec
        yield rec
    finally:
        _active = None
        for cls, call in saved.items():
            cls.__call__ = call


def trace_module_paths(
    model: nn.Module,
    fn: Callable,
    graph_inputs: Sequence[mx.array],
    keyword_inputs: dict[str, mx.array],
    ops: Sequence[_OpLike],
) -> list[str] | None:
    """The module path of each of ``ops`` (the plain trace of ``fn``, in its order), or None when
    the recording trace's primitives do not pair up with them."""
    extra: list[mx.array] = []
    calls: list[tuple[str, int, int, int]] = []  # path, first extra, inputs, outputs

    def recorded_fn(*args, **kwargs):
        with _recording(model) as rec:
            outs = fn(*args, **kwargs)
        for path, ins, results in rec.calls:
            calls.append((path, len(extra), len(ins), len(results)))
            extra.extend(ins + results)
        return (*outs, *extra)

    events: list[dict] = []
    try:
        mx.export_function(events.append, recorded_fn, *graph_inputs, **keyword_inputs)
    except Exception:  # noqa: BLE001 - the plain trace worked; paths are only a label
        return None
    prims = [ev for ev in events if ev["type"] == "primitive"]
    if not _same_primitives(prims, ops):
        return None
    out_ids = next(ev["outputs"] for ev in events if ev["type"] == "outputs")
    extra_ids = [t[0] for t in out_ids[len(out_ids) - len(extra) :]] if extra else []
    inputs_of = [tuple(i[0] for i in ev["inputs"]) for ev in prims]
    producer = {o[0]: k for k, ev in enumerate(prims) for o in ev["outputs"]}
    if len(prims) > len(ops):  # the extra primitives must be ones the real outputs never read
        real_outputs = [t[0] for t in out_ids[: len(out_ids) - len(extra)]]
        if max(_reached(real_outputs, inputs_of, producer), default=-1) >= len(ops):
            return None
    owner: list[str | None] = [None] * len(prims)
    for path, first, n_in, n_out in calls:
        stop = set(extra_ids[first : first + n_in])
        results = extra_ids[first + n_in : first + n_in + n_out]
        _claim(path, results, stop, inputs_of, producer, owner)
    return [p or STEP for p in owner[: len(ops)]]


def _claim(
    path: str,
    results: list[str],
    stop: set[str],
    inputs_of: list[tuple[str, ...]],
    producer: dict[str, int],
    owner: list[str | None],
) -> None:
    """Give ``path`` the unowned ops between ``results`` and ``stop``; owned ops (inner calls)
    are walked through, not taken."""
    seen: set[int] = set()
    todo = [t for t in results if t not in stop]
    while todo:
        t = todo.pop()
        k = producer.get(t)
        if k is None or k in seen:
            continue  # graph input, weight, state or constant; or done
        seen.add(k)
        if owner[k] is None:
            owner[k] = path
        todo.extend(i for i in inputs_of[k] if i not in stop)


def _reached(tensors: list[str], inputs_of: list[tuple[str, ...]], producer: dict[str, int]):
    """The primitives ``tensors`` depend on."""
    seen: set[int] = set()
    todo = list(tensors)
    while todo:
        k = producer.get(todo.pop())
        if k is not None and k not in seen:
            seen.add(k)
            todo.extend(inputs_of[k])
    return seen


def _same_primitives(prims: list[dict], ops: Sequence[_OpLike]) -> bool:
    from dctms.schema.values import args_to_plain

    # Arrays a call made that nothing returns (a pipeline rank's embedding, replaced by the
    # received hidden state) add primitives, after the plain trace's: those must be its prefix.
    if len(prims) < len(ops):
        return False
    for ev, op in zip(prims, ops, strict=False):
        if ev["name"] != op.primitive or len(ev["outputs"]) != len(op.outputs):
            return False
        if repr(args_to_plain(list(ev["arguments"]))) != repr(op.args):  # NaN-safe
            return False
    return True


def _path_key(path: str) -> tuple:
    # Natural order: layer 2 before layer 10.
    return tuple((0, int(n), "") if n.isdigit() else (1, 0, n) for n in path.split("."))


def build_tree(paths: set[str]) -> tuple[list[int], list[str], dict[str, int]]:
    """(parents, names, node of each path) of the tree holding ``paths`` and their ancestors,
    nodes in natural path order (a parent before its children)."""
    every = {".".join(p.split(".")[:k]) for p in paths for k in range(1, p.count(".") + 2)}
    parents: list[int] = []
    names: list[str] = []
    node: dict[str, int] = {}
    for path in sorted(every, key=_path_key):
        head, _, name = path.rpartition(".")
        node[path] = len(names)
        parents.append(node[head] if head else -1)
        names.append(name)
    return parents, names, node


def runs(op_paths: Sequence[str], node: dict[str, int]) -> tuple[list[int], list[int]]:
    """Run-length code of ``op_paths`` (in plan order): (lengths, modules)."""
    lengths: list[int] = []
    modules: list[int] = []
    for path in op_paths:
        n = node[path]
        if modules and modules[-1] == n:
            lengths[-1] += 1
        else:
            lengths.append(1)
            modules.append(n)
    return lengths, modules


def attach_modules(plan, traced_phases) -> Any:
    """``plan`` with its module tree and every phase's module runs, from the traced phases'
    ``module_paths`` (plan ops are matched to traced ops by their first output). A phase traced
    without paths gets none; a plan without any keeps ``modules`` unset."""
    import msgspec

    from dctms.schema.types import ModuleRuns, ModuleTree

    per_phase: dict[str, list[str]] = {}
    for tp in traced_phases:
        if tp.module_paths is None:
            continue
        by_output = {op.outputs[0]: path for op, path in zip(tp.ops, tp.module_paths, strict=True)}
        phase = next(p for p in plan.phases if p.name == tp.name)
        per_phase[tp.name] = [by_output[op.outputs[0]] for op in phase.ops]
    if not per_phase:
        return plan
    parents, names, node = build_tree({p for paths in per_phase.values() for p in paths})
    phases = []
    for phase in plan.phases:
        if phase.name in per_phase:
            lengths, modules = runs(per_phase[phase.name], node)
            phase = msgspec.structs.replace(phase, modules=ModuleRuns(lengths, modules))
        phases.append(phase)
    return msgspec.structs.replace(
        plan, phases=phases, modules=ModuleTree(parents=parents, names=names)
    )
