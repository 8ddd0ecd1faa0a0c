"""Text to token ids and back, with the model folder's own tokenizer (``tokenizers`` only)."""

from __future__ import annotations

import json
from pathlib import Path

from dctms.schema.errors import DctmsError


class Tokenizer:
    def __init__(self, folder: Path):
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise DctmsError(f"{folder}: no tokenizer.json; pass token ids with --tokens")
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as err:  # the tokenizers library raises its own exception type
            raise DctmsError(f"{path}: cannot load tokenizer: {err}") from None
        self.eos_ids = _eos_ids(folder)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def _eos_ids(folder: Path) -> set[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((folder / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def parse_token_list(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise DctmsError(f"--tokens wants comma-separated integers, got {text!r}") from None
    if not ids:
        raise DctmsError("--tokens is empty")
    return ids
