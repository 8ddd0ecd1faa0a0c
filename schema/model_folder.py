"""The one model-folder reader, shared by the compiler and the runner.

A model is a folder as mlx-lm's ``load`` reads it: ``config.json``, the weights in ``model*.safetensors``
(one file, or shards with an optional ``model.safetensors.index.json``), optionally a tokenizer. The
compiler also accepts a bare ``config.json`` (a plan for weights that are not here yet).

Weights are described from their safetensors headers only (a few kilobytes whatever the model size),
and the description is checked as a whole: every shard the index names exists, no tensor is stored
twice, every tensor's bytes lie inside its file.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from dctms.schema.errors import DctmsError
from dctms.schema.fingerprint import (
    HeaderTensor,
    canonical_config_sha256,
    read_config,
    read_safetensors_header,
)

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class ModelFolder:
    """A model folder (or a bare config.json) as the compiler and the runner both see it."""

    path: Path | None  # the folder; None when only a config.json path was given
    config: dict
    config_sha256: str
    weight_files: tuple[Path, ...]  # model*.safetensors, sorted (what mlx-lm's load reads)

    def headers(self) -> list[HeaderTensor]:
        """Every stored tensor (name, shape, dtype, bytes, file, start), sorted by name. Read once
        per folder object: the runner checks them, then reads the bytes they locate."""
        return list(self._headers)

    @functools.cached_property
    def _headers(self) -> tuple[HeaderTensor, ...]:
        return tuple(read_weight_headers(self.weight_files))

    @property
    def where(self) -> str:
        return str(self.path) if self.path is not None else "the config"


def model_from_config(config: dict) -> ModelFolder:
    """A model known only by its config.json contents (a plan's recorded request): no folder, no
    weights, so the compiler traces it and fingerprints nothing."""
    return ModelFolder(None, config, canonical_config_sha256(config), ())


def open_model(path: str | Path) -> ModelFolder:
    """MODEL for the compiler: a folder holding config.json (weights optional), or the config.json."""
    p = Path(path)
    if p.is_dir():
        config_path, folder = p / "config.json", p
    elif p.is_file():
        config_path, folder = p, None
    else:
        raise DctmsError(f"{path}: no such file or folder")
    if not config_path.is_file():
        raise DctmsError(f"{p}: folder has no config.json")
    config = read_config(config_path)
    files = _weight_files(folder) if folder is not None else ()
    return ModelFolder(folder, config, canonical_config_sha256(config), files)


def open_model_folder(path: str | Path) -> ModelFolder:
    """A model folder for running: config.json and its weights must both be there."""
    folder = Path(path)
    if not folder.is_dir():
        raise DctmsError(f"{folder}: model folder not found")
    config = read_config(folder / "config.json")
    files = _weight_files(folder)
    if not files:
        raise DctmsError(f"{folder}: no model*.safetensors weights")
    return ModelFolder(folder, config, canonical_config_sha256(config), files)


def _weight_files(folder: Path) -> tuple[Path, ...]:
    """``model*.safetensors`` as mlx-lm globs them; a shard the index names must be among them."""
    files = tuple(sorted(folder.glob("model*.safetensors")))
    index = folder / INDEX_NAME
    if index.is_file():
        names = {f.name for f in files}
        for shard in sorted(set(_index_map(index).values())):
            if shard not in names:
                raise DctmsError(f"{index}: names shard {shard}, which is not in {folder}")
    return files


def _index_map(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # ValueError: JSON, UTF-8, 5,000 digits
        raise DctmsError(f"{index}: unreadable shard index: {str(err)[:120]}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise DctmsError(f'{index}: no "weight_map" of tensor name -> shard file')
    return weight_map


def read_weight_headers(files: tuple[Path, ...]) -> list[HeaderTensor]:
    """The tensors of all shards; one stored in two shards is refused (which copy would load?)."""
    seen: dict[str, HeaderTensor] = {}
    for f in files:
        for t in read_safetensors_header(f):
            if t.name in seen:
                raise DctmsError(
                    f"{f.parent}: tensor {t.name} is stored twice "
                    f"(in {seen[t.name].file} and {t.file})"
                )
            seen[t.name] = t
    return sorted(seen.values(), key=lambda t: t.name)
