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


# A model config is a few KiB; anything far larger given where a plan is expected is not one.
_MAX_CONFIG_BYTES = 2**20


def model_config_hint(path: str | Path) -> str | None:
    """When ``path``, given where a plan is expected, is a model's config.json (or the folder
    holding one): one line saying so and how to compile it; None for anything else."""
    import json
    import shlex

    target = Path(path)
    if target.is_dir() and any(target.glob("rank*.plan")):  # compile --ranks wrote there
        return None
    config = target / "config.json" if target.is_dir() else target
    try:
        if not config.is_file() or config.stat().st_size > _MAX_CONFIG_BYTES:
            return None
        doc = json.loads(config.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or "schema_version" in doc or "model_type" not in doc:
        return None
    what = "a model folder" if target.is_dir() else "a model config"
    return (
        f"{path} is {what} (model_type {str(doc['model_type'])[:40]!r}), not a plan: compile it "
        f"first, e.g. dctms compile {shlex.quote(str(path))} -N 2048 -M 256 -o model.plan "
        "(-N the longest prompt, -M the most generated tokens)"
    )
