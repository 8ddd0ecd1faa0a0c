"""Which length points a request uses, so a session can record them all before any call.

A call runs each prefill chunk and each decode step at the smallest verified point that holds it
(``runner.lengths``); the points depend only on the prompt length and the token budget, so they are
known before generation starts. ``Session.prerecord`` records them (or every verified point) up
front and reports the time as set-up, instead of paying for a point at its first use mid-call.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from dctms.runner.lengths import LengthTable

Point = tuple[int, ...]


@dataclass(frozen=True)
class Chunk:
    start: int  # position of the chunk's first token
    length: int  # real tokens in it
    point: Point  # the verified point it runs at
    tokens: int  # tokens fed (the chunk padded to the point's token length)


def prefill_chunks(lengths: LengthTable, chunk: int, prompt_length: int) -> Iterator[Chunk]:
    """The prompt in ``chunk``-token pieces, each at the smallest point holding its tokens and the
    positions attended so far (its end)."""
    for start in range(0, prompt_length, chunk):
        n = min(chunk, prompt_length - start)
        point = lengths.pick({"tokens": n, "window": start + n})
        yield Chunk(start, n, point, lengths.value(point, "tokens", chunk))


def decode_point(lengths: LengthTable, position: int) -> Point:
    """The smallest verified attention window that holds positions 0..position."""
    return lengths.pick({"window": position + 1})


def request_points(
    prefill: LengthTable, decode: LengthTable, chunk: int, prompt_length: int, max_tokens: int
) -> tuple[set[Point], set[Point]]:
    """The prefill and decode points a generation of at most ``max_tokens`` uses (every step that
    may run: a stop token only ends it earlier)."""
    pre = {c.point for c in prefill_chunks(prefill, chunk, prompt_length)}
    # Decode step i (1 <= i < max_tokens) feeds the token at position prompt_length + i - 1.
    dec = {decode_point(decode, prompt_length + i - 1) for i in range(1, max_tokens)}
    return pre, dec


def union_points(
    prefill: LengthTable, decode: LengthTable, chunk: int, requests: Iterable[tuple[int, int]]
) -> tuple[list[Point], list[Point]]:
    """``request_points`` over (prompt length, max tokens) pairs, each list sorted."""
    pre: set[Point] = set()
    dec: set[Point] = set()
    for prompt_length, max_tokens in requests:
        p, d = request_points(prefill, decode, chunk, prompt_length, max_tokens)
        pre |= p
        dec |= d
    return sorted(pre), sorted(dec)
