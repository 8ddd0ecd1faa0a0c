"""A prompt-prefix pool: KV blocks whose lifetimes span calls (the paper's section 5.6).

``dctms compile ... --prefix-blocks K`` (or ``--prefix-cache SIZE``) adds, beside the slots' KV
(``toolkit.slots``), a pool of K blocks per layer, each ``prefill_chunk`` positions of keys and
values (``kv.<i>.keys.pool`` / ``kv.<i>.values.pool``, shape ``[K, kv_heads, chunk, head_dim]``),
and two phases that copy one block at a time:

* ``save_block``: positions ``position .. position + chunk`` of slot ``slot`` into pool block
  ``block`` (a ``DynamicSlice`` of every slot's positions, then of the slot's row, then a
  ``DynamicSliceUpdate`` of the pool at ``block``);
* ``load_block``: pool block ``block`` into slot ``slot`` at ``position`` (a ``DynamicSlice`` of the
  pool, then the ``[slot, position]`` write a prefill chunk makes).

A block is one whole prefill chunk of a prompt, at a chunk-aligned position: what the runner loads
is bit for bit what the prefill of the same tokens wrote there (the same call at the same point), so
a request that reuses a cached prefix and prefills only the rest generates exactly the ids it
generates without the cache. The pool never grows: it is state of fixed size, counted in M_KV, and
the runner evicts its least recently used block when it needs one (``runner.prefix_cache``).

Every slice start is a single value on one axis (slot, position or block), so the verifier bounds
each by the range the runner feeds (``schema.rules_index``).
"""

from __future__ import annotations

import mlx.core as mx

from dctms.schema.errors import DctmsError
from dctms.schema.sizes import nbytes
from dctms.schema.values import dtype_name
from dctms.toolkit.trace import PhaseTracer, TracedPhase, _export

SAVE, LOAD = "save_block", "load_block"
POOL_SUFFIX = ".pool"
FEEDS = ("slot", "position", "block")


def pool_name(state: str) -> str:
    return state + POOL_SUFFIX


def block_bytes(tracer: PhaseTracer, chunk: int) -> int:
    """Bytes of one pool block over every layer: ``chunk`` positions of keys and values."""
    total = 0
    for a in tracer.layout.arrays:
        b, h, _, d = a.shape
        total += nbytes((1, h, chunk, d), dtype_name(a.dtype))
    return total


def resolve_blocks(tracer: PhaseTracer, chunk: int, blocks: int, cache_bytes: int | None) -> int:
    """K from ``--prefix-blocks`` or from ``--prefix-cache SIZE`` (as many whole blocks as fit)."""
    if cache_bytes is None:
        return blocks
    one = block_bytes(tracer, chunk)
    if cache_bytes < one:
        raise DctmsError(
            f"--prefix-cache {cache_bytes:,} B holds no block: one block ({chunk} positions of "
            f"every layer's keys and values) is {one:,} B"
        )
    return cache_bytes // one


def check_supported(tracer: PhaseTracer) -> None:
    """The pool copies a full float KV cache's positions: other caches are not planned."""
    layout = tracer.layout
    if layout.quant is not None or any(r is not None for r in layout.rings):
        raise DctmsError(
            "--prefix-blocks is not supported yet with a quantised, sliding-window or recurrent "
            "KV cache"
        )


def pool_arrays(tracer: PhaseTracer, blocks: int, chunk: int) -> dict[str, mx.array]:
    """The pool's zero-cost tracing arrays, by state name."""
    out = {}
    for a in tracer.layout.arrays:
        _, h, _, d = a.shape
        out[pool_name(a.name)] = mx.broadcast_to(mx.zeros((), a.dtype), (blocks, h, chunk, d))
    return out


def trace_block_phases(tracer: PhaseTracer, blocks: int, chunk: int) -> list[TracedPhase]:
    """``save_block`` and ``load_block`` over the tracer's KV state and a pool of ``blocks``."""
    names = [a.name for a in tracer.layout.arrays]
    pools = pool_arrays(tracer, blocks, chunk)
    kv = {n: tracer.state[n] for n in names}
    feeds = {name: mx.array(0, mx.int32) for name in FEEDS}

    def save(slot, position, block, **kw):
        out = []
        for n in names:
            b, h, _, d = kw[n].shape
            positions = mx.slice(kw[n], position.reshape(1), axes=(2,), slice_size=(b, h, chunk, d))
            row = mx.slice(positions, slot.reshape(1), axes=(0,), slice_size=(1, h, chunk, d))
            out.append(mx.slice_update(kw[pool_name(n)], row, block.reshape(1), axes=(0,)))
        return tuple(out)

    def load(slot, position, block, **kw):
        out = []
        for n in names:
            _, h, _, d = kw[n].shape
            piece = mx.slice(
                kw[pool_name(n)], block.reshape(1), axes=(0,), slice_size=(1, h, chunk, d)
            )
            start = mx.concatenate([slot.reshape(1), position.reshape(1)])
            out.append(mx.slice_update(kw[n], piece, start, axes=(0, 2)))
        return tuple(out)

    state = {**kv, **pools}
    return [
        _export(SAVE, chunk, save, feeds, {}, state, [pool_name(n) for n in names], results=()),
        _export(LOAD, chunk, load, feeds, {}, state, names, results=()),
    ]
