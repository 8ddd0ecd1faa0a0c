"""`dctms serve` with a batched plan (continuous batching, issue #29): requests take free slots at
step boundaries and give them back at a stop, ``max_tokens`` or a client that went away; the rest
wait in the bounded queue. Tiny random-weight models: ``beta4`` is beta's folder under a B = 4
plan, ``solo`` the same folder under beta's batch-1 plan (the reference), ``alpha`` another model
in the same pool (a batch-1 model whose requests interleave with the batched one's steps)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from serve_helpers import TINY_MODELS, ServerProcess, TinyServed, build_tiny_models  # noqa: F401

pytestmark = pytest.mark.slow

SLOTS = 4
PROMPTS = [f"prompt {k} " + "word " * k for k in range(2 * SLOTS)]  # mixed lengths


def _batched_plan(served, slots: int = SLOTS) -> Path:
    from dctms.schema.io import write_plan
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions, compile_plan

    plan = compile_plan(
        open_model(served.folder),
        CompileOptions(served.n, served.m, prefill_chunk=16, batch=slots),
    )
    path = served.folder / f"{served.name}{slots}.plan"
    write_plan(plan, path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Built in a child process: the worker tests below run MLX on the worker's thread in this
    process, and a plan compiled on the main thread first leaves MLX state that thread cannot use
    ("There is no Stream(cpu, 0) in current thread"; `dctms serve` itself never compiles)."""
    root = tmp_path_factory.mktemp("serve-batch")
    script = (
        "import sys; sys.path[:0] = [sys.argv[1]]; from pathlib import Path; "
        "from test_serve_batch import build_tiny_models, _batched_plan; "
        "_batched_plan(build_tiny_models(Path(sys.argv[2]))['beta'])"
    )
    subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent), str(root)],
                   check=True, timeout=300)  # fmt: skip
    models = {
        name: TinyServed(name, root / name / f"{name}.plan", root / name, n, m)
        for name, (_, _, n, m) in TINY_MODELS.items()
    }
    return models, root / "beta" / f"beta{SLOTS}.plan"


@pytest.fixture(scope="module")
def server(models):
    tiny, beta4 = models
    beta = tiny["beta"]
    proc = ServerProcess([
        "--plan", tiny["alpha"].spec(),
        "--plan", f"solo={beta.plan}={beta.folder}",
        "--plan", f"beta4={beta4}={beta.folder}",
        "--memory", "1GiB",
    ])  # fmt: skip
    yield proc
    proc.close()


def _post(url: str, body: dict, timeout_s: float = 120) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _ids(server, model: str, prompt: str, max_tokens: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True}
    status, raw = _post(server.url + "/v1/completions", body)
    assert status == 200, raw
    return json.loads(raw)["choices"][0]["token_ids"]


def _streamed_text(server, model: str, prompt: str, max_tokens: int) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    status, raw = _post(server.url + "/v1/completions", body)
    assert status == 200, raw
    text = []
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            assert "error" not in event, event
            text.append(event["choices"][0]["text"])
    assert raw.decode().rstrip().endswith("data: [DONE]")
    return "".join(text)


def _per_model(server, name: str) -> dict:
    return server.status()["per_model"][name]


def _wait_idle(server, name: str, deadline_s: float = 60) -> dict:
    """The model's figures once nothing of it runs or waits (a generous deadline, not a timing
    assertion: a test that waits this long has failed anyway)."""
    deadline = time.monotonic() + deadline_s
    while True:
        figures = _per_model(server, name)
        if figures["slots_busy"] == 0 and figures["queue_waiting"] == 0:
            return figures
        assert time.monotonic() < deadline, figures
        time.sleep(0.05)


