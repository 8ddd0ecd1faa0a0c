"""Coarsening: glue buffers into larger rectangular blocks that can be packed as one.

A *block* is a set of buffers with fixed offsets relative to each other that together cover a
rectangle (one byte range over one time range), so a packing of the blocks is a packing of the
buffers with the same arena. Two glues, repeated until neither applies:

* **chain** (exact): at a time boundary between two sections with no slack (the bytes live there
  equal the capacity), where exactly one block ends and exactly one starts, the one starting must
  take the bytes the one ending frees, and nothing else can: both sections are full, so the freed
  bytes are taken at once, by a block live after the boundary and not before. Equal sizes then
  mean equal offsets: every packing within the capacity has them, so gluing loses nothing.
  With ``pair``, a boundary where as many blocks end as start, with the same distinct sizes, pairs
  them by size (a guess: the bytes freed could also be shared out differently).
* **stack** (a heuristic): blocks with the same time range can sit directly on each other. A group
  of them is stacked into one block when its total equals the size of a block it could continue
  (one ending where the group starts, or starting where it ends) or fills its sections alone.
  That is what a rectangle cut in two by bytes looks like, then cut again; some packing may need
  them apart, so a stacked (or paired) problem that does not fit proves nothing about the original.

The costs depend on the number of buffers (sorts and dictionaries per round), not on the span of
the time values, and the rounds are bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import numpy as np

_MAX_ROUNDS = 64
_MAX_GROUP = 12  # larger groups of equal time ranges are searched by a subset-sum table
_MAX_DP_GROUP = 512
_MAX_DP_TOTAL = 1 << 17  # totals (in units of the sizes' gcd) the table may span


@dataclass(frozen=True)
class Coarse:
    lo: np.ndarray  # per block: first section
    hi: np.ndarray  # per block: last section + 1
    size: np.ndarray
    align: np.ndarray
    block: np.ndarray  # per buffer: its block (-1: an empty buffer, offset 0)
    rel: np.ndarray  # per buffer: offset within its block
    exact: bool  # only chains were glued: every packing of the buffers is one of the blocks

    @property
    def n(self) -> int:
        return int(self.size.size)

    def expand(self, block_offsets: np.ndarray) -> np.ndarray:
        """The buffers' offsets from the blocks' offsets."""
        out = np.zeros(self.block.size, dtype=np.int64)
        used = self.block >= 0
        out[used] = np.asarray(block_offsets, dtype=np.int64)[self.block[used]] + self.rel[used]
        return out


def coarsen(
    lo: np.ndarray,
    hi: np.ndarray,
    size: np.ndarray,
    align: np.ndarray,
    capacity: int,
    pair: bool = True,
) -> Coarse:
    """Blocks of the buffers live in sections ``[lo, hi)`` for packing within ``capacity``."""
    k = int(hi.max()) if hi.size else 0
    delta = np.zeros(k + 1, dtype=np.int64)
    np.add.at(delta, lo, size)
    np.add.at(delta, hi, -size)
    live = np.cumsum(delta)[:k]
    full = (live == capacity).tolist()
    # Block b: (lo, hi, size, align, members as (buffer, offset in the block)).
    blocks = [
        (int(a), int(z), int(s), int(al), [(i, 0)])
        for i, (a, z, s, al) in enumerate(
            zip(lo.tolist(), hi.tolist(), size.tolist(), align.tolist(), strict=True)
        )
        if s > 0
    ]
    exact = True
    for _ in range(_MAX_ROUNDS):
        chained, guessed = _chain(blocks, full, pair)
        stacked = _stack(chained, live)
        exact = exact and not guessed and len(stacked) == len(chained)
        if len(stacked) == len(blocks):
            break
        blocks = stacked
    block = np.full(size.size, -1, dtype=np.int64)
    rel = np.zeros(size.size, dtype=np.int64)
    for b, (_, _, _, _, members) in enumerate(blocks):
        for i, r in members:
            block[i], rel[i] = b, r
    cols = list(zip(*[bl[:4] for bl in blocks], strict=True)) if blocks else [(), (), (), ()]
    arrays = [np.asarray(c, dtype=np.int64) for c in cols]
    return Coarse(*arrays, block, rel, exact)


def _chain(blocks: list[tuple], full: list[bool], pair: bool) -> tuple[list[tuple], bool]:
    """Blocks glued across boundaries (see the module docstring), and whether a pair was guessed."""
    ends: dict[int, list[int]] = {}
    starts: dict[int, list[int]] = {}
    for j, (a, z, *_) in enumerate(blocks):
        ends.setdefault(z, []).append(j)
        starts.setdefault(a, []).append(j)
    after: dict[int, int] = {}
    guessed = False
    for s, enders in ends.items():
        starters = starts.get(s, ())
        if len(enders) == 1 and len(starters) == 1 and 0 < s < len(full):
            e, b = enders[0], starters[0]
            if full[s - 1] and full[s] and blocks[e][2:4] == blocks[b][2:4]:
                after[e] = b
        elif (
            pair and len(enders) == len(starters) and 0 < s < len(full) and full[s - 1] and full[s]
        ):
            # as many end as start, with the same distinct sizes: pair them by size (a guess)
            e_sorted = sorted(enders, key=lambda j: blocks[j][2:4])
            b_sorted = sorted(starters, key=lambda j: blocks[j][2:4])
            keys = [blocks[j][2:4] for j in e_sorted]
            if keys == [blocks[j][2:4] for j in b_sorted] and len(set(keys)) == len(keys):
                after.update(zip(e_sorted, b_sorted, strict=True))
                guessed = True
    if not after:
        return blocks, False
    tails = set(after.values())
    out = []
    for j, (a, z, s, al, members) in enumerate(blocks):
        if j in tails:
            continue
        members = list(members)
        while j in after:
            j = after[j]
            z = blocks[j][1]
            members += blocks[j][4]
        out.append((a, z, s, al, members))
    return out, guessed


def _stack(blocks: list[tuple], live: np.ndarray) -> list[tuple]:
    groups: dict[tuple[int, int, int], list[int]] = {}
    for j, (a, z, s, al, _) in enumerate(blocks):
        if s % al == 0:
            groups.setdefault((a, z, al), []).append(j)
    partner: dict[tuple[int, int], set[int]] = {}
    for a, z, s, al, _ in blocks:
        partner.setdefault((z, al), set()).add(s)  # continues a group starting at z
        partner.setdefault((-a - 1, al), set()).add(s)  # continues a group ending at a
    for (a, z, al), group in groups.items():
        if len(group) > 1:  # a whole group may continue another, once both are stacked
            total = sum(blocks[j][2] for j in group)
            partner.setdefault((z, al), set()).add(total)
            partner.setdefault((-a - 1, al), set()).add(total)
    used: set[int] = set()
    out = []
    for (a, z, al), group in sorted(groups.items()):
        if len(group) < 2:
            continue
        wanted = partner.get((a, al), set()) | partner.get((-z - 1, al), set())
        alone = int(live[a:z].min()) if z > a else 0
        if alone == int(live[a:z].max()):
            wanted = wanted | {alone}  # the group may fill its sections by itself
        chosen = _subset(group, [blocks[j][2] for j in group], wanted)
        if chosen:
            used.update(chosen)
            members, y = [], 0
            for j in sorted(chosen, key=lambda j: (-blocks[j][2], j)):
                members += [(i, r + y) for i, r in blocks[j][4]]
                y += blocks[j][2]
            out.append((a, z, y, al, members))
    return [bl for j, bl in enumerate(blocks) if j not in used] + out


def _subset(group: list[int], sizes: list[int], wanted: set[int]) -> tuple[int, ...] | None:
    """The largest sub-group (two or more) whose total is wanted; the first found on ties."""
    if not wanted:
        return None
    if sum(sizes) in wanted:
        return tuple(group)
    if len(group) > _MAX_GROUP:
        return _subset_dp(group, sizes, wanted)
    for r in range(len(group) - 1, 1, -1):
        for picks in combinations(range(len(group)), r):
            if sum(sizes[p] for p in picks) in wanted:
                return tuple(group[p] for p in picks)
    return None


def _subset_dp(group: list[int], sizes: list[int], wanted: set[int]) -> tuple[int, ...] | None:
    """The sub-group (two or more) with the most members whose total is wanted, for groups too
    large to enumerate: a subset-sum table over multiples of the sizes' gcd, most members per
    total (ties: the earlier members), O(members x totals)."""
    g = int(np.gcd.reduce(np.asarray(sizes, dtype=np.int64)))
    cap = max(wanted) // g
    if len(group) > _MAX_DP_GROUP or cap > _MAX_DP_TOTAL or cap <= 0:
        return None
    units = [s // g for s in sizes]
    none = -1
    count = np.full(cap + 1, none, dtype=np.int32)  # most members reaching each total
    count[0] = 0
    took = np.zeros((len(units), cap + 1), dtype=bool)  # member j raised that total's count
    for j, u in enumerate(units):
        if u > cap:
            continue
        cand = np.full(cap + 1, none, dtype=np.int32)
        prev = count[: cap + 1 - u]
        cand[u:] = np.where(prev >= 0, prev + 1, none)
        better = cand > count
        took[j] = better
        count = np.where(better, cand, count)
    targets = [w // g for w in sorted(wanted) if w % g == 0 and 0 < w // g <= cap]
    targets = [t for t in targets if count[t] >= 2]
    if not targets:
        return None
    t = max(targets, key=lambda t: (int(count[t]), -t))
    picks = []
    for j in range(len(units) - 1, -1, -1):  # walk back: the last member that raised t
        if t > 0 and took[j, t]:
            picks.append(j)
            t -= units[j]
    if t != 0:
        return None
    return tuple(group[p] for p in sorted(picks))
