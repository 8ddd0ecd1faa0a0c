"""GGUF files written field by field here (not with MLX's writer), with a map of where each field
lies: so a fuzzer can write any value of any type, lie in any count, length, dimension or offset,
and cut the file anywhere (mx.save_gguf itself refuses or crashes on much of that)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

# Metadata value types (the GGUF specification's numbering) and their little-endian formats.
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
FORMATS = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
           BOOL: "<B", U64: "<Q", I64: "<q", F64: "<d"}  # fmt: skip
F32_TENSOR, F16_TENSOR = 0, 1


@dataclass
class Tensor:
    name: str
    dims: list[int]  # ggml order: innermost first
    type_id: int
    data: bytes


@dataclass
class Gguf:
    metadata: list[tuple[str, int, object]]  # (key, type, value); arrays: (ARRAY, (item, list))
    tensors: list[Tensor]
    alignment: int = 32
    version: int = 3
    fields: list[tuple[int, str, str]] = field(default_factory=list)  # (offset, format, what)

    def encode(self) -> bytes:
        """The file; ``fields`` lists every fixed-size field written, for byte-level lies."""
        self.fields = []
        out = bytearray()

        def put(fmt: str, value, what: str) -> None:
            self.fields.append((len(out), fmt, what))
            out.extend(struct.pack(fmt, value))

        def put_string(text: str | bytes, what: str) -> None:
            raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
            put("<Q", len(raw), f"length of {what}")
            out.extend(raw)

        def put_value(kind: int, value, what: str) -> None:
            if kind == STRING:
                put_string(value, what)
            elif kind == ARRAY:
                item, values = value
                put("<I", item, f"item type of {what}")
                put("<Q", len(values), f"length of {what}")
                for v in values:
                    if item in (STRING, ARRAY):
                        put_value(item, v, what)
                    else:
                        out.extend(struct.pack(FORMATS[item], v))
            else:
                put(FORMATS[kind], value, what)

        out.extend(b"GGUF")
        put("<I", self.version, "version")
        put("<Q", len(self.tensors), "tensor count")
        put("<Q", len(self.metadata), "metadata count")
        for key, kind, value in self.metadata:
            put_string(key, f"key {key}")
            put("<I", kind, f"type of {key}")
            put_value(kind, value, key)
        offset = 0
        offsets = []
        for t in self.tensors:
            offset = -(-offset // self.alignment) * self.alignment
            offsets.append(offset)
            offset += len(t.data)
        for t, at in zip(self.tensors, offsets, strict=True):
            put_string(t.name, f"name of {t.name}")
            put("<I", len(t.dims), f"dimension count of {t.name}")
            for d in t.dims:
                put("<Q", d, f"dimension of {t.name}")
            put("<I", t.type_id, f"type of {t.name}")
            put("<Q", at, f"offset of {t.name}")
        out.extend(bytes(-len(out) % self.alignment))
        start = len(out)
        for t, at in zip(self.tensors, offsets, strict=True):
            out.extend(bytes(start + at - len(out)))
            out.extend(t.data)
        return bytes(out)
