"""A recorded run of a 2-block prompt-prefix pool on the tiny model, for the pool views' tests.

The prompts are fixed token ids (not a chat whose answers feed the next turn), so the pool's events,
and with them the Pool screen's snapshot, do not depend on what the model generates. The report is
written the way ``dctms run --conversation --report`` writes its pool part.
"""

from __future__ import annotations

import random
from pathlib import Path

from conftest import TINY_QWEN2
from hardening import cli

BOUNDS = ["-N", "96", "-M", "6", "--prefill-chunk", "16", "--pack-seconds", "0", "-q"]
CHUNK = 16


def fixed_prompts() -> list[list[int]]:
    """A (its chunk, and its part chunk: A is kept whole); A and more (hits A's chunk, saves its
    second in the part chunk's block); B (evicts A's first chunk); A and more
    again (A's first chunk is gone, so nothing hits; saving it evicts B's chunk, never A's second,
    which it keeps behind its first)."""
    rng = random.Random(31)
    a = [rng.randrange(256) for _ in range(46)]
    b = [rng.randrange(256) for _ in range(20)]
    return [a[:18], a, b, a]


PLANS = {"plain": [], "small": ["--prefix-blocks", "2"], "pool": ["--prefix-blocks", "8"]}


def compile_pool_plans(root: Path, names: tuple[str, ...] = tuple(PLANS)) -> dict[str, Path]:
    """The tiny model and its plans ``names`` of ``plain`` (no pool), ``small`` (2 blocks) and
    ``pool`` (8 blocks)."""
    from dctms.toolkit.tiny_model import write_tiny_model

    out = {"model": write_tiny_model(root / "model", TINY_QWEN2)}
    for name in names:
        extra = PLANS[name]
        out[name] = root / f"{name}.plan"
        result = cli("compile", str(out["model"]), *BOUNDS, *extra, "-o", str(out[name]))
        assert result.code == 0, result.err
    return out


def record_fixed_run(plan_path: Path, model_path: Path) -> dict:
    """``{"prefix_pool": ..., "pool_events": [...]}`` of ``fixed_prompts()`` run one at a time."""
    from dctms.runner.batch import BatchSession
    from dctms.runner.load import load_checked_plan
    from dctms.runner.request import validate_request
    from dctms.schema.model_folder import open_model_folder

    plan = load_checked_plan(plan_path)
    session = BatchSession(plan, open_model_folder(model_path))
    pool = session.prefix
    pool.start_recording()
    events = []
    for turn, prompt in enumerate(fixed_prompts(), 1):
        session.submit(validate_request(plan, prompt, 2))
        session.run_all(histories=True)  # as --conversation: the next turn follows
        events += [{"turn": turn, **e.as_json(pool.block_tokens)} for e in pool.events]
        pool.events.clear()
    return {"prefix_pool": pool.summary(), "pool_events": events}
