"""The tensor table of a GGUF file (name, shape, storage type), read from its header only.

``mx.load`` turns Q4_0/Q4_1/Q8_0 tensors into MLX's quantised triplets and quietly dequantises every
other block type to float16; the converter reads the table first so that it can name a type it does
not convert instead. Layout (GGUF v2/v3, little-endian): magic, version, tensor count, metadata count,
the metadata key/values (skipped), then one record per tensor.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from dctms.schema.errors import DctmsError

# ggml's tensor type ids (ggml.h, enum ggml_type).
TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
    34: "TQ1_0", 35: "TQ2_0",
}  # fmt: skip

# Metadata value types: fixed sizes; 8 = string, 9 = array.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_COUNT = 2**32  # far above any real file; a larger count means a corrupt header


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # MLX order (ggml stores dimensions innermost first)
    type_id: int

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.type_id, f"type {self.type_id}")


def read_tensor_table(path: Path) -> list[GgufTensor]:
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise DctmsError(f"{path}: not a GGUF file (no GGUF magic)")
            version = _u32(f, path)
            if version not in (2, 3):
                raise DctmsError(f"{path}: GGUF version {version} is not supported (2 or 3)")
            n_tensors, n_kv = _u64(f, path), _u64(f, path)
            if n_tensors > _MAX_COUNT or n_kv > _MAX_COUNT:
                raise DctmsError(f"{path}: not a GGUF file (absurd counts in the header)")
            for _ in range(n_kv):
                _skip_string(f, path)
                _skip_value(f, path, _u32(f, path))
            tensors = []
            for _ in range(n_tensors):
                name = _string(f, path)
                ndim = _u32(f, path)
                if ndim > 8:
                    raise DctmsError(f"{path}: tensor {name} has {ndim} dimensions")
                dims = [_u64(f, path) for _ in range(ndim)]
                type_id = _u32(f, path)
                _u64(f, path)  # data offset
                tensors.append(GgufTensor(name, tuple(reversed(dims)), type_id))
            return tensors
    except OSError as err:
        raise DctmsError(f"{path}: cannot read: {err.strerror}") from None


def _read(f: BinaryIO, n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise DctmsError(f"{path}: not a GGUF file (header ends early)")
    return data


def _u32(f: BinaryIO, path: Path) -> int:
    return struct.unpack("<I", _read(f, 4, path))[0]


def _u64(f: BinaryIO, path: Path) -> int:
    return struct.unpack("<Q", _read(f, 8, path))[0]


def _string(f: BinaryIO, path: Path) -> str:
    n = _u64(f, path)
    if n > _MAX_COUNT:
        raise DctmsError(f"{path}: not a GGUF file (string of {n} bytes)")
    return _read(f, n, path).decode("utf-8", errors="replace")


def _skip_string(f: BinaryIO, path: Path) -> None:
    n = _u64(f, path)
    if n > _MAX_COUNT:
        raise DctmsError(f"{path}: not a GGUF file (string of {n} bytes)")
    f.seek(n, 1)


def _skip_value(f: BinaryIO, path: Path, kind: int) -> None:
    if kind in _FIXED:
        f.seek(_FIXED[kind], 1)
    elif kind == _STRING:
        _skip_string(f, path)
    elif kind == _ARRAY:
        item, count = _u32(f, path), _u64(f, path)
        if count > _MAX_COUNT:
            raise DctmsError(f"{path}: not a GGUF file (array of {count} items)")
        if item in _FIXED:
            f.seek(_FIXED[item] * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, path, item)
    else:
        raise DctmsError(f"{path}: not a GGUF file (metadata value type {kind})")
