"""A GGUF file's header (metadata and tensor table), read and checked against the GGUF
specification before anything else reads the file.

MLX's GGUF reader (gguflib) trusts every length, count and offset in the file: a string or an
array running past the end is read out of bounds, ``general.alignment`` 0 divides by zero (SIGFPE),
a tensor with no dimension or more than four corrupts memory. So this reader walks the whole header
itself and refuses, in one line naming the field and its value, anything the specification does
not allow or that does not fit in the file. Layout (GGUF v2/v3, little-endian): magic, version,
tensor count, metadata count, the metadata key/values, one record per tensor (name, dimensions
innermost first, type, offset), padding to the alignment, the tensor data.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
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
# (weights per block, bytes per block) of the types whose storage size is checked here (ggml.c's
# type traits); a type not listed is not read by the converter, which refuses it by name.
BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34), 24: (1, 1), 25: (1, 2),
          26: (1, 4), 27: (1, 8), 28: (1, 8), 30: (1, 2)}  # fmt: skip

# Metadata value types (the specification's gguf_metadata_value_type).
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALARS = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
            BOOL: "<B", U64: "<Q", I64: "<q", F64: "<d"}  # fmt: skip
INTEGER_TYPES = frozenset({U8, I8, U16, I16, U32, I32, U64, I64})
FLOAT_TYPES = frozenset({F32, F64})
VALUE_TYPE_NAMES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool",
                    "string", "array", "uint64", "int64", "float64")  # fmt: skip

DEFAULT_ALIGNMENT = 32  # the specification's default when general.alignment is absent
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSOR_NAME = 64  # GGML_MAX_NAME, terminator included in ggml; the specification says 64
MAX_KEY = 2**16 - 1  # the specification's bound on a key's length
MAX_DIM = 2**31 - 1  # MLX's shapes are int32


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # MLX order (ggml stores dimensions innermost first)
    type_id: int
    offset: int = 0  # from the start of the tensor data

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.type_id, f"type {self.type_id}")


@dataclass(frozen=True)
class GgufValue:
    """One metadata value: ``type`` a value type; ``value`` a Python int, float, bool or str, or
    for an array (``item_type`` set) a list of them."""

    type: int
    value: object
    item_type: int | None = None

    @property
    def type_name(self) -> str:
        name = VALUE_TYPE_NAMES[self.type]
        return f"array of {VALUE_TYPE_NAMES[self.item_type]}" if self.item_type is not None else name


@dataclass
class GgufHeader:
    version: int
    metadata: dict[str, GgufValue] = field(default_factory=dict)
    tensors: list[GgufTensor] = field(default_factory=list)
    alignment: int = DEFAULT_ALIGNMENT
    data_start: int = 0


def read_header(path: Path) -> GgufHeader:
    """The header of ``path``, every length, count, type, dimension and offset checked."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            return _Reader(f, size, path).header()
    except OSError as err:
        raise DctmsError(f"{path}: cannot read: {err.strerror}") from None


