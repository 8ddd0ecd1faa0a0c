"""How a plan's KV state is laid out: what grows with the position, what is a fixed-size ring or
recurrent state, and in which layers.

``dctms show``, the inspector and ``dctms diff`` print it; ``dctms bench`` uses it for the bytes a
decode step reads (a ring or a recurrent state is read whole at every step, a full layer's cache
up to the positions attended).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dctms.schema.types import Plan, StateTensor

_LAYER = re.compile(r"^kv\.(\d+)\.")


@dataclass(frozen=True)
class CacheLayout:
    bytes_per_position: int  # full-capacity layers: bytes per cached position, all layers
    ring_bytes: int  # sliding-window rings, with their keep tokens
    recurrent_bytes: int  # mlx-lm ArraysCache state (conv and SSM state)
    ring_layers: tuple[int, ...]
    recurrent_layers: tuple[int, ...]
    windows: tuple[tuple[int, int, int], ...]  # distinct (window, slots, keep) of the rings

    @property
    def fixed_bytes(self) -> int:
        """What a decode step reads whole, whatever the position."""
        return self.ring_bytes + self.recurrent_bytes


def _layer(s: StateTensor) -> int | None:
    m = _LAYER.match(s.name)
    return int(m.group(1)) if m else None


def cache_layout(plan: Plan) -> CacheLayout:
    capacity = plan.bounds.kv_capacity
    per_position = ring_bytes = recurrent_bytes = 0
    rings: set[int] = set()
    recurrent: set[int] = set()
    windows: set[tuple[int, int, int]] = set()
    for s in plan.state:
        if s.kind != "kv":
            continue
        layer = _layer(s)
        if s.window is not None:
            ring_bytes += s.bytes
            windows.add((s.window.window, s.window.slots, s.window.keep))
            rings.update([layer] if layer is not None else [])
        elif s.recurrent:
            recurrent_bytes += s.bytes
            recurrent.update([layer] if layer is not None else [])
        elif len(s.shape) >= 3 and s.shape[2] == capacity:
            # [batch, heads, positions, ...]: the float prefix of a quantised cache
            # (quantized_kv_start) has fewer positions and is read only by the calls below it
            per_position += s.bytes // capacity
    return CacheLayout(
        per_position,
        ring_bytes,
        recurrent_bytes,
        tuple(sorted(rings)),
        tuple(sorted(recurrent)),
        tuple(sorted(windows)),
    )


def cache_rows(plan: Plan) -> list[tuple[str, str]]:
    """(label, value) rows for the layers whose cache is not a full-capacity KV cache."""
    layout, layers = cache_layout(plan), plan.model.num_layers
    rows = []
    if layout.ring_layers:
        rings = "; ".join(
            f"window {w}, ring of {slots} slots" + (f", keep {keep}" if keep else "")
            for w, slots, keep in layout.windows
        )
        rows.append(("sliding window", f"{rings} in {len(layout.ring_layers)} of {layers} layers"))
    if layout.recurrent_layers:
        rows.append(
            (
                "recurrent state",
                f"{len(layout.recurrent_layers)} of {layers} layers, "
                f"{layout.recurrent_bytes:,} bytes whatever the length",
            )
        )
    return rows


def cache_summary(plan: Plan) -> str | None:
    """One line for ``dctms diff``; None for a plan whose every layer has a full KV cache."""
    rows = cache_rows(plan)
    return "; ".join(f"{name}: {value}" for name, value in rows) if rows else None
