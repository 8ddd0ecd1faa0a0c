"""The ASGI app (Starlette): OpenAI's /v1/models, /v1/completions, /v1/chat/completions, and the
pool's memory figures at /status (JSON) and /metrics (Prometheus text). Every route sits behind
``security.Guard`` (Host, API key); every error, 404 and 405 included, is an OpenAI-style JSON body."""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import sys
import time
import uuid
from collections.abc import AsyncIterator

import psutil
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from dctms.runner.request import Request as RunnerRequest
from dctms.runner.request import RequestRefused, validate_request
from dctms.runner.session import Generation
from dctms.runner.stops import StopText, finish_reason
from dctms.serve.body import BodyError, ClientGone, check_media_type, parse_json, read_body
from dctms.serve.chat import encode_messages
from dctms.serve.protocol import (
    ApiError,
    CompletionRequest,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    parse_request,
    refusal,
    usage,
    usage_chunk,
)
from dctms.serve.sampling_fields import (
    logprobs_body,
    logprobs_rows,
    sampling_params,
    split_sampling,
)
from dctms.serve.security import Guard, error_body
from dctms.serve.worker import Cancelled, Job, QueueFull, ServedModel, Worker

MAX_BODY_BYTES = 2**20


class ServerState:
    """What the handlers share: the worker, the pool's envelope (composed by the caller), the
    largest request body accepted."""

    def __init__(self, worker: Worker, pool: dict, max_body_bytes: int = MAX_BODY_BYTES):
        self.worker = worker
        self.pool = pool
        self.max_body_bytes = max_body_bytes
        self.stopping = asyncio.Event()
        self.started = time.time()
        self.refused = 0
        self.disconnected = 0
        self._proc = psutil.Process()

    def begin_shutdown(self) -> None:
        """The server stops (on its event loop): bodies still arriving get 503, the worker
        withdraws its queue and ends the running request at its next token."""
        self.stopping.set()
        self.worker.withdraw()

    def status(self) -> dict:
        w = self.worker
        peak = w.observed_peak()
        provable = self.pool["provable"]
        rss = self._proc.memory_info().rss
        rss_peak = max(rss, _peak_rss())
        return {
            "models": sorted(w.models),
            "envelope": self.pool,
            "envelope_provable_bytes": provable,
            "envelope_total_bytes": self.pool["total"],
            "observed_mlx_peak_bytes": peak,
            "within_envelope": peak <= provable,
            "active_bytes": w.active_memory(),
            "rss_bytes": rss,
            "rss_peak_bytes": rss_peak,
            "rss_within_envelope_total": rss <= self.pool["total"],
            "queue_waiting": w.waiting,
            "queue_running": w.running,
            "queue_limit": w.max_queue,
            "requests_finished": w.served,
            "requests_refused": self.refused,
            "clients_disconnected": self.disconnected,
            "uptime_s": round(time.time() - self.started, 3),
            "per_model": w.model_load(),  # slots, slots busy, queue, tok/s, peak vs envelope
        }


