"""Weights a model fills in from others when it loads, as the model class's own ``sanitize`` does.

mlx-lm's and mlx-vlm's ``load`` pass the stored tensors through the model class's ``sanitize``
before the model reads them: real Gemma 3 checkpoints have no ``language_model.lm_head.weight``,
and mlx-vlm's ``sanitize`` sets it to the embedding. The compiler runs that same ``sanitize`` on
placeholders of the stored tensors (lazy arrays of their shapes and dtypes: nothing is read or
allocated) and learns which parameter is which stored tensor unchanged. The plan then binds such a
parameter to the stored tensor by name (the runner, which imports no model code, loads it once
and binds it twice), so nothing about the model class is needed at run time.

A ``sanitize`` that transforms a tensor (a transposed convolution kernel, a split projection)
makes a new array: the parameter keeps its own name and the stored tensor must already have the
model's shape, as before.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import replace

import mlx.core as mx

from dctms.schema.fingerprint import HeaderTensor
from dctms.toolkit.trace import Traced


def stored_sources(model, headers: Iterable[HeaderTensor]) -> dict[str, str]:
    """Parameter name -> the stored tensor ``model.sanitize`` gives it unchanged, for the names
    the stored tensors lack (empty when the class has no ``sanitize``)."""
    sanitizers = _sanitizers(model)
    if not sanitizers:
        return {}
    placeholders = {}
    for h in headers:
        dtype = getattr(mx, h.dtype, None)
        if not isinstance(dtype, mx.Dtype):
            return {}  # a dtype MLX cannot hold: the fingerprint refuses it by name
        placeholders[h.name] = mx.zeros(tuple(h.shape), dtype=dtype)  # lazy: never evaluated
    by_identity = {id(v): k for k, v in placeholders.items()}
    try:
        sanitized = dict(placeholders)
        for sanitize in sanitizers:
            sanitized = sanitize(sanitized)
    except Exception:  # noqa: BLE001 - a sanitize that needs real values: nothing learned
        return {}
    return {
        name: by_identity[id(value)]
        for name, value in sanitized.items()
        if name not in placeholders and id(value) in by_identity
    }


def _sanitizers(model) -> list:
    """The ``sanitize`` calls a load makes, in its order: the model's own, then (mlx-vlm) those of
    its vision, language and audio parts (``mlx_vlm.utils.load_model``)."""
    found = [model.sanitize] if hasattr(model, "sanitize") else []
    package = sys.modules.get(type(model).__module__.rpartition(".")[0])
    children = list(model.children().values()) if hasattr(model, "children") else []
    for part in ("VisionModel", "LanguageModel", "AudioModel"):
        cls = getattr(package, part, None)
        for child in children:
            if isinstance(cls, type) and isinstance(child, cls) and hasattr(child, "sanitize"):
                found.append(child.sanitize)
                break
    return found


def bind_to_stored(traced: Traced, sources: dict[str, str]) -> Traced:
    """``traced`` with every weight binding named in ``sources`` bound to its stored tensor (a
    weight listed once: the stored one)."""
    if not sources:
        return traced

    def rebound(b):
        return replace(b, name=sources[b.name]) if b.kind == "weight" and b.name in sources else b

    weights, seen = [], set()
    for b in map(rebound, traced.weights):
        if b.name not in seen:
            seen.add(b.name)
            weights.append(b)
    return replace(traced, weights=weights, phases=[_merged(tp, rebound) for tp in traced.phases])


def _merged(tp, rebound):
    """The phase with its weight bindings rebound; two bindings of one stored tensor become one
    (the ops read the first)."""
    inputs, first, alias = [], {}, {}
    for b in map(rebound, tp.inputs):
        key = (b.kind, b.name)
        if b.kind == "weight" and key in first:
            alias[b.id] = first[key]
            continue
        first.setdefault(key, b.id)
        inputs.append(b)
    if not alias:
        return replace(tp, inputs=inputs)
    ops = [replace(op, inputs=tuple(alias.get(t, t) for t in op.inputs)) for op in tp.ops]
    return replace(tp, inputs=inputs, ops=ops)
