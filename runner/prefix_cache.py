"""The prompt-prefix index of a plan's pool (``toolkit.prefix_pool``): which block holds which
prefix, and which block to reuse next.

A block holds one prefill chunk of a prompt at a chunk-aligned position; it is found by the whole
prefix that ends with it (the exact tokens, not a hash, so two prefixes never collide). A prompt's
cached prefix is the longest run of its leading chunks that are all in the pool, leaving at least
one token to prefill (the first generated token comes from the last prefill call).

A *whole prompt* is kept too: its last chunk (a part of one when the prompt does not end on a chunk
boundary) with the first token its prefill chose. The same prompt again (a retry, a repeated
question, an evaluation run) then loads every block, takes that token and prefills nothing: exact,
because the blocks are what the same prefill calls wrote and the token is their greedy choice (a
slotted plan decodes greedily only). A part block serves that exact prompt alone, so it only takes
a free block or another part block's place, and a chunk that any longer prompt can reuse evicts the
part blocks first.

A finished chat turn gives the pool its *history* too (``save_history``): the whole chunks of its
prompt and answer, which the runner re-prefills as the chunks they are (``runner.batch``), since the
next turn of the chat re-sends them and the KV its decode steps wrote is not what a prefill writes.

The pool never grows: when no block is free the least recently used one is evicted (a lookup or a
save makes a block recent).

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
class Hit:
    """What a lookup found: (position, block) of every cached chunk, in prompt order, the prompt
    tokens they hold, and, when the whole prompt is cached, the first token its prefill chose."""

    blocks: list[tuple[int, int]]
    tokens: int = 0
    first_token: int | None = None
    event: PoolEvent | None = None  # the request's recorded pass, while recording


@dataclass
class PoolEvent:
    """One request's pass through the pool: plain ints, cheap to keep and to write as JSON."""

    prompt_tokens: int
    cached_tokens: int = 0
    hits: list[int] = field(default_factory=list)  # blocks loaded into the slot, in prompt order
    saved: list[int] = field(default_factory=list)  # blocks written with the prompt's chunks
    evicted: list[tuple[int, int]] = field(default_factory=list)  # (block, tokens it ended)
    # after the save: block -> tokens of the prefix it ends, None for a free block (None until
    # the request's prompt is prefilled; a request cancelled before that saves nothing)
    table: list[int | None] | None = None

    def as_json(self, block_tokens: int) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
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
        self._first: dict[tuple[int, ...], int] = {}  # whole prompts -> their first token
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

    def lookup(self, prompt: tuple[int, ...]) -> Hit:
        """The cached chunks of ``prompt``: its leading whole chunks in the pool, leaving one token
        to prefill, or every chunk and the first token when the whole prompt is kept. Each found
        block becomes the most recently used."""
        t = self.block_tokens
        ends = list(range(t, len(prompt), t))  # end < len(prompt): one token is left to prefill
        first = self._first.get(prompt)
        if first is not None:
            ends.append(len(prompt))  # kept whole: its last chunk too, and nothing to prefill
        found = []
        self.stats.lookups += 1
        for end in ends:
            key = prompt[:end]
            block = self._by_prefix.get(key)
            if block is None:
                break
            self._by_prefix.move_to_end(key)
            found.append(((end - 1) // t * t, block))  # a chunk starts on a multiple of t
        whole = first is not None and len(found) == len(ends)
        hit = Hit(found, len(prompt) if whole else len(found) * t, first if whole else None)
        self.stats.hit_blocks += len(found)
        self.stats.hit_tokens += hit.tokens
        if self.events is not None:
            event = PoolEvent(len(prompt), hit.tokens, hits=[block for _, block in found])
            self.events.append(event)
            self._open.append((prompt, event))
            hit.event = event
        return hit

    def to_save(
        self, prompt: tuple[int, ...], first_token: int | None = None
    ) -> list[tuple[int, int]]:
        """(position, block) for every whole chunk of ``prompt`` not in the pool yet, in order, each
        given a block (a free one, else the least recently used one's, a part block's first);
        chunks already there become recent. A chunk is found only behind all the chunks before it,
        so the prompt's own chunks are never evicted for its later ones: when only they are left,
        the rest is not saved. With ``first_token`` (the token its prefill chose) the whole prompt
        is kept: a part chunk at its end is saved too, in a free block or a part block's place."""
        t = self.block_tokens
        ends = list(range(t, len(prompt) + 1, t))
        if first_token is not None and len(prompt) % t:
            ends.append(len(prompt))  # the part chunk the prompt ends with
        return self._save(prompt, ends, first_token, self._event_for(prompt))

    def __contains__(self, prefix: tuple[int, ...]) -> bool:
        return prefix in self._by_prefix

    def holds(self, prefix: tuple[int, ...]) -> int | None:
        """The block holding the chunk that ends ``prefix``, made the most recently used; None
        when the pool does not hold it."""
        block = self._by_prefix.get(prefix)
        if block is not None:
            self._by_prefix.move_to_end(prefix)
        return block

    def save_history(
        self, history: tuple[int, ...], event: PoolEvent | None = None
    ) -> list[tuple[int, int]]:
        """(position, block) for every whole chunk of ``history`` (a finished request's prompt and
        answer, written into its slot by whole-chunk prefill calls) not in the pool yet, as
        ``to_save`` gives them; recorded on ``event``, the request's own pass."""
        t = self.block_tokens
        return self._save(history, list(range(t, len(history) + 1, t)), None, event)

    def _save(
        self,
        prompt: tuple[int, ...],
        ends: list[int],
        first_token: int | None,
        event: PoolEvent | None,
    ) -> list[tuple[int, int]]:
        t = self.block_tokens
        out = []
        chain = {prompt[:end] for end in ends}
        for end in ends:
            key = prompt[:end]
            if key in self._by_prefix:
                self._by_prefix.move_to_end(key)
                continue
            block = self._take(chain, part=end % t != 0, event=event)
            if block is None:
                break  # the pool holds this prompt's first chunks only (or has no block)
            self._by_prefix[key] = block
            out.append(((end - 1) // t * t, block))
        if first_token is not None and all(prompt[:end] in self._by_prefix for end in ends):
            self._first[prompt] = first_token
        self.stats.saved_blocks += len(out)
        if event is not None:
            event.saved += [block for _, block in out]
            event.table = self.table()
        return out

    def _take(self, chain: set, part: bool, event: PoolEvent | None) -> int | None:
        """A block for a new chunk: a free one, else the least recently used part block outside
        ``chain`` (the saving prompt's own chunks), else, for a whole chunk only, the least
        recently used block outside it; None when there is none."""
        if self._free:
            return self._free.pop(0)
        outside = [k for k in self._by_prefix if k not in chain]
        parts = [k for k in outside if len(k) % self.block_tokens]
        old = parts[0] if parts else (outside[0] if outside and not part else None)
        if old is None:
            return None
        block = self._by_prefix.pop(old)
        self._first.pop(old, None)
        self.stats.evictions += 1
        if event is not None:
            event.evicted.append((block, len(old)))
        return block

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

    def summary(self, table: bool = True) -> dict:
        """The run report's ``prefix_pool``: the pool's size, its counters and (with ``table``)
        the block table."""
        out = {"blocks": self.blocks, "block_tokens": self.block_tokens, "used": self.used,
               **vars(self.stats)}  # fmt: skip
        return {**out, "table": self.table()} if table else out

    def table(self) -> list[int | None]:
        """The block table: per block, the tokens of the prefix it ends, or None when free."""
        owners = self.owners()
        return [owners.get(block) for block in range(self.blocks)]
