"""The static KV cache of a batched plan: B slots of N + M positions each (llama.cpp's slot model).

A slot holds one sequence from its first prompt token to its last generated one. Two cache objects
speak mlx-lm's cache protocol over the same ``[B, kv_heads, capacity, head_dim]`` state arrays:

* ``SlotKVCache`` -- a prefill chunk of *one* sequence: written into row ``slot`` at ``position``
  (one ``DynamicSliceUpdate`` whose start is ``[slot, position]``), attention over that row's first
  ``window`` positions (a ``DynamicSlice`` of the row). Joining sequences are prefilled this way,
  chunk by chunk, between decode steps.
* ``RowsKVCache`` -- one decode step of the first ``rows`` slots, each at its own position: the
  new key/value of row r goes to ``[r, :, positions[r]]`` (one ``Scatter``, in place on the donated
  state), RoPE is offset per row, and row r's mask admits positions ``<= positions[r]``. ``rows`` is
  a length (``toolkit.lengths``): a step with three busy slots computes three rows, not B.

Both keep every write inside the state: the runner bounds ``slot < B``, ``rows <= B`` and every
position below the capacity, and the verifier checks the plan's shapes hold them
(``schema.access``).
"""

from __future__ import annotations

import mlx.core as mx

SLOT, POSITIONS, ROWS = "slot", "positions", "rows"


class SlotKVCache:
    """One sequence's prefill chunk into row ``slot`` of the batched state."""

    def __init__(self, keys: mx.array, values: mx.array, position: mx.array, window: int, slot):
        self.keys, self.values, self.offset, self.window, self.slot = (
            keys,
            values,
            position,
            window,
            slot,
        )

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        start = mx.concatenate([self.slot.reshape(1), self.offset.reshape(1)])
        self.keys = mx.slice_update(self.keys, k, start, axes=(0, 2))
        self.values = mx.slice_update(self.values, v, start, axes=(0, 2))
        return self._row(self.keys), self._row(self.values)

    def _row(self, state: mx.array) -> mx.array:
        _, heads, _, dim = state.shape
        size = (1, heads, self.window, dim)
        return mx.slice(state, self.slot.reshape(1), axes=(0,), slice_size=size)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        queries = (self.offset + mx.arange(n))[:, None]
        return queries >= mx.arange(self.window)[None]

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False


class RowsKVCache:
    """One decode step of rows ``0 .. rows - 1``, row r at ``positions[r]``."""

    def __init__(self, keys: mx.array, values: mx.array, positions: mx.array, window: int):
        self.keys, self.values, self.window = keys, values, window
        self.offset = positions  # RoPE's offset, one per row

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        rows, heads = k.shape[0], k.shape[1]
        at = (mx.arange(rows)[:, None], mx.arange(heads)[None, :], self.offset[:, None])
        self.keys[at] = k[:, :, 0, :]
        self.values[at] = v[:, :, 0, :]
        return self.keys[:rows, :, : self.window, :], self.values[:rows, :, : self.window, :]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        seen = mx.arange(self.window)[None] <= self.offset[:, None]
        return seen[:, None, None, :]

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False
