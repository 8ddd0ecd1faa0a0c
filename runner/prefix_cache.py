"""The prompt-prefix index of a plan's pool (``toolkit.prefix_pool``): which block holds which
prefix, and which block to reuse next.

A block holds one prefill chunk of a prompt at a chunk-aligned position; it is found by the whole
prefix that ends with it (the exact tokens, not a hash, so two prefixes never collide). A prompt's
cached prefix is the longest run of its leading chunks that are all in the pool, leaving at least
one token to prefill (the first generated token comes from the last prefill call). The pool never
grows: when no block is free the least recently used one is evicted (a lookup or a save makes a
block recent).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class PoolStats:
    lookups: int = 0
    hit_blocks: int = 0  # blocks loaded into a slot instead of prefilled
    hit_tokens: int = 0
    saved_blocks: int = 0
    evictions: int = 0


class PrefixIndex:
    def __init__(self, blocks: int, block_tokens: int):
        self.blocks, self.block_tokens = blocks, block_tokens
        self._free = list(range(blocks))
        self._by_prefix: OrderedDict[tuple[int, ...], int] = OrderedDict()  # oldest first
        self.stats = PoolStats()

    @property
    def used(self) -> int:
        return len(self._by_prefix)

    def lookup(self, prompt: tuple[int, ...]) -> list[tuple[int, int]]:
        """(position, block) of every leading chunk of ``prompt`` in the pool, in order; each
        found block becomes the most recently used."""
        t = self.block_tokens
        found = []
        self.stats.lookups += 1
        for end in range(t, len(prompt), t):  # end < len(prompt): one token is left to prefill
            block = self._by_prefix.get(prompt[:end])
            if block is None:
                break
            self._by_prefix.move_to_end(prompt[:end])
            found.append((end - t, block))
        self.stats.hit_blocks += len(found)
        self.stats.hit_tokens += len(found) * t
        return found

    def to_save(self, prompt: tuple[int, ...]) -> list[tuple[int, int]]:
        """(position, block) for every whole chunk of ``prompt`` not in the pool yet, each given a
        block (a free one, else the least recently used one's); chunks already there become
        recent."""
        t = self.block_tokens
        out = []
        for end in range(t, len(prompt) + 1, t):
            key = prompt[:end]
            if key in self._by_prefix:
                self._by_prefix.move_to_end(key)
                continue
            if self._free:
                block = self._free.pop(0)
            elif self._by_prefix:
                _, block = self._by_prefix.popitem(last=False)
                self.stats.evictions += 1
            else:
                break  # a pool of no blocks
            self._by_prefix[key] = block
            out.append((end - t, block))
        self.stats.saved_blocks += len(out)
        return out

    def owners(self) -> dict[int, int]:
        """Block -> the length in tokens of the prefix it ends (for the inspector)."""
        return {block: len(prefix) for prefix, block in self._by_prefix.items()}
