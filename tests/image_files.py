"""PNG files written chunk by chunk: headers that claim any size, with as little data as wanted
(a 30,000 x 30,000 image in a few hundred bytes), for the image-input tests and fuzzers."""

from __future__ import annotations

import struct
import zlib


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(width: int, height: int, rows: bytes | None = None, color_type: int = 2,
        bit_depth: int = 8) -> bytes:
    """A PNG claiming ``width`` x ``height``; ``rows``: the raw (filtered) scanlines to compress,
    by default one black row (a valid image only when ``height`` is 1)."""
    channels = {0: 1, 2: 3, 4: 2, 6: 4}.get(color_type, 1)
    if rows is None:
        rows = b"\x00" + bytes(min(width, 1 << 16) * channels * bit_depth // 8)
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))  # fmt: skip


def black_png(width: int, height: int) -> bytes:
    """A complete black RGB image (every scanline: filter byte 0 then zeros)."""
    return png(width, height, (b"\x00" + bytes(width * 3)) * height)
