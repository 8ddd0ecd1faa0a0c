"""The files the checked examples of the docs name that the repository does not hold, made in the
scratch folder the examples run in (tests/test_readme_examples.py): each is made only for a block
whose commands name it. Every one is described on the page that uses it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tiny_plan(folder: Path) -> None:
    """``tiny.plan``: the test suite's hand-built tiny plan (conftest.make_tiny_plan)."""
    from conftest import make_tiny_plan

    from dctms.schema.io import write_plan

    write_plan(make_tiny_plan(), folder / "tiny.plan")


def broken_plan(folder: Path) -> None:
    """``broken.plan``: the tiny plan with tensor t2 moved onto t0's bytes while both are live,
    written by dctms (its digest matches: what refuses it is the verifier's arena_overlap rule)."""
    from conftest import make_broken_tiny_plan

    from dctms.schema.io import write_plan

    write_plan(make_broken_tiny_plan(), folder / "broken.plan")


def tiles500(folder: Path) -> None:
    """``tiles500.csv``: bench/planner.py's 500 tiles of seed 1 (a 1 MiB x 10,000-slot rectangle
    cut at random: the optimal arena is 1 MiB by construction), as ``dctms pack`` reads them."""
    from dctms.toolkit.pack.instances import tiles

    problem, _ = tiles(500, seed=1)
    rows = ["id,start,end,size,alignment"] + [
        f"b{i},{s},{e},{z},{a}"
        for i, (s, e, z, a) in enumerate(
            zip(problem.start, problem.end, problem.size, problem.align, strict=True)
        )
    ]
    (folder / "tiles500.csv").write_text("\n".join(rows) + "\n")


def tiny_target_and_draft(folder: Path) -> None:
    """``tiny-target`` and ``tiny-draft``: random-weight qwen2 folders (conftest.TINY_QWEN2, 2
    layers; its draft 1 layer, another seed) with a byte tokenizer."""
    from conftest import TINY_QWEN2

    from dctms.toolkit.tiny_model import write_tiny_model

    write_tiny_model(folder / "tiny-target", TINY_QWEN2)
    write_tiny_model(folder / "tiny-draft", {**TINY_QWEN2, "num_hidden_layers": 1}, seed=2)


def demo_model(folder: Path) -> None:
    """``demo-model``: the random-weight model ``dctms demo`` falls back to (DEMO_CONFIG: qwen2,
    4 layers, hidden 128, float32) with a byte tokenizer."""
    from dctms.toolkit.tiny_model import DEMO_CONFIG, write_tiny_model

    write_tiny_model(folder / "demo-model", DEMO_CONFIG)


def changed_config(folder: Path) -> None:
    """``qwen1.5b.plan``, a copy of the checked-in plan, and ``config.json``, the configuration it
    was compiled from with ``num_hidden_layers`` 28 changed to 32."""
    shutil.copy(ROOT / "plans" / "qwen1.5b.plan", folder / "qwen1.5b.plan")
    config = json.loads((ROOT / "plans" / "configs" / "qwen2.5-1.5b-instruct-4bit.json").read_text())
    config["num_hidden_layers"] = 32
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# name a command mentions -> what makes it (and the names that come with it)
FIXTURES: dict[str, Callable[[Path], None]] = {
    "tiny.plan": tiny_plan,
    "broken.plan": broken_plan,
    "tiles500.csv": tiles500,
    "tiny-target": tiny_target_and_draft,
    "demo-model": demo_model,
    "config.json": changed_config,
}
