"""Prefill's last decoder layer: its attention's queries and its feed-forward block run on the
one row the next token needs.

A prefill chunk returns the greedy next token of its last real row only. Every layer but the last
must run on every row (the next layer's keys and values read them), and so must the last layer's
attention (its keys and values fill the cache). After that attention nothing mixes rows: the last
layer's feed-forward block, its residual add and the final norm act on each row alone. So the
feed-forward block is fed only the picked row (a DynamicSlice at ``last_index``); its [batch, 1,
hidden] result is broadcast by the layer's own residual add, whose picked row is exactly
``h[last] + mlp(norm(h[last]))``, the value the full computation gives there; the other rows are
never read (``trace._PickLast`` keeps the picked row only).

The same holds inside the last layer's attention once its keys and values are written: each
query row attends on its own. While the last layer runs, ``mx.fast.scaled_dot_product_attention``
(the call mlx-lm's attention makes; on the CPU a decomposition: scores, mask, softmax, values) is
given the picked query row and its mask row only, and its [batch, heads, 1, head_dim] result is
broadcast back over the rows, which the layer reshapes and projects as before: the picked row's
value is unchanged, the others are copies never read.

What this saves is the last layer's attention scores and feed-forward over ``chunk - 1`` rows --
what mlx-lm skips by laziness when it evaluates only the cache of all but the prompt's last token
(its ``generate_step``), without its second pass over the weights for that token. On a 4-layer
model that is most of a quarter of the prefill; on SmolLM2's 30 layers, about a thirtieth.

Applied only where it is known to hold: the inner model's last entry of ``layers`` has one of the
feed-forward attributes below, and the model is not split into pipeline stages (a stage's output
rows all go to the next stage). An attention call with a mask that is not an array with one row
per query (mlx-lm's "causal" string), or another kernel (a quantised cache's), runs as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

# The attribute names mlx-lm's decoder layers give their feed-forward block.
FEED_FORWARD_NAMES = ("mlp", "feed_forward", "block_sparse_moe")


Pick = Callable[[mx.array, int], mx.array]  # (array, axis) -> the picked index along that axis


class _OnPickedRow:
    """Stands in for a feed-forward module: calls it on the picked row of its input."""

    def __init__(self, inner: nn.Module, pick: Pick):
        self._inner, self._pick = inner, pick

    def __call__(self, x: mx.array, *args, **kwargs):
        if not isinstance(x, mx.array) or x.ndim != 3:
            return self._inner(x, *args, **kwargs)
        return self._inner(self._pick(x, 1), *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class _QueriesOnPickedRow:
    """Stands in for the last layer: while it runs, attention is computed for the picked query."""

    def __init__(self, layer: nn.Module, pick: Pick):
        self._layer, self._pick = layer, pick

    def __call__(self, *args, **kwargs):
        fast = mx.fast
        real = fast.scaled_dot_product_attention
        pick = self._pick

        def one_query(queries, keys, values, *rest, mask=None, **kw):
            rows = queries.shape[2] if isinstance(queries, mx.array) and queries.ndim == 4 else 0
            per_row = isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] == rows
            if rows <= 1 or rest or not (mask is None or per_row):
                return real(queries, keys, values, *rest, mask=mask, **kw)
            if per_row:
                mask = pick(mask, mask.ndim - 2)
            out = real(pick(queries, 2), keys, values, mask=mask, **kw)
            b, h, _, d = out.shape
            return mx.broadcast_to(out, (b, h, rows, d))

        fast.scaled_dot_product_attention = one_query
        try:
            return self._layer(*args, **kwargs)
        finally:
            fast.scaled_dot_product_attention = real

    def __getattr__(self, name: str):
        return getattr(self._layer, name)


def _feed_forward_name(layer) -> str | None:
    if not isinstance(layer, nn.Module):
        return None
    for name in FEED_FORWARD_NAMES:
        if isinstance(layer.get(name), nn.Module):
            return name
    return None


@contextmanager
def last_layer_on_picked_row(inner, pick: Pick) -> Iterator[bool]:
    """While active, the last layer of ``inner`` (mlx-lm's ``model.model``) computes attention for
    the picked query row and its feed-forward block on the picked row only; yields whether it
    applies to this model."""
    layers = inner.get("layers") if isinstance(inner, nn.Module) else None
    staged = getattr(inner, "pipeline_size", 1) not in (None, 1)
    name = _feed_forward_name(layers[-1]) if isinstance(layers, list) and layers else None
    if name is None or staged:
        yield False
        return
    last = layers[-1]
    block = last[name]
    setattr(last, name, _OnPickedRow(block, pick))  # a plain object: outside the parameter tree
    layers[-1] = _QueriesOnPickedRow(last, pick)
    try:
        yield True
    finally:
        layers[-1] = last
        setattr(last, name, block)