def test_concurrent_requests_equal_each_prompt_served_alone(server, models):
    m = models[0]["beta"].m
    alone = {p: _ids(server, "solo", p, m) for p in PROMPTS}
    alone_text = {p: _streamed_text(server, "solo", p, m) for p in PROMPTS}
    alpha_alone = {p: _ids(server, "alpha", p, 4) for p in PROMPTS[:3]}

    def ask(k: int):
        p = PROMPTS[k % len(PROMPTS)]
        if k % 5 == 4:  # the other model's requests interleave with the batched steps
            return ("alpha", p, _ids(server, "alpha", p, 4)) if p in alpha_alone else None
        if k % 2:
            return ("ids", p, _ids(server, "beta4", p, m))
        return ("text", p, _streamed_text(server, "beta4", p, m))

    with ThreadPoolExecutor(3 * SLOTS) as pool:
        outcomes = [o for o in pool.map(ask, range(6 * SLOTS)) if o is not None]
    assert len(outcomes) >= 4 * SLOTS
    for kind, p, got in outcomes:
        want = {"ids": alone, "text": alone_text, "alpha": alpha_alone}[kind][p]
        assert got == want, (kind, p)
    figures = _wait_idle(server, "beta4")
    assert figures["slots"] == SLOTS and figures["tokens_generated"] > 0
    assert figures["observed_mlx_peak_bytes"] <= figures["envelope_provable_bytes"]
    st = server.status()
    assert st["within_envelope"] and st["queue_running"] == 0


def test_a_client_that_disconnects_mid_stream_never_leaves_a_slot_busy(server, models):
    m = models[0]["beta"].m
    before = server.status()["clients_disconnected"]
    body = json.dumps({"model": "beta4", "prompt": "go away", "max_tokens": m, "stream": True})
    host, port = server.address
    for _ in range(SLOTS + 1):  # more than the slots: a leak would leave the model full
        with socket.create_connection((host, port), timeout=30) as s:
            s.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
                .encode()
            )
            assert b"200 OK" in s.recv(200)  # the stream began; now vanish
    figures = _wait_idle(server, "beta4")
    assert figures["slots_busy"] == 0
    assert server.status()["clients_disconnected"] > before
    # a later request is served, in full
    assert _ids(server, "beta4", PROMPTS[1], m) == _ids(server, "solo", PROMPTS[1], m)
    assert _wait_idle(server, "beta4")["slots_busy"] == 0


def test_sampling_on_a_batched_plan_is_refused_naming_why(server):
    for extra in ({"temperature": 0.7}, {"logprobs": 2}):
        body = {"model": "beta4", "prompt": "hi", "max_tokens": 2, **extra}
        status, raw = _post(server.url + "/v1/completions", body)
        assert status == 400, raw
        message = json.loads(raw)["error"]["message"]
        assert "batched" in message and "greedily" in message and "--sampling" in message


def test_metrics_show_the_slots_per_model(server):
    _ids(server, "beta4", "count me", 3)
    _wait_idle(server, "beta4")
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    series = {}
    for line in text.splitlines():
        if line.startswith("dctms_model_"):
            key, value = line.rsplit(" ", 1)
            series[key] = float(value)
    assert series['dctms_model_slots{model="beta4"}'] == SLOTS
    assert series['dctms_model_slots{model="alpha"}'] == 1
    assert series['dctms_model_slots_busy{model="beta4"}'] == 0
    assert series['dctms_model_queue_waiting{model="beta4"}'] == 0
    assert series['dctms_model_tokens_generated_total{model="beta4"}'] >= 3
    assert series['dctms_model_tokens_per_s{model="beta4"}'] > 0
    observed = series['dctms_model_observed_mlx_peak_bytes{model="beta4"}']
    assert 0 < observed <= series['dctms_model_envelope_provable_bytes{model="beta4"}']
    assert series['dctms_model_m_max_bytes{model="beta4"}'] > observed
    assert 'dctms_model_observed_mlx_peak_bytes{model="alpha"}' not in series  # batched only
    assert series['dctms_model_slot_moves_total{model="beta4"}'] >= 0
    assert 'dctms_model_slot_moves_total{model="alpha"}' not in series
    assert "# TYPE dctms_model_slot_moves_total counter" in text
    assert "# TYPE dctms_model_tokens_generated_total counter" in text


# ------------------------------------------------------------ the worker itself, in-process


@pytest.fixture(scope="module")
def worker(models):
    from dctms.runner.load import load_checked_plan
    from dctms.serve.spec import PlanSpec
    from dctms.serve.worker import Worker

    tiny, beta4 = models
    spec = PlanSpec("beta4", beta4, tiny["beta"].folder)
    w = Worker([(spec, load_checked_plan(beta4))], max_queue=1, prerecord=True)
    w.start()
    yield w
    w.stop()


