"""The one thread that touches MLX: it loads every plan's session, then runs requests one at a time.

Serialising the MLX calls is what makes the pool's promise hold: a call's arena is free again when
it returns, so one shared arena (the largest plan's) covers every model. Before each call the
running session's memory limit is set to its own throttle limit plus what the other sessions hold
(``foreign`` bytes), exactly as the benchmarks do when two systems share a process.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from dctms.runner.request import Request
from dctms.runner.sampling import TokenLogprobs
from dctms.runner.session import Generation, Session
from dctms.runner.tokenize import Tokenizer
from dctms.schema.errors import DctmsError
from dctms.schema.model_folder import open_model_folder
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


_STOP = object()
SHUTTING_DOWN = "the server is shutting down"


class Worker:
    def __init__(self, specs: list[tuple[PlanSpec, Plan]], max_queue: int = 64):
        self._specs = specs
        self.max_queue = max_queue
        self.models: dict[str, ServedModel] = {}
        self._sessions: dict[str, Session] = {}
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._current: Job | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._load_peak = 0
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
        """The server is stopping: refuse new requests, end the running one at its next token;
        the queued ones are then answered with ``Cancelled``, one after another, at once."""
        with self._lock:
            self._stopping = True
            current = self._current
        if current is not None:
            current.cancelled.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Withdraw every queued request, end the running one at its next token, join."""
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
        self._queue.put(job)

    # ----------------------------------------------------------------------- figures (any thread)

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return 0 if self._current is None else 1

    def observed_peak(self) -> int:
        """MLX's peak memory since the first session began loading (each Session resets MLX's
        counter as it starts, so the peaks seen while loading are kept here)."""
        return max(self._load_peak, mx.get_peak_memory())

    def active_memory(self) -> int:
        return mx.get_active_memory()

    # -------------------------------------------------------------------- the worker thread

    def _main(self) -> None:
        try:
            self._load()
        except BaseException as err:  # reported to start(), which raises it in the caller
            self._load_error = err
            self._ready.set()
            return
        self._ready.set()
        while True:
            job = self._queue.get()
            if job is _STOP:
                break
            with self._lock:
                self._waiting -= 1
                self._current = job
                stopping = self._stopping
            try:
                if stopping:
                    raise Cancelled(SHUTTING_DOWN)
                if job.cancelled.is_set():
                    raise Cancelled("withdrawn before it ran")
                done = (self._run(job), None)
            except BaseException as err:
                done = (None, err)
            # Not running any more before the client hears it is done: a status read right
            # after the response must not still count this request as running.
            with self._lock:
                self._current = None
                self.served += 1
            job.on_done(*done)
        self._drain()

    def _load(self) -> None:
        for spec, plan in self._specs:
            folder = open_model_folder(spec.model_dir)
            tokenizer = Tokenizer(folder.path)
            warm_chat_template(tokenizer)
            self._sessions[spec.name] = Session(plan, folder)
            self._load_peak = max(self._load_peak, mx.get_peak_memory())
            stop = frozenset(tokenizer.eos_ids)
            self.models[spec.name] = ServedModel(spec.name, plan, tokenizer, stop)
        if not self._sessions:
            raise DctmsError("no --plan given: nothing to serve")

    def _run(self, job: Job) -> Generation:
        session = self._sessions[job.model]
        foreign = max(0, mx.get_active_memory() - session.held_bytes())
        session.apply_limits(foreign)

        def on_token(token: int) -> bool:
            wanted = job.on_token(token) is not False
            return wanted and not job.cancelled.is_set()

        gen = session.generate(job.request, on_token, job.on_logprobs)
        if job.cancelled.is_set():
            raise Cancelled(SHUTTING_DOWN if self._stopping else "withdrawn while it ran")
        return gen

    def _drain(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not _STOP:
                job.on_done(None, Cancelled(SHUTTING_DOWN))
