"""A tensor-parallel rank's weights, cut from the stored tensors without reading them whole.

``RankShard`` says how (mlx.nn's ``_shard``: split along ``axis`` into ``segments``, each into
``parts``, keep part ``index`` of each, concatenated). The stored tensor is memory-mapped and only
the slice is copied into MLX, so loading a rank adds one shard, not one full tensor, to MLX's
memory (mlx-lm's own sharded load reads each full tensor before slicing it).

This module must not import mlx-lm or ``dctms.toolkit``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx

from dctms.schema.errors import DctmsError
from dctms.schema.types import RankShard, WeightTensor

# safetensors dtype -> (numpy dtype to map the bytes as, MLX dtype to view them as)
_MAPPED = {
    "F32": ("float32", mx.float32),
    "F16": ("float16", mx.float16),
    "BF16": ("uint16", mx.bfloat16),
    "U32": ("uint32", mx.uint32),
    "I32": ("int32", mx.int32),
    "U8": ("uint8", mx.uint8),
    "I8": ("int8", mx.int8),
    "U16": ("uint16", mx.uint16),
    "I16": ("int16", mx.int16),
    "U64": ("uint64", mx.uint64),
    "I64": ("int64", mx.int64),
}


def tensor_offsets(path: Path) -> tuple[int, dict[str, dict]]:
    """(byte where the data starts, header entries by name) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n, {k: v for k, v in header.items() if k != "__metadata__"}


def read_shard(path: Path, start: int, entry: dict, w: WeightTensor) -> mx.array:
    """The rank's slice of one stored tensor, as an evaluated MLX array."""
    import numpy as np

    s: RankShard = w.shard
    mapped = _MAPPED.get(entry["dtype"])
    if mapped is None:
        raise DctmsError(f"{path}: cannot shard {w.name} stored as {entry['dtype']}")
    np_dtype, mx_dtype = mapped
    begin = start + entry["data_offsets"][0]
    full = np.memmap(path, dtype=np_dtype, mode="r", offset=begin, shape=tuple(entry["shape"]))
    pieces = [
        np.split(segment, s.parts, axis=s.axis)[s.index]
        for segment in np.split(full, s.segments, axis=s.axis)
    ]
    part = np.ascontiguousarray(np.concatenate(pieces, axis=s.axis))
    array = mx.array(part)
    if array.dtype != mx_dtype:
        array = array.view(mx_dtype)
    mx.eval(array)
    if list(array.shape) != w.shape:
        raise DctmsError(
            f"{path}: the shard of {w.name} is {list(array.shape)}, the plan has {w.shape}"
        )
    return array
