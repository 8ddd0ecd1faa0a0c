"""The canonical text layout of a plan document, chosen so that ``git diff`` of a small change is small.

- objects are indented by 2 spaces, keys in the order given (struct field order, see ``io``);
- a list of records (ops, tensors, buffers, bindings, ...) or of lists (slots) has one element per line,
  each written as compact JSON (``{"id":"t0","shape":[1,8],...}``);
- lists of scalars and everything inside a one-line element are compact;
- the lists named in ``EXPANDED_LISTS`` (phases) hold large objects and are laid out like objects.
"""

from __future__ import annotations

from typing import Any

import msgspec

EXPANDED_LISTS = frozenset({"phases"})
_INDENT = "  "


def layout(document: Any) -> str:
    """The canonical text of a JSON-compatible ``document`` (without the trailing newline)."""
    return _value(document, 0)


def _value(value: Any, depth: int) -> str:
    pad = _INDENT * (depth + 1)
    close = _INDENT * depth
    if isinstance(value, dict) and value:
        items = []
        for key, item in value.items():
            text = _expanded(item, depth + 1) if key in EXPANDED_LISTS else _value(item, depth + 1)
            items.append(f"{pad}{_compact(key)}: {text}")
        return "{\n" + ",\n".join(items) + "\n" + close + "}"
    if isinstance(value, list) and value and all(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(pad + _compact(v) for v in value) + "\n" + close + "]"
    return _compact(value)


def _expanded(value: Any, depth: int) -> str:
    """A list of large objects: each element laid out as an indented object."""
    if not isinstance(value, list) or not value:
        return _value(value, depth)
    pad = _INDENT * (depth + 1)
    items = [pad + _value(item, depth + 1) for item in value]
    return "[\n" + ",\n".join(items) + "\n" + _INDENT * depth + "]"


def _compact(value: Any) -> str:
    return msgspec.json.encode(value).decode("utf-8")
