"""The benchmark's prompts: the P1-P5 file, turning text into token ids, and the plan's bounds."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dctms.schema.errors import DctmsError

PROMPTS_NAME = "p1-p5.json"


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


@dataclass(frozen=True)
class PromptIds:
    prompt: Prompt
    ids: list[int]


def default_prompts_file() -> Path:
    """``plans/prompts/p1-p5.json`` of the source tree this dctms runs from."""
    import dctms.toolkit

    path = Path(dctms.toolkit.__file__).resolve().parent.parent / "plans" / "prompts" / PROMPTS_NAME
    if not path.is_file():
        raise DctmsError(
            f"the default prompts file {path} is not here (installed without the source tree?); "
            "pass --prompts FILE"
        )
    return path


def load_prompts(path: str | Path) -> list[Prompt]:
    """A JSON file ``{"prompts": [{"id", "category", "text"}, ...]}`` (or just the list)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DctmsError(f"{p}: prompts file not found") from None
    except (OSError, ValueError) as err:  # ValueError: bad JSON, bad UTF-8, a 5,000-digit number
        raise DctmsError(f"{p}: unreadable prompts file: {str(err)[:120]}") from None
    except RecursionError:
        raise DctmsError(f"{p}: unreadable prompts file: nested too deeply") from None
    items = data.get("prompts") if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise DctmsError(f'{p}: expected a non-empty list under "prompts"')
    prompts: list[Prompt] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise DctmsError(f"{p}: prompts[{i}] is not an object")
        fields = {}
        for key in ("id", "category", "text"):
            value = item.get(key)
            if not isinstance(value, str) or not value:
                raise DctmsError(f"{p}: prompts[{i}].{key} must be a non-empty string")
            fields[key] = value
        prompts.append(Prompt(**fields))
    ids = [q.id for q in prompts]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise DctmsError(f"{p}: duplicate prompt ids {', '.join(dupes)}")
    return prompts


def byte_token_ids(text: str, vocab_size: int) -> list[int]:
    """Token ids for a model folder without a tokenizer: each UTF-8 byte modulo the vocabulary.

    Deterministic and the same for both systems; with a byte-level vocabulary of >= 256 entries it
    equals byte-level tokenisation."""
    if vocab_size < 1:
        raise DctmsError(f"vocabulary size must be positive, got {vocab_size}")
    return [b % vocab_size for b in text.encode("utf-8")]


def check_bounds(prompts: list[PromptIds], input_tokens: int) -> None:
    """Every prompt must fit the plan's N; refuse naming each prompt that does not and both numbers."""
    for p in prompts:
        if not p.ids:
            raise DctmsError(f"prompt {p.prompt.id} tokenizes to no tokens")
    over = [p for p in prompts if len(p.ids) > input_tokens]
    if over:
        longest = max(len(p.ids) for p in over)
        which = ", ".join(
            f"{p.prompt.id} ({p.prompt.category}) has {len(p.ids)} tokens" for p in over
        )
        raise DctmsError(
            f"{'prompts' if len(over) > 1 else 'prompt'} {which}; the plan allows N = {input_tokens}: recompile with -N of at least "
            f"{longest} (e.g. dctms compile MODEL -N {_round_up(longest)} -M ...) or shorten the prompt"
        )


def _round_up(n: int) -> int:
    size = 128
    while size < n:
        size *= 2
    return size
