"""The one thread that touches MLX: it loads every plan's session, then runs the requests.

Serialising the MLX calls is what makes the pool's promise hold: a call's arena is free again when
it returns, so one shared arena (the largest plan's) covers every model. Before each call the
running session's memory limit is set to its own throttle limit plus what the other sessions hold
(``foreign`` bytes), exactly as the benchmarks do when two systems share a process.

A batch-1 plan runs one request at a time, start to end (``Session.generate``). A batched plan
(``bounds.batch`` B > 1, or any plan with a prompt-prefix pool: ``schema.slotted``) runs continuously (``runner.batch.BatchSession``): at every step boundary
(between two ``iterate`` calls) a queued request takes a free slot, a request whose client went away
is cancelled, and a sequence that ended (end-of-sequence, a stop string, ``max_tokens``) gives its
slot back; with every slot busy a request waits in the bounded queue. Several models in one server
share the thread: each loop runs, in turn, every batched model's one iteration, and a batch-1
request, when one is next, whole (the batched models' sequences keep their slots and resume after
it). Every call still runs alone, so the pool's one shared arena covers every mix.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from dctms.runner.batch import BatchSession
from dctms.runner.batch import Sequence as BatchSequence
from dctms.runner.request import Request
from dctms.runner.sampling import TokenLogprobs
from dctms.runner.session import Generation, Prerecorded, Session
from dctms.runner.tokenize import Tokenizer
from dctms.schema.errors import DctmsError
from dctms.schema.model_folder import open_model_folder
from dctms.schema.slotted import slotted
from dctms.schema.types import Plan
from dctms.serve.chat import warm_chat_template
from dctms.serve.spec import PlanSpec


class Cancelled(Exception):
    """The request was withdrawn (client gone, or the server stopping) before it finished."""


class QueueFull(Exception):
    pass


@dataclass(frozen=True)
class ServedModel:
    """What a request handler needs to know about a model without touching MLX."""

    name: str
    plan: Plan
    tokenizer: Tokenizer
    stop_ids: frozenset[int]  # end-of-sequence ids: generation stops there, the text omits them

    @property
    def max_prompt(self) -> int:
        return self.plan.bounds.input_tokens

    @property
    def max_tokens(self) -> int:
        return self.plan.bounds.output_tokens

    @property
    def slots(self) -> int:
        return self.plan.bounds.batch


@dataclass
class Job:
    model: str
    request: Request  # validated by the HTTP layer against this model's plan (validate_request)
    # Both are called on the worker thread: every token as it is read (False ends the generation
    # there: a stop string), then the outcome once.
    on_token: Callable[[int], bool | None]
    on_done: Callable[[Generation | None, BaseException | None], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Each token's log-probabilities, just before ``on_token`` sees it (a stream that asked).
    on_logprobs: Callable[[TokenLogprobs], None] | None = None


@dataclass
class ModelLoad:
    """One model's serving figures, kept by the worker thread (read by /status and /metrics)."""

    slots: int
    slotted: bool = False  # runs in a BatchSession (its steps' peaks are checked)
    busy: int = 0  # slots holding a running request (batch 1: the request running, if any)
    waiting: int = 0  # its requests queued for a slot
    tokens: int = 0  # tokens generated since the server started
    busy_s: float = 0.0  # seconds in which at least one of its requests was running
    peak_observed: int = 0  # a batched model's largest observed MLX peak above what others hold
    slot_moves: int = 0  # a batched model's sequences moved down to a free slot (runner.batch)
    pool: dict | None = None  # a plan with a prefix pool: its size and counters (PrefixIndex)

    @property
    def tokens_per_s(self) -> float:
        """Aggregate tokens per second while busy (all slots together)."""
        return self.tokens / self.busy_s if self.busy_s > 0 else 0.0


_STOP = object()
# A finished turn's history (runner.batch.History) waits this long after the last request ended: a
# client that sends its next request at once (a benchmark, an agent's loop) finds the batch free.
HISTORY_GRACE_S = 0.05
SHUTTING_DOWN = "the server is shutting down"


