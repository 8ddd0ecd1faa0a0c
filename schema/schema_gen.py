"""Generates ``plan.schema.json`` from the msgspec types, so the two describe the same document.

Run ``python -m dctms.schema.schema_gen`` after changing ``types`` (and bump ``SCHEMA_VERSION``, see
``versions``); ``tests/test_schema_drift.py`` fails until the checked-in file matches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from dctms.schema.types import Plan
from dctms.schema.versions import SCHEMA_ID

SCHEMA_PATH = Path(__file__).with_name("plan.schema.json")


def build_json_schema() -> dict[str, Any]:
    """The plan's JSON Schema (draft 2020-12) as a dict, with a versioned ``$id``."""
    generated = msgspec.json.schema(Plan)
    schema: dict[str, Any] = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "dctms plan",
        "description": (
            "A compile-time memory plan for MLX LLM inference. Generated from dctms.schema.types; "
            "do not edit by hand."
        ),
    }
    schema.update(generated)  # "$ref": "#/$defs/Plan" and "$defs"
    return schema


def render_json_schema() -> str:
    """The schema file's exact text (stable key order, 2-space indent, trailing newline)."""
    return json.dumps(build_json_schema(), indent=2, ensure_ascii=False) + "\n"


def main() -> None:
    SCHEMA_PATH.write_text(render_json_schema(), encoding="utf-8")
    print(f"wrote {SCHEMA_PATH}")


if __name__ == "__main__":
    main()
