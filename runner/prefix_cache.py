"""The prompt-prefix index of a plan's pool (``toolkit.prefix_pool``): which block holds which
prefix, and which block to reuse next.

A block holds one prefill chunk of a prompt at a chunk-aligned position; it is found by the whole
prefix that ends with it (the exact tokens, not a hash, so two prefixes never collide). A prompt's
cached prefix is the longest run of its leading chunks that are all in the pool, leaving at least
one token to prefill (the first generated token comes from the last prefill call). The pool never
grows: when no block is free the least recently used one is evicted (a lookup or a save makes a
block recent).

``start_recording()`` keeps a ``PoolEvent`` per request (the blocks it hit, saved and evicted, the
block table after it) for the run report the inspector draws (``dctms show --run``); a server's
index does not record, so it holds nothing per request.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class PoolStats:
    lookups: int = 0
    hit_blocks: int = 0  # blocks loaded into a slot instead of prefilled
    hit_tokens: int = 0
    saved_blocks: int = 0
    evictions: int = 0


@dataclass
class PoolEvent:
    """One request's pass through the pool: plain ints, cheap to keep and to write as JSON."""

    prompt_tokens: int
    hits: list[int] = field(default_factory=list)  # blocks loaded into the slot, in prompt order
    saved: list[int] = field(default_factory=list)  # blocks written with the prompt's chunks
    evicted: list[tuple[int, int]] = field(default_factory=list)  # (block, tokens it ended)
    # after the save: block -> tokens of the prefix it ends, None for a free block (None until
    # the request's prompt is prefilled; a request cancelled before that saves nothing)
    table: list[int | None] | None = None

    def as_json(self, block_tokens: int) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": len(self.hits) * block_tokens,
            "hits": list(self.hits),
            "saved": list(self.saved),
            "evicted": [{"block": b, "tokens": t} for b, t in self.evicted],
            "table": self.table,
        }


class PrefixIndex:
    def __init__(self, blocks: int, block_tokens: int):
        self.blocks, self.block_tokens = blocks, block_tokens
        self._free = list(range(blocks))
        self._by_prefix: OrderedDict[tuple[int, ...], int] = OrderedDict()  # oldest first
        self.stats = PoolStats()
        self.events: list[PoolEvent] | None = None  # per request, once start_recording() is called
        # looked up, not saved yet, with their prompts (in admission order)
        self._open: list[tuple[tuple[int, ...], PoolEvent]] = []

    def start_recording(self) -> None:
        """Keep a ``PoolEvent`` for every request from now on (``events``)."""
        self.events, self._open = [], []

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
        if self.events is not None:
            event = PoolEvent(len(prompt), hits=[block for _, block in found])
            self.events.append(event)
            self._open.append((prompt, event))
        return found

    def to_save(self, prompt: tuple[int, ...]) -> list[tuple[int, int]]:
        """(position, block) for every whole chunk of ``prompt`` not in the pool yet, in order, each
        given a block (a free one, else the least recently used one's); chunks already there become
        recent. A chunk is found only behind all the chunks before it, so the prompt's own chunks
        are never evicted for its later ones: when only they are left, the rest is not saved."""
        t = self.block_tokens
        out = []
        event = self._event_for(prompt)
        chain = {prompt[:end] for end in range(t, len(prompt) + 1, t)}
        for end in range(t, len(prompt) + 1, t):
            key = prompt[:end]
            if key in self._by_prefix:
                self._by_prefix.move_to_end(key)
                continue
            if self._free:
                block = self._free.pop(0)
            else:
                old = next((k for k in self._by_prefix if k not in chain), None)
                if old is None:
                    break  # the pool holds this prompt's first chunks only (or has no block)
                block = self._by_prefix.pop(old)
                self.stats.evictions += 1
                if event is not None:
                    event.evicted.append((block, len(old)))
            self._by_prefix[key] = block
            out.append((end - t, block))
        self.stats.saved_blocks += len(out)
        if event is not None:
            event.saved = [block for _, block in out]
            event.table = self.table()
        return out

    def _event_for(self, prompt: tuple[int, ...]) -> PoolEvent | None:
        """The recorded lookup of ``prompt`` this save closes (the oldest open one: requests in a
        batch are looked up at admission and saved after their prefill, interleaved)."""
        if self.events is None:
            return None
        for i, (looked_up, _event) in enumerate(self._open):
            if looked_up == prompt:
                return self._open.pop(i)[1]
        event = PoolEvent(len(prompt))  # saved without a lookup
        self.events.append(event)
        return event

    def owners(self) -> dict[int, int]:
        """Block -> the length in tokens of the prefix it ends (for the inspector)."""
        return {block: len(prefix) for prefix, block in self._by_prefix.items()}

    def summary(self) -> dict:
        """The run report's ``prefix_pool``: the pool's size, its counters and the block table."""
        return {
            "blocks": self.blocks, "block_tokens": self.block_tokens, "used": self.used,
            **vars(self.stats), "table": self.table(),
        }  # fmt: skip

    def table(self) -> list[int | None]:
        """The block table: per block, the tokens of the prefix it ends, or None when free."""
        owners = self.owners()
        return [owners.get(block) for block in range(self.blocks)]