class _Client:
    """A job's callbacks: records tokens and the outcome; ``hold`` blocks the worker thread at
    the first token until ``release`` is set; ``leave_after`` sets ``cancelled`` (what the HTTP
    layer does when the client goes away) after that many tokens."""

    def __init__(self, worker, prompt: str, max_tokens: int, hold=False, leave_after=None):
        from dctms.runner.request import validate_request
        from dctms.serve.worker import Job

        served = worker.models["beta4"]
        request = validate_request(
            served.plan, served.tokenizer.encode(prompt), max_tokens, served.stop_ids
        )
        self.tokens: list[int] = []
        self.outcome = None
        self.done, self.holding, self.release = (threading.Event() for _ in range(3))
        self.hold, self.leave_after = hold, leave_after
        self.job = Job("beta4", request, self._on_token, self._on_done)

    def _on_token(self, token: int) -> bool:
        self.tokens.append(token)
        if self.hold:
            self.holding.set()
            assert self.release.wait(60)
            self.hold = False
        if self.leave_after is not None and len(self.tokens) >= self.leave_after:
            self.job.cancelled.set()
        return True

    def _on_done(self, gen, err) -> None:
        self.outcome = (gen, err)
        self.done.set()


def test_worker_a_full_queue_refuses_while_every_slot_is_held(worker):
    from dctms.serve.worker import QueueFull

    m = worker.models["beta4"].max_tokens
    holder = _Client(worker, "hold the worker", m, hold=True)
    worker.submit(holder.job)
    assert holder.holding.wait(60)  # the worker thread is inside a step, at its first token
    queued = _Client(worker, "queued", 2)
    worker.submit(queued.job)  # the queue's one place
    assert worker.waiting == 1 and worker.model_load()["beta4"]["queue_waiting"] == 1
    with pytest.raises(QueueFull):
        worker.submit(_Client(worker, "one too many", 2).job)
    holder.release.set()
    assert holder.done.wait(60) and queued.done.wait(60)
    assert holder.outcome[1] is None and queued.outcome[1] is None
    assert len(queued.outcome[0].tokens) >= 1


def test_worker_a_withdrawn_request_gives_its_slot_back_at_the_next_step(worker):
    from dctms.serve.worker import Cancelled

    m = worker.models["beta4"].max_tokens
    leaving = [_Client(worker, f"leave {k}", m, leave_after=2) for k in range(SLOTS)]
    for c in leaving:
        worker.submit(c.job)
        assert c.done.wait(60)  # one at a time: the queue holds one
    for c in leaving:
        gen, err = c.outcome
        assert gen is None and isinstance(err, Cancelled)
        # the flag is set at the second token (inside a step): the sequence ends in that step
        assert len(c.tokens) == 2
    figures = worker.model_load()["beta4"]
    assert figures["slots_busy"] == 0 and figures["queue_waiting"] == 0
    assert worker.running == 0
    later = _Client(worker, "later", m)
    worker.submit(later.job)
    assert later.done.wait(60) and later.outcome[1] is None
    assert later.tokens == later.outcome[0].tokens


def test_queue_full_is_503_through_the_app(worker):
    """The app's mapping, in-process (ASGI called directly): the worker is held, its queue full."""
    from dctms.serve.app import build_app

    holder = _Client(worker, "hold again", 2, hold=True)
    worker.submit(holder.job)
    assert holder.holding.wait(60)
    queued = _Client(worker, "queued again", 2)
    worker.submit(queued.job)
    app, _ = build_app(worker, {"provable": 1, "total": 1}, frozenset({"127.0.0.1"}), None)
    try:
        status, body = asyncio.run(_asgi_post(app, {"model": "beta4", "prompt": "x",
                                                    "max_tokens": 2}))  # fmt: skip
    finally:
        holder.release.set()
    assert status == 503, body
    assert "server busy" in json.loads(body)["error"]["message"]
    assert holder.done.wait(60) and queued.done.wait(60)


