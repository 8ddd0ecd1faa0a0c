"""Values the MLX exporter hands us (primitive arguments, constant data) and their JSON codec.

Shared by the compiler (``args_to_plain`` when tracing), the plan codec (``io``) and the runner, and
free of any mlx import so that the schema package stays dependency-light: an MLX dtype is recognised
by its ``mlx.core.`` spelling.

In memory, ``Op.args`` and ``Constant.value`` hold plain Python values with real floats (inf and nan
included). JSON has no non-finite numbers, so the plan codec -- ``to_json_value`` on encode and
``from_json_value`` on decode, each applied once, by ``io`` -- writes them as the strings "inf",
"-inf" and "nan" at any depth of those two fields. Consequently a genuine string "inf"/"-inf"/"nan"
there reads back as a float. Non-finite floats anywhere else cannot be written.
"""

from __future__ import annotations

import math
from typing import Any

_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def dtype_name(dtype: Any) -> str:
    """``mx.float32`` -> ``"float32"`` (``mx.bool_`` -> ``"bool"``)."""
    return str(dtype).removeprefix("mlx.core.")


def _is_dtype(value: Any) -> bool:
    return type(value).__name__ == "Dtype" and str(value).startswith("mlx.core.")


def args_to_plain(args: Any) -> Any:
    """A primitive's arguments (as the export callback gives them) as plain Python values.

    Tuples become lists and an MLX dtype becomes ``{"dtype": "float32"}``; floats stay floats
    (non-finite ones are the codec's business, see the module docstring).
    """
    if isinstance(args, (list, tuple)):
        return [args_to_plain(a) for a in args]
    if _is_dtype(args):
        return {"dtype": dtype_name(args)}
    return args


def to_json_value(value: Any) -> Any:
    """``value`` with non-finite floats (at any depth) replaced by "inf", "-inf" or "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (list, tuple)):
        return [to_json_value(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json_value(v) for k, v in value.items()}
    return value


def from_json_value(value: Any) -> Any:
    """Inverse of ``to_json_value``: the strings "inf", "-inf", "nan" (at any depth) become floats."""
    if isinstance(value, str):
        return _NON_FINITE.get(value, value)
    if isinstance(value, list):
        return [from_json_value(v) for v in value]
    if isinstance(value, dict):
        return {k: from_json_value(v) for k, v in value.items()}
    return value
