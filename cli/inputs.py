"""The files a command reads, so that none of its outputs may be written onto them."""

from __future__ import annotations

from pathlib import Path

# Besides the weights (*.safetensors, *.gguf): what a model folder's readers open.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "model.safetensors.index.json",
)


def model_inputs(model: str | Path) -> list[Path]:
    """A model argument's files: the config.json given, or a folder's config, tokenizer and
    weights."""
    path = Path(model)
    if not path.is_dir():
        return [path]
    found = [path / name for name in MODEL_FILES]
    for pattern in ("*.safetensors", "*.gguf"):
        found += sorted(path.glob(pattern))
    return found
