"""Identity of a model: config hash and weights fingerprint, shared by the compiler and the runner.

The plan records these; the runner recomputes them from the weights folder and refuses a mismatch
before allocating anything. safetensors headers are parsed by hand (8-byte length + JSON), which
costs a few kilobytes whatever the model size.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from dctms.schema.errors import DctmsError, short_value

# safetensors dtype tags -> MLX dtype names
_SAFETENSORS_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
}

_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "float16": 2, "bfloat16": 2,
    "uint32": 4, "int32": 4, "float32": 4, "uint64": 8, "int64": 8, "float64": 8,
}

# The largest safetensors header we accept; real ones are well under a megabyte.
_MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class HeaderTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    file: str
    start: int = -1  # where its data begins in the file (bytes from its start); -1: not a file's


def canonical_config_sha256(config: dict) -> str:
    """sha256 of the config's canonical JSON, so key order and whitespace do not matter."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def config_differences(given: dict, recorded: dict, most: int = 3) -> str:
    """What differs between two configs, key by key, given first: ``model_type 'llama' vs 'qwen2',
    num_hidden_layers 4 vs 2`` (at most ``most`` keys, then ``+N more``); "" when they agree."""
    absent = object()
    keys = sorted(
        k for k in set(given) | set(recorded) if given.get(k, absent) != recorded.get(k, absent)
    )

    def shown(config: dict, key: str) -> str:
        return short_value(config[key]) if key in config else "absent"

    parts = [f"{k} {shown(given, k)} vs {shown(recorded, k)}" for k in keys[:most]]
    more = f" (+{len(keys) - most} more)" if len(keys) > most else ""
    return ", ".join(parts) + more


def read_config(config_path: Path) -> dict:
    """A model's config.json as a dict; a missing, unreadable or non-JSON file is a one-line error."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DctmsError(f"{config_path.parent}: no config.json") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DctmsError(f"{config_path}: cannot read: {err}") from None
    except json.JSONDecodeError as err:
        raise DctmsError(f"{config_path}: not valid JSON: {err.msg} at line {err.lineno}") from None
    except RecursionError:
        raise DctmsError(f"{config_path}: nested too deeply") from None
    except ValueError as err:  # a number of more than 4,300 digits
        raise DctmsError(f"{config_path}: not valid JSON: {str(err)[:80]}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise DctmsError(f"{config_path}: not a model config (no model_type)")
    return config


def layout_sha256(tensors: list[tuple[str, list[int] | tuple[int, ...], str]]) -> str:
    """sha256 over the sorted (name, shape, dtype) list: the weights' layout, not their values."""
    rows = sorted((name, list(shape), dtype) for name, shape, dtype in tensors)
    text = json.dumps(rows, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def read_safetensors_header(path: Path) -> list[HeaderTensor]:
    """Names, shapes, dtypes and byte sizes from a safetensors header, without reading data."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise DctmsError(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise DctmsError(f"{path}: not a safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
            size = f.seek(0, 2)
    except OSError as err:
        raise DctmsError(f"{path}: cannot read: {err.strerror}") from None
    except (ValueError, RecursionError):  # bad JSON or UTF-8, a 5,000-digit number, deep nesting
        raise DctmsError(f"{path}: not a safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise DctmsError(f"{path}: not a safetensors file (header is not a JSON object)")
    data_bytes = size - 8 - n
    return [
        _header_tensor(path, name, entry, data_bytes, 8 + n)
        for name, entry in sorted(header.items())
        if name != "__metadata__"
    ]


def _header_tensor(
    path: Path, name: str, entry: object, data_bytes: int, data_start: int
) -> HeaderTensor:
    """One header entry, checked: a malformed entry is a one-line error, never a traceback."""
    bad = DctmsError(f"{path}: not a safetensors file (bad entry for tensor {name})")
    if not isinstance(entry, dict):
        raise bad
    dtype = _SAFETENSORS_DTYPES.get(str(entry.get("dtype", "")))
    if dtype is None:
        raise DctmsError(f"{path}: tensor {name} has unsupported dtype {entry.get('dtype')}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise bad
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise bad
    numel = 1
    for d in shape:
        numel *= d
    if offsets[1] - offsets[0] != numel * _ITEMSIZE[dtype]:
        raise DctmsError(
            f"{path}: tensor {name} has {offsets[1] - offsets[0]} bytes of data, "
            f"its shape {shape} and dtype {dtype} need {numel * _ITEMSIZE[dtype]}"
        )
    if offsets[1] > data_bytes:
        raise DctmsError(
            f"{path}: tensor {name} ends at byte {offsets[1]} of the data, "
            f"the file holds {data_bytes} (truncated or bad offsets)"
        )
    return HeaderTensor(
        name, tuple(shape), dtype, offsets[1] - offsets[0], path.name, data_start + offsets[0]
    )


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