def _peak_rss() -> int:
    """The process's largest resident set since it started: the kernel's high-water mark
    (``ru_maxrss``, KiB on Linux, bytes on macOS), which no sampling between requests can miss."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def build_app(worker: Worker, pool: dict, hosts: frozenset[str], api_key: str | None,
              max_body_bytes: int = MAX_BODY_BYTES) -> tuple[Guard, ServerState]:
    """The app behind its guard (requests whose Host is not in ``hosts`` get 403, without
    ``Authorization: Bearer api_key`` (when there is a key) 401), and its state, whose
    ``begin_shutdown`` the server calls as it begins to stop."""
    state = ServerState(worker, pool, max_body_bytes)

    async def models(request: Request) -> Response:
        data = [
            {
                "id": m.name,
                "object": "model",
                "created": int(state.started),
                "owned_by": "dctms",
                "max_prompt_tokens": m.max_prompt,
                "max_output_tokens": m.max_tokens,
                "m_max_bytes": m.plan.envelope.total,
            }
            for m in worker.models.values()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def status(request: Request) -> Response:
        return JSONResponse(state.status())

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(prometheus(state.status()))

    async def completions(request: Request) -> Response:
        return await _complete(request, state, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _complete(request, state, chat=True)

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/status", status, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        worker.stop()  # after the last connection closed: withdraw what is still queued

    handlers = {HTTPException: _http_error, Exception: _internal_error}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.router.redirect_slashes = False  # "/v1/completions/" is no route (404), not a redirect
    app.state.server = state
    return Guard(app, hosts, api_key), state


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route: 404; a route without that method: 405)."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {request.url.path!r}: this server serves /v1/models, " \
                  "/v1/completions, /v1/chat/completions, /status and /metrics"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path!r} " \
                  f"(allowed: {(exc.headers or {}).get('Allow', 'none')})"
    else:
        message = str(exc.detail)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "error")
    return JSONResponse(error_body(exc.status_code, message, code), status_code=exc.status_code,
                        headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    """A bug: the traceback goes to the log (Starlette logs it), the client gets JSON."""
    body = error_body(500, f"internal error: {type(exc).__name__}", "internal_error")
    return JSONResponse(body, status_code=500)


def _error(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if err.status == 503 else {}
    if isinstance(err, BodyError) and err.close:
        headers["Connection"] = "close"
    return JSONResponse(err.body(), status_code=err.status, headers=headers or None)


async def _complete(request: Request, state: ServerState, chat: bool) -> Response:
    try:
        check_media_type(request.headers.get("content-type"))
        raw = await read_body(request.receive, dict(request.scope["headers"]),
                              state.max_body_bytes, state.stopping)
        # Parsing, checking and tokenising take a while on a large body: off the event loop
        # (the tokenizer releases the GIL), so /status and other requests stay responsive.
        # The sampling fields are split off here and checked against the served plan below.
        req, sampling = await run_in_threadpool(_parse, raw, chat)
        served = state.worker.models.get(req.model)
        if served is None:
            names = ", ".join(sorted(state.worker.models))
            raise ApiError(404, f"model {req.model!r} is not served here (served: {names})",
                           "model")
        if req.messages is not None:
            prompt = await run_in_threadpool(encode_messages, served.tokenizer, req.messages)
        else:
            prompt = await run_in_threadpool(_prompt_ids, served, req)
        max_tokens = req.max_tokens if req.max_tokens is not None else served.max_tokens
        params = sampling_params(sampling, served.plan, chat)
        try:  # the runner's own check, before the request queues; the worker takes this request
            validated = validate_request(
                served.plan, prompt, max_tokens, served.stop_ids, params
            )
        except RequestRefused as err:
            raise refusal(req.model, err, "messages" if chat else "prompt") from None
        call = _Call(state, served, req, validated, chat)
        if req.stream and (params.logprobs or params.top_logprobs > 0):
            call.stream_logprobs()
        call.submit()
    except ApiError as err:
        state.refused += 1
        return _error(err)
    except ClientGone:
        state.disconnected += 1
        return Response(status_code=400)  # never sent: the connection is gone
    if req.stream:
        return StreamingResponse(call.sse(request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await call.respond(request)


def _parse(raw: bytes, chat: bool) -> tuple[CompletionRequest, dict]:
    """The request and its sampling fields (``serve.sampling_fields``: checked per plan)."""
    body, sampling = split_sampling(parse_json(raw))
    return parse_request(body, chat), sampling


def _prompt_ids(served: ServedModel, req: CompletionRequest) -> list[int]:
    if isinstance(req.prompt, str):
        return served.tokenizer.encode(req.prompt)
    return list(req.prompt or [])


class _Call:
    """One request's trip through the worker: tokens arrive from its thread on an asyncio queue."""

    def __init__(self, state: ServerState, served: ServedModel, req: CompletionRequest,
                 request: RunnerRequest, chat: bool):
        self.state, self.served, self.req = state, served, req
        self.prompt, self.chat = request.prompt, chat
        self.rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        # Fed on the worker thread (which ends the generation at a stop string); read here only
        # after its "done" event.
        self.text = StopText(served.tokenizer.decode, req.stop, served.stop_ids)
        self.job = Job(req.model, request, self._on_token, self._on_done)
        # A stream that asked for log-probabilities: each token's, paired with it on the worker
        # thread and sent with the text piece its token released (the rest with the last chunk).
        self.pending: list[tuple[int, object]] = []
        self.lp_next = None
        self.sent_chars = 0

    def stream_logprobs(self) -> None:
        self.job.on_logprobs = self._on_logprobs

    def _on_logprobs(self, lp) -> None:
        self.lp_next = lp

    def _take_logprobs(self) -> dict | None:
        if self.job.on_logprobs is None:
            return None
        rows, self.pending = self.pending, []
        body = logprobs_rows(rows, self.served.stop_ids, self.served.tokenizer.decode, self.chat,
                             self.sent_chars)
        return body

    def submit(self) -> None:
        try:
            self.state.worker.submit(self.job)
        except QueueFull as err:
            raise ApiError(503, f"server busy: {err}; retry later", None, "queue_full") from None
        except Cancelled as err:
            raise ApiError(503, str(err), None, "shutting_down") from None

    # Called on the worker thread: hand over to the event loop (which may be gone at shutdown).
    def _on_token(self, token: int) -> bool:
        """Release the text ``token`` settles; False (end the generation) at a stop string."""
        if self.lp_next is not None:
            self.pending.append((token, self.lp_next))
            self.lp_next = None
        piece = self.text.push(token)
        if piece:
            self._post(("text", piece, self._take_logprobs()))
            self.sent_chars += len(piece)
        return not self.text.stopped

    def _on_done(self, gen: Generation | None, err: BaseException | None) -> None:
        if err is None:
            rest = self.text.finish()  # a tail held back for a stop string that never came
            if rest or self.pending:
                self._post(("text", rest, self._take_logprobs()))
        self._post(("done", gen, err))

    def _post(self, event: tuple) -> None:
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def _finish_reason(self, gen: Generation) -> str:
        return finish_reason(gen.tokens, self.served.stop_ids, self.text.stopped)

    async def _watch(self, request: Request) -> None:
        """Withdraw the job when the client goes away (it is then never run, or ends at its
        next token), so a vanished client costs the worker at most one step."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.job.cancelled.set()
                self.state.disconnected += 1
                return

    async def respond(self, request: Request) -> Response:
        watcher = asyncio.create_task(self._watch(request))
        try:
            while True:
                event = await self.events.get()
                if event[0] == "done":
                    break
        finally:
            watcher.cancel()
            self.job.cancelled.set()  # no-op when finished; withdraws it when this task is cancelled
        _, gen, err = event
        if err is not None:
            return _error(_as_api_error(err))
        text = self.text.text
        use = usage(len(self.prompt), len(gen.tokens), gen.cached_tokens)
        ids = gen.tokens if self.req.return_token_ids else None
        make = chat_body if self.chat else completion_body
        body = make(self.rid, self.created, self.req.model, text, self._finish_reason(gen), use, ids)
        logprobs = logprobs_body(gen, self.served.stop_ids, self.served.tokenizer.decode, self.chat)
        if logprobs is not None:
            body["choices"][0]["logprobs"] = logprobs
        return JSONResponse(body)

    async def sse(self, request: Request) -> AsyncIterator[str]:
        model, rid, created = self.req.model, self.rid, self.created
        finished = False
        try:
            if self.chat:
                yield _data(chat_chunk(rid, created, model, {"role": "assistant", "content": ""},
                                       None))
            while True:
                event = await self.events.get()
                if event[0] == "text":
                    yield _data(self._chunk(event[1], None, event[2]))
                    continue
                _, gen, err = event
                finished = True
                if err is not None:
                    yield _data(_as_api_error(err).body())
                    break
                finish = self._finish_reason(gen)
                if self.chat:
                    yield _data(chat_chunk(rid, created, model, {}, finish))
                else:
                    yield _data(completion_chunk(rid, created, model, "", finish))
                if self.req.include_usage:
                    use = usage(len(self.prompt), len(gen.tokens), gen.cached_tokens)
                    yield _data(usage_chunk(rid, created, model, self.chat, use))
                break
            yield "data: [DONE]\n\n"
        finally:
            # Runs when the stream ends, and when the client disconnects (the generator is
            # closed or cancelled): the worker then drops the job at its next token.
            if not finished:
                self.state.disconnected += 1
            self.job.cancelled.set()

    def _chunk(self, piece: str, finish: str | None, logprobs: dict | None = None) -> dict:
        if self.chat:
            chunk = chat_chunk(self.rid, self.created, self.req.model, {"content": piece}, finish)
        else:
            chunk = completion_chunk(self.rid, self.created, self.req.model, piece, finish)
        chunk["choices"][0]["logprobs"] = logprobs
        return chunk


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _as_api_error(err: BaseException) -> ApiError:
    if isinstance(err, ApiError):
        return err
    if isinstance(err, Cancelled):
        return ApiError(503, f"request withdrawn: {err}", None, "cancelled")
    return ApiError(500, f"generation failed: {err}", None, "generation_failed")


def prometheus(status: dict) -> str:
    gauges = [
        ("dctms_envelope_provable_bytes", "pool envelope MLX's peak must stay within",
         status["envelope_provable_bytes"]),
        ("dctms_envelope_total_bytes", "pool M_max including the runtime allowance",
         status["envelope_total_bytes"]),
        ("dctms_observed_mlx_peak_bytes", "MLX peak memory since the server started",
         status["observed_mlx_peak_bytes"]),
        ("dctms_active_bytes", "MLX active memory now", status["active_bytes"]),
        ("dctms_rss_bytes", "server process resident set size now", status["rss_bytes"]),
        ("dctms_rss_peak_bytes", "server process resident set size, its peak since it started",
         status["rss_peak_bytes"]),
        ("dctms_queue_waiting", "requests waiting for the worker", status["queue_waiting"]),
        ("dctms_queue_running", "requests the worker is running", status["queue_running"]),
        ("dctms_requests_finished_total", "requests the worker finished",
         status["requests_finished"]),
        ("dctms_requests_refused_total", "requests refused before queueing",
         status["requests_refused"]),
    ]
    lines = []
    for name, help_text, value in gauges:
        kind = "counter" if name.endswith("_total") else "gauge"
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    lines += model_gauges(status.get("per_model", {}))
    return "\n".join(lines) + "\n"


MODEL_GAUGES = [  # (metric, the per_model field, help)
    ("dctms_model_slots", "slots", "slots the model's plan holds (its batch B; 1: one at a time)"),
    ("dctms_model_slots_busy", "slots_busy", "slots holding a running request"),
    ("dctms_model_queue_waiting", "queue_waiting", "the model's requests waiting for a slot"),
    ("dctms_model_tokens_generated_total", "tokens_generated", "tokens the model generated"),
    ("dctms_model_tokens_per_s", "tokens_per_s", "aggregate tokens/s while the model was busy"),
    ("dctms_model_observed_mlx_peak_bytes", "observed_mlx_peak_bytes",
     "a batched model's largest MLX peak in a step, above what the other models hold"),
    ("dctms_model_envelope_provable_bytes", "envelope_provable_bytes",
     "the model's plan's provable peak (its observed peak stays within it)"),
    ("dctms_model_m_max_bytes", "m_max_bytes", "the model's plan's M_max"),
    ("dctms_model_slot_moves_total", "slot_moves",
     "a batched model's sequences moved down to a free slot (so steps compute only busy rows)"),
]


POOL_GAUGES = [  # (metric, the prefix_pool field, help): models whose plan has a prefix pool
    ("dctms_prefix_pool_blocks", "blocks", "blocks of the plan's prompt-prefix pool (never more)"),
    ("dctms_prefix_pool_blocks_used", "used", "pool blocks holding a cached prompt chunk"),
    ("dctms_prefix_pool_lookups_total", "lookups", "requests looked up in the pool"),
    ("dctms_prefix_pool_hit_blocks_total", "hit_blocks", "blocks loaded into a slot, not prefilled"),
    ("dctms_prefix_pool_hit_tokens_total", "hit_tokens", "prompt tokens taken from the pool"),
    ("dctms_prefix_pool_whole_prompt_hits_total", "whole_prompt_hits",
     "prompts the pool held whole: answered without a prefill call"),
    ("dctms_prefix_pool_saved_blocks_total", "saved_blocks", "blocks written with a prompt's chunks"),
    ("dctms_prefix_pool_history_chunks_total", "history_chunks",
     "chunks of finished answers prefilled again for the pool (a chat's next turn re-sends them)"),
    ("dctms_prefix_pool_evictions_total", "evictions",
     "blocks taken from the least recently used prefix for a new one (the pool never grows)"),
]


def model_gauges(per_model: dict[str, dict]) -> list[str]:
    """One labelled series per served model (``model="NAME"``) for each of ``MODEL_GAUGES``, and
    for each of ``POOL_GAUGES`` of the models with a prefix pool."""
    lines = []
    pools = {m: f["prefix_pool"] for m, f in per_model.items() if f.get("prefix_pool")}
    for gauges, figures_of in ((MODEL_GAUGES, per_model), (POOL_GAUGES, pools)):
        for name, field, help_text in gauges:
            kind = "counter" if name.endswith("_total") else "gauge"
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            for model, figures in sorted(figures_of.items()):
                if figures.get(field) is not None:
                    label = model.replace("\\", "\\\\").replace('"', '\\"')
                    lines.append(f'{name}{{model="{label}"}} {figures[field]}')
    return lines