async def _asgi_post(app, payload: dict) -> tuple[int, bytes]:
    data = json.dumps(payload).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode())],
    }  # fmt: skip
    messages = [{"type": "http.request", "body": data, "more_body": False}]
    sent: list[dict] = []

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)  # no disconnect while the answer is under way

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body


def test_worker_a_failed_step_answers_that_models_requests_and_serves_the_next(worker):
    """A step that raises (e.g. EnvelopeExceeded) fails the running requests with that error,
    frees their slots, and the model serves the next request."""
    from dctms.runner.batch import EnvelopeExceeded

    session = worker._sessions["beta4"]
    real = session.iterate
    calls = []

    def failing_once():
        calls.append(1)
        if len(calls) == 2:  # after the first token
            raise EnvelopeExceeded("observed above provable (a test's)")
        return real()

    session.iterate = failing_once
    try:
        victim = _Client(worker, "doomed", worker.models["beta4"].max_tokens)
        worker.submit(victim.job)
        assert victim.done.wait(60)
    finally:
        session.iterate = real
    gen, err = victim.outcome
    assert gen is None and isinstance(err, EnvelopeExceeded)
    after = _Client(worker, "after the failure", 3)
    worker.submit(after.job)
    assert after.done.wait(60) and after.outcome[1] is None
    assert worker.model_load()["beta4"]["slots_busy"] == 0 and worker.running == 0


def test_ctrl_c_with_batched_streams_running_and_queued_still_stops(models):
    tiny, beta4 = models
    proc = ServerProcess(["--plan", f"beta4={beta4}={tiny['beta'].folder}", "--memory", "1GiB"])
    started = threading.Event()
    outcomes: list[str] = []

    def stream() -> None:
        body = {"model": "beta4", "prompt": "long", "max_tokens": tiny["beta"].m, "stream": True}
        req = urllib.request.Request(proc.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                for _ in r:
                    started.set()
            outcomes.append("finished")
        except Exception as err:  # noqa: BLE001 - cut off by the shutdown: an error, never a hang
            outcomes.append(type(err).__name__)

    threads = [threading.Thread(target=stream) for _ in range(2 * SLOTS)]
    try:
        for t in threads:
            t.start()
        assert started.wait(60)
        rc = proc.interrupt()
    finally:
        proc.close()
    for t in threads:
        t.join(60)
    assert rc == 0, proc.stderr()
    assert "Traceback" not in proc.stderr()
    assert len(outcomes) == 2 * SLOTS and not any(t.is_alive() for t in threads)


def test_worker_records_every_length_point_while_loading_when_asked(worker, models):
    """``prerecord=True`` (``--prerecord``): every verified point's graphs are recorded before the
    server serves, so no request pays for a point's first use; by default each on first use."""
    from dctms.runner.load import load_checked_plan
    from dctms.serve.spec import PlanSpec
    from dctms.serve.worker import Worker

    plan = worker.models["beta4"].plan
    # every phase's verified points; a phase of fixed lengths (the slot move) has one
    every = sum(len(p.lengths.points) if p.lengths is not None else 1 for p in plan.phases)
    assert every > len(plan.phases)
    # a worker thread of a process whose main thread ran MLX first cannot replay recordings
    # (runner.execute.replays_here): there it records none, and each call builds its graph
    replays = worker._sessions["beta4"].prefill.replay
    assert worker.recorded["beta4"].points == (every if replays else 0)
    tiny, beta4 = models
    lazy = Worker([(PlanSpec("lazy", beta4, tiny["beta"].folder), load_checked_plan(beta4))])
    lazy.start()
    try:
        assert lazy.recorded == {}
    finally:
        lazy.stop()


def test_serve_says_what_it_recorded_at_start(models, server):
    tiny, beta4 = models
    beta = tiny["beta"]
    proc = ServerProcess(["--plan", f"beta4={beta4}={beta.folder}", "--prerecord"])
    try:
        assert re.search(r"recorded [1-9]\d* length points' graphs in [\d.]+ s", proc.stderr())
    finally:
        proc.close()
    assert "recorded" not in server.stderr()  # without --prerecord: each point on first use
