"""JSON encoding of values the MLX exporter hands us: primitive arguments and constant data.

Shared by the compiler (encodes) and the runner (decodes), and free of any mlx import so that the
schema package stays dependency-light: an MLX dtype is recognised by its ``mlx.core.`` spelling.
"""

from __future__ import annotations

import math
from typing import Any


def dtype_name(dtype: Any) -> str:
    """``mx.float32`` -> ``"float32"`` (``mx.bool_`` -> ``"bool"``)."""
    return str(dtype).removeprefix("mlx.core.")


def _is_dtype(value: Any) -> bool:
    return type(value).__name__ == "Dtype" and str(value).startswith("mlx.core.")


def args_to_json(args: Any) -> Any:
    """Encode a primitive's arguments (as the export callback gives them) as JSON values.

    Tuples become lists, an MLX dtype becomes ``{"dtype": "float32"}`` and non-finite floats become
    the strings ``"inf"``, ``"-inf"``, ``"nan"`` (JSON has no such numbers).
    """
    if isinstance(args, (list, tuple)):
        return [args_to_json(a) for a in args]
    if _is_dtype(args):
        return {"dtype": dtype_name(args)}
    if isinstance(args, float) and not math.isfinite(args):
        return "nan" if math.isnan(args) else ("inf" if args > 0 else "-inf")
    return args