class Worker:
    def __init__(
        self,
        specs: list[tuple[PlanSpec, Plan]],
        max_queue: int = 64,
        prerecord: bool = False,
        pool_answers: bool = True,
    ):
        self._specs = specs
        self.max_queue = max_queue
        # A prefix pool's sessions prefill a finished turn's answer again while idle (histories,
        # ``runner.batch``); False leaves the batch idle between requests.
        self.pool_answers = pool_answers
        # Record every verified length point's graphs while loading (``Session.prerecord``), so
        # no request pays for a point's first use (``--prerecord``); False: each on its first use.
        self.prerecord = prerecord
        self.recorded: dict[str, Prerecorded] = {}  # per model, what loading recorded
        self.models: dict[str, ServedModel] = {}
        self.load: dict[str, ModelLoad] = {}
        self._sessions: dict[str, Session] = {}
        self._queue: queue.Queue = queue.Queue()
        self._pending: deque[Job] = deque()  # taken off the queue, waiting for a slot (worker thread)
        self._lock = threading.Lock()
        self._waiting = 0
        self._current: Job | None = None  # the batch-1 request running
        self._slots: dict[str, dict[int, tuple[Job, BatchSequence]]] = {}  # batched: running
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._peak = 0  # MLX's peak before its counter was last reset (loading, batched steps)
        self._stopping = False
        self.served = 0  # requests finished (any outcome)
        self._thread = threading.Thread(target=self._main, name="dctms-mlx", daemon=True)

    # ------------------------------------------------------------------ lifecycle (any thread)

    def start(self) -> None:
        """Load every session on the worker thread; raises its first error (nothing served)."""
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            self._thread.join()
            raise self._load_error

    def withdraw(self) -> None:
        """The server is stopping: refuse new requests, end the running ones at their next token;
        the queued ones are then answered with ``Cancelled``, one after another, at once."""
        with self._lock:
            self._stopping = True
            running = [self._current] if self._current is not None else []
            running += [job for held in self._slots.values() for job, _ in held.values()]
        for job in running:
            job.cancelled.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Withdraw every queued request, end the running ones at their next token, join."""
        self.withdraw()
        self._queue.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._stopping:
                raise Cancelled(SHUTTING_DOWN)
            if self._waiting >= self.max_queue:
                raise QueueFull(f"{self._waiting} requests are already waiting (--max-queue)")
            self._waiting += 1
            if job.model in self.load:
                self.load[job.model].waiting += 1
        self._queue.put(job)

    # ----------------------------------------------------------------------- figures (any thread)

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        with self._lock:
            return (self._current is not None) + sum(len(h) for h in self._slots.values())

    def observed_peak(self) -> int:
        """MLX's peak memory since the first session began loading (each Session resets MLX's
        counter as it starts, and the worker before each batched step: the peaks seen before
        are kept here)."""
        return max(self._peak, mx.get_peak_memory())

    def active_memory(self) -> int:
        return mx.get_active_memory()

    def model_load(self) -> dict[str, dict]:
        """Per model: its slots, slots busy, requests waiting, tokens and aggregate tok/s, and a
        batched model's observed peak against its plan's envelope."""
        out = {}
        with self._lock:
            for name, load in self.load.items():
                env = self.models[name].plan.envelope
                out[name] = {
                    "slots": load.slots,
                    "slots_busy": load.busy,
                    "queue_waiting": load.waiting,
                    "tokens_generated": load.tokens,
                    "busy_s": round(load.busy_s, 3),
                    "tokens_per_s": round(load.tokens_per_s, 3),
                    "observed_mlx_peak_bytes": load.peak_observed if load.slotted else None,
                    "slot_moves": load.slot_moves if load.slotted else None,
                    "prefix_pool": dict(load.pool) if load.pool is not None else None,
                    "envelope_provable_bytes": env.provable,
                    "m_max_bytes": env.total,
                }
        return out

    # -------------------------------------------------------------------- the worker thread

    def _main(self) -> None:
        try:
            self._load()
        except BaseException as err:  # reported to start(), which raises it in the caller
            self._load_error = err
            self._ready.set()
            return
        self._ready.set()
        while self._take_queued(block=not self._pending and not self._batches_busy(),
                                wait_s=HISTORY_GRACE_S if self._histories_left() else None):  # fmt: skip
            self._start_pending()
            self._step_batches()
        self._end_everything()
        self._drain()

    def _load(self) -> None:
        for spec, plan in self._specs:
            folder = open_model_folder(spec.model_dir)
            tokenizer = Tokenizer(folder.path)
            warm_chat_template(tokenizer)
            batched = slotted(plan.bounds)
            session = (BatchSession if batched else Session)(plan, folder)
            if batched:
                session.keep_answers = self.pool_answers
            self._sessions[spec.name] = session
            if self.prerecord:
                self.recorded[spec.name] = session.prerecord()
            self._peak = max(self._peak, mx.get_peak_memory())
            stop = frozenset(tokenizer.eos_ids)
            self.models[spec.name] = ServedModel(spec.name, plan, tokenizer, stop)
            self.load[spec.name] = ModelLoad(plan.bounds.batch, batched)
            if batched:
                self.load[spec.name].pool = session.pool_summary(table=False)
                self._slots[spec.name] = {}
        if not self._sessions:
            raise DctmsError("no --plan given: nothing to serve")

    def _take_queued(self, block: bool, wait_s: float | None = None) -> bool:
        """Move the queued jobs into ``_pending`` (waiting for one when ``block``, at most
        ``wait_s`` when given); False once the server stops."""
        try:
            job = self._queue.get(timeout=wait_s) if block else self._queue.get_nowait()
        except queue.Empty:
            return True
        while True:
            if job is _STOP:
                return False
            self._pending.append(job)
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return True

    def _batches_busy(self) -> bool:
        """A batched model has requests waiting or running (its histories are not counted)."""
        return any(self._sessions[name].live or held for name, held in self._slots.items())

    def _histories_left(self) -> bool:
        """A batched model has finished turns to give its pool (``runner.batch.History``)."""
        return any(self._sessions[name].histories for name in self._slots)

    def _start_pending(self) -> None:
        """At a step boundary: each pending job (in arrival order) takes a free slot of its
        batched model, or, for a batch-1 model, runs now to its end; the others keep waiting."""
        keep: deque[Job] = deque()
        while self._pending:
            job = self._pending.popleft()
            batched = job.model in self._slots
            if not self._stopping and not job.cancelled.is_set() and batched:
                if len(self._slots[job.model]) >= self.load[job.model].slots:
                    keep.append(job)
                else:
                    self._admit(job)
                continue
            self._take_off_queue(job, running=not batched)
            try:
                if self._stopping:
                    raise Cancelled(SHUTTING_DOWN)
                if job.cancelled.is_set():
                    raise Cancelled("withdrawn before it ran")
                done = (self._run(job), None)
            except BaseException as err:
                done = (None, err)
            self._finish(job, *done)
        self._pending = keep

    def _take_off_queue(self, job: Job, running: bool) -> None:
        with self._lock:
            self._waiting -= 1
            load = self.load[job.model]
            load.waiting -= 1
            if running:
                self._current = job
                load.busy += 1

    def _finish(self, job: Job, gen: Generation | None, err: BaseException | None) -> None:
        # Not running any more before the client hears it is done: a status read right
        # after the response must not still count this request as running.
        with self._lock:
            if self._current is job:
                self._current = None
                self.load[job.model].busy -= 1
            self.served += 1
        job.on_done(gen, err)

    def _counting(self, job: Job) -> Callable[[int], bool]:
        load = self.load[job.model]

        def on_token(token: int) -> bool:
            load.tokens += 1
            wanted = job.on_token(token) is not False
            return wanted and not job.cancelled.is_set()

        return on_token

    def _run(self, job: Job) -> Generation:
        session = self._sessions[job.model]
        foreign = max(0, mx.get_active_memory() - session.held_bytes())
        session.apply_limits(foreign)
        start = time.perf_counter()
        try:
            gen = session.generate(job.request, self._counting(job), job.on_logprobs)
        finally:
            self.load[job.model].busy_s += time.perf_counter() - start
        if job.cancelled.is_set():
            raise Cancelled(SHUTTING_DOWN if self._stopping else "withdrawn while it ran")
        return gen

    # ------------------------------------------------------------------ batched models

    def _admit(self, job: Job) -> None:
        session = self._sessions[job.model]
        assert isinstance(session, BatchSession)
        seq = session.submit(job.request, self._counting(job))
        self._take_off_queue(job, running=False)
        with self._lock:
            self._slots[job.model][id(job)] = (job, seq)
            self.load[job.model].busy += 1

    def _step_batches(self) -> None:
        """One iteration of every batched model with work: its withdrawn requests cancelled
        first, its ended ones answered after."""
        for name, held in self._slots.items():
            session = self._sessions[name]
            assert isinstance(session, BatchSession)
            for job, seq in list(held.values()):
                if job.cancelled.is_set() and not seq.done:
                    session.cancel(seq)
            error = None
            if not session.idle:
                error = self._iterate(name, session)
            for key, (job, seq) in list(held.items()):
                if not seq.done and error is None:
                    continue
                with self._lock:
                    del held[key]
                    self.load[name].busy -= 1
                if error is not None:
                    session.cancel(seq)
                    self._finish(job, None, error)
                elif job.cancelled.is_set():
                    why = SHUTTING_DOWN if self._stopping else "withdrawn while it ran"
                    self._finish(job, None, Cancelled(why))
                else:
                    self._finish(job, seq.generation, None)

    def _iterate(self, name: str, session: BatchSession) -> BaseException | None:
        """One ``iterate`` at this model's limits: its envelope check compares the step's own
        peak (MLX's counter reset, the earlier peak kept) with what others hold set aside."""
        foreign = max(0, mx.get_active_memory() - session.held_bytes())
        session.apply_limits(foreign)
        session.baseline = foreign  # what observed_peak subtracts: the other models' arrays
        self._peak = max(self._peak, mx.get_peak_memory())
        mx.reset_peak_memory()
        start = time.perf_counter()
        try:
            session.iterate()
        except BaseException as err:  # e.g. EnvelopeExceeded: every sequence of it is answered
            return err
        finally:
            load = self.load[name]
            load.busy_s += time.perf_counter() - start
            load.peak_observed = max(load.peak_observed, session.stats.peak_observed)
            load.slot_moves = session.stats.moves
            load.pool = session.pool_summary(table=False)
        return None

    def _end_everything(self) -> None:
        """The server stops: the pending and the running requests are answered ``Cancelled``."""
        for job in self._pending:
            self._take_off_queue(job, running=False)
            self._finish(job, None, Cancelled(SHUTTING_DOWN))
        self._pending.clear()
        for name, held in self._slots.items():
            for key, (job, seq) in list(held.items()):
                self._sessions[name].cancel(seq)  # type: ignore[attr-defined]
                with self._lock:
                    del held[key]
                    self.load[name].busy -= 1
                self._finish(job, None, Cancelled(SHUTTING_DOWN))

    def _drain(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not _STOP:
                job.on_done(None, Cancelled(SHUTTING_DOWN))
