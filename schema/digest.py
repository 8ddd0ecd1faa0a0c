"""The plan digest: sha256 of the plan's canonical body, stored in the plan as ``digest``.

``io.encode_plan`` writes it; ``io.decode_plan`` recomputes it from the decoded plan and refuses a
plan whose digest is missing or differs, so every reader (validate, show, run, bench, diff, ...)
notices a plan changed after it was written.

What it protects against: any change to a plan file made without re-stamping it -- a hand edit
(``"Add"`` -> ``"Subtract"``), a merge or a tool that rewrites a field, truncation, bit rot. The body
is canonical (``io`` layout of the decoded plan), so re-indenting or reordering keys is no change.

What it does not protect against: it is a checksum, not a signature -- anyone can recompute it
(``stamp`` does), so a deliberate edit that re-stamps passes; nor does it say the plan matches a
model (the runner's weights fingerprint does, and ``dctms check`` re-compiles a plan against its
model folder) or that the compiler was right (the verifier re-derives what it can).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from dctms.schema.layout import layout

FIELD = "digest"


def body_sha256(document: dict[str, Any]) -> str:
    """sha256 of the canonical text of ``document`` without its digest field."""
    body = {k: v for k, v in document.items() if k != FIELD}
    return hashlib.sha256((layout(body) + "\n").encode("utf-8")).hexdigest()


def stamp(document: dict[str, Any]) -> bytes:
    """The canonical bytes of a plan document (already in JSON values, keys in field order) with
    its digest set, as the last field."""
    body = {k: v for k, v in document.items() if k != FIELD}
    body[FIELD] = body_sha256(body)
    return (layout(body) + "\n").encode("utf-8")


def duplicate_key(data: bytes) -> str | None:
    """A description of the first key that appears twice in one object of the JSON document
    ``data`` (the key and the object's other keys), or None. msgspec, like most JSON readers, keeps
    the last of the two, so an edit could hide behind the first."""
    found: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in items:
            if key in seen and not found:
                keys = ", ".join(dict.fromkeys(k for k, _ in items))
                found.append(f"duplicate key {key!r} in the object with keys {{{keys[:120]}}}")
            seen.add(key)
        return dict(items)

    try:
        json.loads(data, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return None  # not JSON: msgspec has said so already
    return found[0] if found else None