class _Reader:
    def __init__(self, f: BinaryIO, size: int, path: Path) -> None:
        self.f, self.size, self.path, self.pos = f, size, path, 0

    def fail(self, why: str) -> DctmsError:
        return DctmsError(f"{self.path}: not a valid GGUF file: {why}")

    def header(self) -> GgufHeader:
        if self.read(4, "the magic") != b"GGUF":
            raise DctmsError(f"{self.path}: not a GGUF file (no GGUF magic)")
        version = self.scalar(U32, "the version")
        if version not in (2, 3):
            raise DctmsError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors = self.scalar(U64, "the tensor count")
        n_kv = self.scalar(U64, "the metadata count")
        # every tensor record takes at least 24 bytes and every key/value at least 13
        if n_tensors * 24 > self.size:
            raise self.fail(f"tensor count {n_tensors} does not fit in the file")
        if n_kv * 13 > self.size:
            raise self.fail(f"metadata count {n_kv} does not fit in the file")
        head = GgufHeader(version)
        for _ in range(n_kv):
            key = self.string("a metadata key", MAX_KEY)
            if key in head.metadata:
                raise self.fail(f"metadata key {key} appears twice")
            head.metadata[key] = self.value(key)
        head.alignment = self._alignment(head.metadata)
        names: set[str] = set()
        for _ in range(n_tensors):
            tensor = self.tensor()
            if tensor.name in names:
                raise self.fail(f"tensor {tensor.name} appears twice")
            names.add(tensor.name)
            head.tensors.append(tensor)
        head.data_start = -(-self.pos // head.alignment) * head.alignment
        for t in head.tensors:
            self._check_data(t, head)
        return head

    def _alignment(self, metadata: dict[str, GgufValue]) -> int:
        entry = metadata.get("general.alignment")
        if entry is None:
            return DEFAULT_ALIGNMENT
        if entry.type != U32:
            raise self.fail(f"general.alignment is a {entry.type_name}, not a uint32")
        value = int(entry.value)  # type: ignore[call-overload]
        if value <= 0 or value & (value - 1):
            raise self.fail(f"general.alignment = {value} is not a power of two")
        return value

    def tensor(self) -> GgufTensor:
        name = self.string("a tensor name", MAX_TENSOR_NAME)
        ndim = self.scalar(U32, f"tensor {name}'s dimension count")
        if not 1 <= ndim <= MAX_DIMS:
            raise self.fail(f"tensor {name} has {ndim} dimensions (1 to {MAX_DIMS})")
        dims = [self.scalar(U64, f"tensor {name}'s dimensions") for _ in range(ndim)]
        if any(d < 1 for d in dims):
            raise self.fail(f"tensor {name} has a dimension of 0 ({dims}, innermost first)")
        if any(d > MAX_DIM for d in dims):
            raise self.fail(f"tensor {name} has a dimension above 2^31 - 1 ({dims})")
        type_id = self.scalar(U32, f"tensor {name}'s type")
        if type_id not in TYPE_NAMES:
            raise self.fail(f"tensor {name} has type id {type_id}, not a ggml type")
        offset = self.scalar(U64, f"tensor {name}'s offset")
        return GgufTensor(name, tuple(reversed(dims)), type_id, offset)

    def _check_data(self, t: GgufTensor, head: GgufHeader) -> None:
        if t.offset % head.alignment:
            raise self.fail(
                f"tensor {t.name}'s offset {t.offset} is not a multiple of the alignment "
                f"{head.alignment}"
            )
        if t.type_id not in BLOCKS:
            return  # a type the converter refuses by name before reading any data
        per_block, block_bytes = BLOCKS[t.type_id]
        if t.shape[-1] % per_block:
            raise self.fail(
                f"tensor {t.name} ({t.type_name}) has {t.shape[-1]} weights per row, not a "
                f"multiple of its block of {per_block}"
            )
        count = 1
        for d in t.shape:
            count *= d
        end = head.data_start + t.offset + count // per_block * block_bytes
        if end > self.size:
            raise self.fail(
                f"tensor {t.name} {list(t.shape)} ({t.type_name}) ends at byte {end}, past the "
                f"end of the file ({self.size} bytes)"
            )

    # ------------------------------------------------------------------------ values

    def value(self, key: str, depth: int = 0) -> GgufValue:
        kind = self.scalar(U32, f"the type of {key}")
        if kind in _SCALARS:
            return GgufValue(kind, self.scalar(kind, key))
        if kind == STRING:
            return GgufValue(kind, self.string(key, self.size))
        if kind != ARRAY:
            raise self.fail(f"metadata {key} has value type {kind}, not a GGUF type")
        item = self.scalar(U32, f"the item type of {key}")
        count = self.scalar(U64, f"the length of {key}")
        if item == ARRAY:
            raise self.fail(f"metadata {key} is an array of arrays (MLX reads one level)")
        if item in _SCALARS:
            width = struct.calcsize(_SCALARS[item])
            data = self.read(count * width, key)
            values = [v for (v,) in struct.iter_unpack(_SCALARS[item], data)]
            if item == BOOL:
                self._check_bools(values, key)
                values = [bool(v) for v in values]
            return GgufValue(kind, values, item)
        if item != STRING:
            raise self.fail(f"metadata {key} is an array of value type {item}, not a GGUF type")
        if count * 8 > self.size - self.pos:
            raise self.fail(f"metadata {key} has {count} strings, more than the file holds")
        return GgufValue(kind, [self.string(key, self.size) for _ in range(count)], item)

    def _check_bools(self, values: list[int], key: str) -> None:
        bad = next((v for v in values if v > 1), None)
        if bad is not None:
            raise self.fail(f"metadata {key} holds the bool {bad} (0 or 1)")

    def scalar(self, kind: int, what: str) -> int | float | bool:
        fmt = _SCALARS[kind]
        (value,) = struct.unpack(fmt, self.read(struct.calcsize(fmt), what))
        if kind == BOOL:
            self._check_bools([value], what)
            return bool(value)
        return value

    def string(self, what: str, limit: int) -> str:
        n = self.scalar(U64, what)
        if n > limit:
            raise self.fail(f"{what} of {n} bytes (at most {limit})")
        data = self.read(n, what)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8 ({data[:40]!r})") from None

    def read(self, n: int, what: str) -> bytes:
        if n > self.size - self.pos:
            raise DctmsError(
                f"{self.path}: not a GGUF file (header ends early: {what} at byte {self.pos} "
                f"needs {n} bytes, the file has {self.size})"
            )
        data = self.f.read(n)
        if len(data) != n:
            raise DctmsError(f"{self.path}: not a GGUF file (header ends early)")
        self.pos += n
        return data
