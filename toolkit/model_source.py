"""Where a model comes from: its config.json and the optional safetensors beside it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dctms.schema.errors import DctmsError
from dctms.schema.fingerprint import canonical_config_sha256, read_config


@dataclass(frozen=True)
class ModelSource:
    """A model folder (or a bare config.json) as the compiler and runner see it."""

    config: dict
    config_sha256: str
    folder: Path | None  # None when only a config.json path was given
    weight_files: tuple[Path, ...]  # model*.safetensors, sorted


def load_source(path: str | Path) -> ModelSource:
    """Resolve MODEL (a folder holding config.json, or the config.json itself)."""
    p = Path(path)
    if p.is_dir():
        config_path = p / "config.json"
        folder: Path | None = p
    elif p.is_file():
        config_path = p
        folder = None
    else:
        raise DctmsError(f"{path}: no such file or folder")
    if not config_path.is_file():
        raise DctmsError(f"{p}: folder has no config.json")
    config = read_config(config_path)
    files = tuple(sorted(folder.glob("model*.safetensors"))) if folder else ()
    return ModelSource(config, canonical_config_sha256(config), folder, files)
