"""A batched plan's run: B slots, sequences joining and leaving at step boundaries.

A batched plan (``bounds.batch`` B > 1, ``toolkit.slots``) holds B slots of N + M positions in one
static KV state. ``BatchSession`` keeps a queue of requests and a slot table and advances them in
*iterations*; each is, in order:

1. admit: a waiting request takes the lowest free slot (the decode step then covers the fewest
   rows), with the chunks of its prompt the prefix pool holds loaded into it (a prompt the pool
   holds whole, ``runner.prefix_cache``, also gets its first token there and prefills nothing);
   with no request waiting, a sequence in a slot above a free one moves down into it
   (``move_slot``, ``toolkit.slot_move``: its KV row copied bit for bit), so that the steps after
   compute only the busy rows;
2. prefill: one ``prefill_chunk`` of one joining sequence into its slot (a joining prompt is
   prefilled chunk by chunk *between* decode steps, so the sequences already generating wait for
   one chunk at most per step); its last chunk yields the sequence's first token;
3. decode: one step of the first ``rows`` slots, each busy row at its own position; a row that is
   free or still prefilling is fed token 0 at the spare last position (``kv_capacity - 1``), which
   no attention window reaches, so it disturbs nothing.

Every call runs at a verified length point (``runner.lengths``), so the plan's envelope holds
whatever the mix of busy slots and positions; the observed MLX peak is checked against the provable
envelope after every call. A sequence leaves its slot at a stop token, ``max_tokens``, or when its
``on_token`` callback returns False (a client that went away).

With a prefix pool, a request that ends at a stop token or ``max_tokens`` keeps its slot a little
longer as a ``History``: the next turn of a chat re-sends this prompt and answer, so their whole
chunks go into the pool too. Its decode steps wrote the answer's KV one position at a time, which is
not bit for bit what a prefill call writes, so each chunk is prefilled again, as the whole chunk a
later prompt's prefill would run (same tokens, position and length point: the same bits), then
saved. It is work done while the batch has nothing else to do: a history runs one chunk per
iteration only while no request waits or holds a slot, and it ends (what it saved stays) when a
request arrives or when a running sequence above its slot could move down into it. ``run_all``
returns when the requests have ended; ``run_all(histories=True)`` (a chat whose next turn follows)
also waits for the histories.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from dctms.runner.execute import PhaseProgram
from dctms.runner.prefix_cache import PoolEvent, PrefixIndex
from dctms.runner.prerecord import prefill_chunks
from dctms.runner.request import Request
from dctms.runner.session import Generation, Prerecorded, Session
from dctms.schema.errors import DctmsError
from dctms.schema.model_folder import ModelFolder
from dctms.schema.slotted import MOVE_PHASE, slotted
from dctms.schema.types import Plan

OnToken = Callable[[int], bool]


class EnvelopeExceeded(DctmsError):
    """MLX's observed peak went above the plan's provable envelope (a compiler bug to report)."""


@dataclass
class Sequence:
    """One request in the batch: where it is and what it generated."""

    request: Request
    on_token: OnToken | None = None
    slot: int = -1
    prefilled: int = 0  # prompt tokens written into the slot so far
    cached: int = 0  # of those, loaded from the prefix pool instead of prefilled
    position: int = 0  # the position the next decode step writes
    last: int = 0  # the last generated token: the next decode step's input
    generation: Generation = field(default_factory=lambda: Generation([], 0.0))
    submitted: float = field(default_factory=time.perf_counter)
    stepped: float = 0.0  # when its latest token was read
    done: bool = False
    finish: str = ""  # "stop", "length" or "cancelled"
    pool_event: PoolEvent | None = None  # its recorded pass through the prefix pool, if recorded

    @property
    def decoding(self) -> bool:
        return self.slot >= 0 and not self.done and self.prefilled == len(self.request.prompt)


@dataclass
class History:
    """A finished request whose prompt and answer the pool is given in whole chunks, from the
    chunk its prompt ended in (``at``) to the last whole one (``end``), in its slot."""

    seq: Sequence
    tokens: tuple[int, ...]
    at: int
    end: int


@dataclass
class BatchStats:
    iterations: int = 0
    prefill_calls: int = 0
    decode_steps: int = 0
    rows_computed: int = 0  # rows the decode steps ran (busy or not)
    rows_busy: int = 0  # of those, rows that generated a token
    single_steps: int = 0  # decode steps of slot 0 alone (the one-row phase)
    moves: int = 0  # sequences moved to a lower free slot (the steps after compute fewer rows)
    whole_prompt_hits: int = 0  # prompts the pool held whole: no prefill call, the token kept
    history_chunks: int = 0  # finished turns' chunks prefilled again for the pool (History)
    histories_cut: int = 0  # histories ended by a request before their last chunk
    peak_observed: int = 0  # the largest observed MLX peak after any call


class BatchSession(Session):
    """Weights, the B-slot state and the two phase programs, allocated once; requests queue for
    slots (``submit``) and advance together (``iterate``, ``run_all``)."""

    BATCHED = True

    def __init__(self, plan: Plan, model: ModelFolder, verify_hashes: bool = False):
        if not slotted(plan.bounds):
            raise DctmsError("a batch-1 plan: run it with a Session (`dctms run PLAN`)")
        super().__init__(plan, model, verify_hashes)
        self.slots: list[Sequence | None] = [None] * plan.bounds.batch
        self.waiting: deque[Sequence] = deque()
        self.spare = plan.bounds.kv_capacity - 1  # where a row without a sequence writes
        phases = {p.name: p for p in plan.phases}
        # slot 0 alone (one client): a one-row step, as cheap as a batch-1 plan's
        self.decode_one = PhaseProgram(phases["decode_one"]) if "decode_one" in phases else None
        # the prompt-prefix pool (toolkit.prefix_pool), when the plan has one
        self.prefix = None
        self.histories: dict[int, History] = {}  # slot -> the finished turn it still holds
        # Whether finished turns keep their slot as histories (False: the idle batch does no work;
        # `dctms serve --no-pool-answers`), so a next turn finds its answer in the pool.
        self.keep_answers = True
        if plan.bounds.prefix_blocks > 0:
            self.prefix = PrefixIndex(plan.bounds.prefix_blocks, plan.bounds.prefill_chunk)
            self.save_block = PhaseProgram(phases["save_block"])
            self.load_block = PhaseProgram(phases["load_block"])
        # a sequence left alone in a high slot moves to the lowest free one (toolkit.slot_move)
        self.move = PhaseProgram(phases[MOVE_PHASE]) if MOVE_PHASE in phases else None
        self.stats = BatchStats()

    # ------------------------------------------------------------------------------- queueing

    def submit(self, request: Request, on_token: OnToken | None = None) -> Sequence:
        """Queue ``request``; it takes a slot at the next iteration that has one free."""
        if request.plan is not self.plan:
            raise ValueError("the request was validated for another plan")
        seq = Sequence(request, on_token)
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """End ``seq`` now (a client that went away): its slot is free for the next iteration."""
        if not seq.done:
            self._finish(seq, "cancelled")
        if seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def busy(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def live(self) -> bool:
        """Requests waiting or in a slot (a ``History`` is not one)."""
        return bool(self.waiting or self._live_slots())

    def _live_slots(self) -> list[int]:
        """The slots that hold a request (not a ``History``), lowest first."""
        return [i for i, s in enumerate(self.slots) if s is not None and i not in self.histories]

    @property
    def idle(self) -> bool:
        return not self.waiting and self.busy == 0

    # ------------------------------------------------------------------------------- iterations

    def iterate(self) -> list[Sequence]:
        """One iteration (admit, one prefill chunk, one decode step); the sequences that ended."""
        self.stats.iterations += 1
        ended = self._admit()
        self._compact()
        joining = next(
            (s for s in self.slots if s is not None and s.prefilled < len(s.request.prompt)), None
        )
        if joining is not None:
            self._prefill_chunk(joining)
            if joining.done:
                ended.append(joining)
        elif self.histories and not self.live:
            self._history_chunk(self.histories[min(self.histories)])
        decoding = [s for s in self.slots if s is not None and s.decoding]
        if decoding:
            ended += self._decode_step(decoding)
        for seq in ended:
            if 0 <= seq.slot < len(self.slots) and self.slots[seq.slot] is seq:
                if not self._keep_history(seq):
                    self.slots[seq.slot] = None
        return ended

    def run_all(self, histories: bool = False) -> None:
        """Iterate until every submitted request has ended, and with ``histories`` until the
        finished turns' histories have given the pool their chunks too (a chat's next turn is
        coming; otherwise they wait for an idle moment, or for a request to end them)."""
        while self.live or (histories and self.histories):
            self.iterate()

    def _admit(self) -> list[Sequence]:
        """Waiting requests into free slots, each with what the pool holds of its prompt; the
        sequences that ended at once (a whole cached prompt whose first token ends it)."""
        ended = []
        for i, held in enumerate(self.slots):
            if held is not None and held.done and i not in self.histories:  # cancelled meanwhile
                self.slots[i] = None
        if self.waiting:  # a request before any history (what they saved stays)
            self._cut_histories(list(self.histories))
        while self.waiting and None in self.slots:
            seq = self.waiting.popleft()
            if seq.done:
                continue
            seq.slot = self.slots.index(None)
            self.slots[seq.slot] = seq
            if self.prefix is None:
                continue
            hit = self.prefix.lookup(seq.request.prompt)
            for position, block in hit.blocks:
                self._copy_block(self.load_block, seq.slot, position, block)
            seq.prefilled = seq.cached = seq.generation.cached_tokens = hit.tokens
            seq.pool_event = hit.event
            if hit.first_token is not None:  # the whole prompt: no prefill call at all
                self.stats.whole_prompt_hits += 1
                self._first_token(seq, hit.first_token)
                if seq.done:  # its first token ended it: the slot is free for the next one
                    self.slots[seq.slot] = None
                    ended.append(seq)
        return ended

    def _compact(self) -> None:
        """Move the sequence in the highest busy slot to the lowest free one while that one is
        lower: a decode step computes the rows up to the highest busy slot. Called after
        ``_admit``, so a free slot here means no request is waiting for one. A history in a slot
        below a running sequence ends first: it must not keep that sequence's rows up."""
        if self.move is None:
            return
        live = self._live_slots()
        self._cut_histories([h for h in self.histories if live and h < live[-1]])
        while True:
            busy = self._live_slots()
            free = [i for i, s in enumerate(self.slots) if s is None]
            if not busy or not free or free[0] > busy[-1]:
                return
            source, slot = busy[-1], free[0]
            self._copy(self.move, {"slot": slot, "source": source})
            seq = self.slots[source]
            self.slots[slot], self.slots[source], seq.slot = seq, None, slot
            self.stats.moves += 1

    def _prefill_chunk(self, seq: Sequence) -> None:
        prompt = seq.request.prompt
        out, length = self._prefill(prompt, seq.prefilled, seq.slot)
        self.stats.prefill_calls += 1
        seq.prefilled += length
        if seq.prefilled < len(prompt):
            return
        token = int(out["next_token"].item())
        self._first_token(seq, token)  # it goes out before the pool's copies are made
        if self.prefix is not None:  # keep the prompt's chunks, and the prompt, for later requests
            for position, block in self.prefix.to_save(prompt, token):
                self._copy_block(self.save_block, seq.slot, position, block)

    def _prefill(self, tokens: tuple[int, ...], start: int, slot: int) -> tuple[dict, int]:
        """The prefill call of the chunk of ``tokens`` that starts at ``start`` into ``slot``, at
        the length point a prompt of these tokens uses for it; its outputs and its token count."""
        chunk = next(
            c
            for c in prefill_chunks(self.prefill.lengths, self.chunk, len(tokens))
            if c.start == start
        )
        piece = list(tokens[chunk.start : chunk.start + chunk.length])
        out = self.prefill.run(
            {
                "tokens": mx.array([piece + [0] * (chunk.tokens - chunk.length)], dtype=mx.int32),
                "position": mx.array(chunk.start, dtype=mx.int32),
                "last_index": mx.array(chunk.length - 1, dtype=mx.int32),
                "slot": mx.array(slot, dtype=mx.int32),
            },
            self.weights,
            self.state,
            wait=False,
            point=chunk.point,
        )
        mx.eval(out["next_token"])
        self._check_peak()
        return out, chunk.length

    # ---------------------------------------------------------------- finished turns' history

    def _keep_history(self, seq: Sequence) -> bool:
        """Whether ``seq``, just ended, keeps its slot as a ``History``: a pool, an answer that
        ran to a stop token or its budget, and a whole chunk of prompt and answer (within the
        longest prompt, N) the pool does not hold yet."""
        if self.prefix is None or not self.keep_answers or seq.finish not in ("stop", "length"):
            return False
        t = self.chunk
        tokens = tuple(seq.request.prompt) + tuple(seq.generation.tokens)
        at = len(seq.request.prompt) // t * t  # the chunk the prompt ended in, prefilled in part
        end = min(len(tokens), self.plan.bounds.input_tokens) // t * t
        if all(tokens[:e] in self.prefix for e in range(at + t, end + 1, t)):
            return False  # nothing new (or no whole chunk at all)
        self.histories[seq.slot] = History(seq, tokens, at, end)
        return True

    def _history_chunk(self, history: History) -> None:
        """The next whole chunk of a finished turn into its slot, then into the pool: loaded when
        the pool holds it already, else prefilled (the same call a later prompt's prefill runs)
        and saved."""
        seq, start = history.seq, history.at
        key = history.tokens[: start + self.chunk]
        try:
            block = self.prefix.holds(key)
            if block is not None:
                self._copy_block(self.load_block, seq.slot, start, block)
            else:
                self._prefill(key, start, seq.slot)
                self.stats.history_chunks += 1
                for position, saved in self.prefix.save_history(key, seq.pool_event):
                    self._copy_block(self.save_block, seq.slot, position, saved)
        except BaseException:  # e.g. EnvelopeExceeded: the caller hears it once, not per retry
            self._end_history(seq.slot)
            raise
        history.at += self.chunk
        if history.at >= history.end:
            self._end_history(seq.slot)

    def _cut_histories(self, slots: list[int]) -> None:
        for slot in slots:
            self._end_history(slot)
            self.stats.histories_cut += 1

    def _end_history(self, slot: int) -> None:
        del self.histories[slot]
        self.slots[slot] = None

    def _first_token(self, seq: Sequence, token: int) -> None:
        """``seq``'s prompt is all in its slot: its first token goes out, its decoding starts."""
        now = time.perf_counter()
        seq.generation.ttft_s = now - seq.submitted
        seq.stepped = now
        seq.position = len(seq.request.prompt)
        self._emit(seq, token)

    def _decode_step(self, decoding: list[Sequence]) -> list[Sequence]:
        need_rows = max(s.slot for s in decoding) + 1
        need_window = max(s.position for s in decoding) + 1
        program = self.decode_one if need_rows == 1 and self.decode_one else self.decode
        point = program.lengths.pick({"rows": need_rows, "window": need_window})
        rows = program.lengths.value(
            point, "rows", 1 if program is self.decode_one else self.plan.bounds.batch
        )
        tokens, positions = [0] * rows, [self.spare] * rows
        for s in decoding:
            tokens[s.slot], positions[s.slot] = s.last, s.position
        out = program.run(
            {
                "tokens": mx.array(tokens, dtype=mx.uint32),
                "positions": mx.array(positions, dtype=mx.int32),
            },
            self.weights,
            self.state,
            wait=False,
            point=point,
        )
        got = out["next_token"].tolist()
        self._check_peak()
        self.stats.decode_steps += 1
        self.stats.single_steps += program is self.decode_one
        self.stats.rows_computed += rows
        self.stats.rows_busy += len(decoding)
        now = time.perf_counter()
        ended = []
        for s in decoding:
            s.position += 1
            s.generation.token_latencies_s.append(now - s.stepped)
            s.stepped = now
            self._emit(s, int(got[s.slot]))
            if s.done:
                ended.append(s)
        return ended

    def _copy_block(self, program: PhaseProgram, slot: int, position: int, block: int) -> None:
        """One block between a slot and the pool."""
        self._copy(program, {"slot": slot, "position": position, "block": block})

    def _copy(self, program: PhaseProgram, feeds: dict[str, int]) -> None:
        """A phase that copies state (a pool block, a slot move). It may read state it does not
        write (a save reads the slots, a load the pool): those arrays are lent, the ones it writes
        moved (``PhaseProgram.run`` takes them), so MLX can write them in place."""
        writes = {name for _, kind, name in program.outputs if kind == "state"}
        reads = {name for _, kind, name in program.inputs if kind == "state"}
        lent = {n: (self.state.pop(n) if n in writes else self.state[n]) for n in reads}
        feeds = {name: mx.array(value, dtype=mx.int32) for name, value in feeds.items()}
        program.run(feeds, self.weights, lent, wait=False)
        mx.eval([lent[n] for n in writes])
        self.state.update({n: lent[n] for n in writes})
        self._check_peak()

    def _emit(self, seq: Sequence, token: int) -> None:
        """Record ``token`` for ``seq``; end it at a stop token, its budget or its caller's say."""
        seq.generation.tokens.append(token)
        seq.last = token
        wanted = seq.on_token is None or seq.on_token(token) is not False
        if not wanted:
            self._finish(seq, "cancelled")
        elif token in seq.request.stop:
            self._finish(seq, "stop")
        elif len(seq.generation.tokens) >= seq.request.max_tokens:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, why: str) -> None:
        seq.done, seq.finish = True, why

    def _check_peak(self) -> None:
        observed = self.observed_peak()
        self.stats.peak_observed = max(self.stats.peak_observed, observed)
        if observed > self.plan.envelope.provable:
            raise EnvelopeExceeded(
                f"observed MLX peak {observed:,} B is above the plan's provable envelope "
                f"{self.plan.envelope.provable:,} B: please report this with the plan"
            )

    def generate(self, request: Request, on_token=None, on_logprobs=None) -> Generation:
        """One request alone (the others' slots stay free): the batch-1 entry point."""
        seq = self.submit(request, on_token)
        while not seq.done:
            self.iterate()
        return seq.generation

    def prerecord(self, requests=None):
        """Record every verified point's graphs before any call (``Session.prerecord``)."""
        done = super().prerecord(None)
        start, more = time.perf_counter(), 0
        for program in self._extra_programs():
            more += program.prepare(self.weights, self.state, None)
        return Prerecorded(done.points + more, done.seconds + time.perf_counter() - start)

    def pool_summary(self, table: bool = True) -> dict | None:
        """The prefix pool's size, counters and (with ``table``) block table, with the prompts it
        held whole and the finished turns' chunks it was given (``History``); None without a
        pool."""
        if self.prefix is None:
            return None
        stats = self.stats
        return {**self.prefix.summary(table), "whole_prompt_hits": stats.whole_prompt_hits,
                "history_chunks": stats.history_chunks, "histories_cut": stats.histories_cut}  # fmt: skip

    def held_bytes(self) -> int:
        extra = [a for p in self._extra_programs() for a in p.constants.values()]
        return super().held_bytes() + sum(a.nbytes for a in extra)

    def _extra_programs(self) -> list[PhaseProgram]:
        """The batched plan's phases beyond a batch-1 plan's prefill and decode."""
        return [p for p in (self.decode_one, self.move) if p is not None]
