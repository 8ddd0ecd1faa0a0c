"""The prompt-prefix pool over a recorded run: what ``dctms show --run`` and the inspector's Pool
screen draw from a ``dctms run PLAN --conversation FILE --report REPORT.json`` report.

The report's ``pool_events`` hold one entry per turn (the blocks it hit, saved and evicted, the
block table after it; ``runner.prefix_cache.PoolEvent``) and ``prefix_pool.table`` the table at the
end. A block is drawn as one character: ``.`` free, else the number of the prompt chunk it holds
(``1``-``9``, then ``a``-``z``, ``+`` beyond): a block drawn ``3`` ends a prefix of 3 chunks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import msgspec

from dctms.schema.errors import DctmsError
from dctms.schema.types import Plan

FREE = "."
CHUNK_DIGITS = "123456789abcdefghijklmnopqrstuvwxyz"  # chunk 1 .. 35
BEYOND = "+"
LEGEND = (
    f"{FREE} free; k = 1-9, a-z: the block holds chunk k of a prompt (it ends a k-chunk prefix); "
    f"{BEYOND}: beyond {len(CHUNK_DIGITS)}"
)


class Evicted(msgspec.Struct, frozen=True):
    block: int
    tokens: int  # of the prefix the block ended before it was taken


class PoolTurn(msgspec.Struct, frozen=True):
    turn: int
    prompt_tokens: int
    cached_tokens: int
    hits: list[int]
    saved: list[int]
    evicted: list[Evicted]
    table: list[int | None] | None  # None: the request never finished its prefill


class _Pool(msgspec.Struct):
    blocks: int
    block_tokens: int
    table: list[int | None]


class _Report(msgspec.Struct):
    prefix_pool: _Pool | None
    pool_events: list[PoolTurn]


@dataclass(frozen=True)
class PoolRun:
    """A recorded run of a plan's pool, checked against the plan."""

    name: str  # the report's file name
    blocks: int
    block_tokens: int
    turns: list[PoolTurn]
    table: list[int | None]  # at the end of the run

    @property
    def hit_blocks(self) -> int:
        return sum(len(t.hits) for t in self.turns)

    @property
    def saved_blocks(self) -> int:
        return sum(len(t.saved) for t in self.turns)

    @property
    def evictions(self) -> int:
        return sum(len(t.evicted) for t in self.turns)

    @property
    def cached_tokens(self) -> int:
        return sum(t.cached_tokens for t in self.turns)


def pool_shape(plan: Plan) -> str:
    b = plan.bounds
    return f"{b.prefix_blocks} blocks of {b.prefill_chunk} positions"


def no_pool_message(plan_name: str) -> str:
    return (
        f"{plan_name} has no prefix pool: compile it with --prefix-blocks K (or --prefix-cache "
        "SIZE) to keep prompt prefixes across requests"
    )


def read_pool_run(path: str | Path, plan: Plan, plan_name: str = "the plan") -> PoolRun:
    """The report at ``path`` as a ``PoolRun`` of ``plan``'s pool; a ``DctmsError`` (one line) for a
    plan without a pool, a file that is not such a report, or a run of another pool."""
    if plan.bounds.prefix_blocks <= 0:
        raise DctmsError(f"--run: {no_pool_message(plan_name)}")
    name = Path(path).name
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DctmsError(f"--run {path}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DctmsError(f"--run {path}: cannot read it as JSON ({err})") from None
    try:
        report = msgspec.convert(doc, _Report)
    except msgspec.ValidationError as err:
        raise DctmsError(
            f"--run {path}: not a report of `dctms run PLAN --conversation FILE --report "
            f"REPORT.json` ({err})"
        ) from None
    pool = report.prefix_pool
    if pool is None:
        raise DctmsError(f"--run {path}: its run had no prefix pool ({pool_shape(plan)} here)")
    b = plan.bounds
    if (pool.blocks, pool.block_tokens) != (b.prefix_blocks, b.prefill_chunk):
        raise DctmsError(
            f"--run {path}: recorded with a pool of {pool.blocks} blocks of {pool.block_tokens} "
            f"positions, {plan_name} has {pool_shape(plan)}: not a run of this plan"
        )
    _check_blocks(path, pool, report.pool_events)
    return PoolRun(name, pool.blocks, pool.block_tokens, report.pool_events, pool.table)


def _check_blocks(path: str | Path, pool: _Pool, turns: list[PoolTurn]) -> None:
    """Every block number within the pool, every table one entry per block."""
    tables = [pool.table] + [t.table for t in turns if t.table is not None]
    if any(len(table) != pool.blocks for table in tables):
        raise DctmsError(f"--run {path}: a block table without one entry per block ({pool.blocks})")
    for t in turns:
        named = t.hits + t.saved + [e.block for e in t.evicted]
        if any(not 0 <= block < pool.blocks for block in named):
            raise DctmsError(
                f"--run {path}: turn {t.turn} names a block outside the pool (0..{pool.blocks - 1})"
            )


def block_char(tokens: int | None, block_tokens: int) -> str:
    """One block of the map: free, or the chunk number of the prefix it ends."""
    if tokens is None:
        return FREE
    chunk = max(1, -(-tokens // block_tokens))
    return CHUNK_DIGITS[chunk - 1] if chunk <= len(CHUNK_DIGITS) else BEYOND


def block_map(table: list[int | None], block_tokens: int) -> str:
    return "".join(block_char(tokens, block_tokens) for tokens in table)


def map_lines(table: list[int | None], block_tokens: int, width: int = 64) -> list[str]:
    """The block map in lines of ``width`` blocks, each led by its first block's number."""
    drawn = block_map(table, block_tokens)
    digits = len(str(max(len(drawn) - 1, 0)))
    return [
        f"{start:>{digits}} {drawn[start : start + width]}" for start in range(0, len(drawn), width)
    ]


@dataclass(frozen=True)
class TurnRow:
    turn: int
    prompt_tokens: int
    cached_tokens: int
    hit: int
    saved: int
    evicted: int
    after: str  # the block map after the turn ("" when the turn never finished its prefill)


def turn_rows(run: PoolRun) -> list[TurnRow]:
    return [
        TurnRow(
            t.turn,
            t.prompt_tokens,
            t.cached_tokens,
            len(t.hits),
            len(t.saved),
            len(t.evicted),
            "" if t.table is None else block_map(t.table, run.block_tokens),
        )  # fmt: skip
        for t in run.turns
    ]


def totals_line(run: PoolRun) -> str:
    used = sum(tokens is not None for tokens in run.table)
    return (
        f"{len(run.turns)} turns; blocks hit {run.hit_blocks} ({run.cached_tokens:,} prompt tokens "
        f"not prefilled), saved {run.saved_blocks}, evicted {run.evictions}; {used} of "
        f"{run.blocks} in use at the end"
    )
