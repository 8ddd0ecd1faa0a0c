"""Concurrent streamed chat clients against an OpenAI-compatible server (any: `dctms serve`,
mlx_lm.server), and the figures a serving comparison reports: aggregate completion tokens per
second, time to first token and latency percentiles. Standard library only (urllib, threads), so
both servers see the same client; loopback addresses only."""

from __future__ import annotations

import json
import math
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server that must be told its port (mlx_lm.server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Ctrl-C a server process and wait for it; SIGTERM it if it does not end in ``timeout_s``, and
    kill it if that does not end it either. A process started as a shell's background job runs
    with SIGINT ignored, and so do the servers it starts (mlx_lm.server then never sees a Ctrl-C):
    there the first signal is SIGTERM."""
    if proc.poll() is not None:
        return
    first = signal.SIGTERM if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else signal.SIGINT
    for sig in dict.fromkeys((first, signal.SIGTERM)):
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.kill()
    proc.wait()


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    """Return once the server at ``url`` answers ``/v1/models``; ``RuntimeError`` when ``proc``
    exits first or ``timeout_s`` passes (loading a model takes seconds to minutes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before it listened")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.25)
    raise RuntimeError("server did not listen in time")


@dataclass(frozen=True)
class Answer:
    status: int
    ttft_s: float | None  # send to the first content chunk
    latency_s: float  # send to the last byte
    completion_tokens: int
    text: str
    error: str = ""
    cached_tokens: int | None = None  # prompt tokens the server reused, when it reports them
    prompt_tokens: int | None = None  # the prompt's tokens, as the server's usage counts them


def stream_chat(url: str, model: str, content: str, max_tokens: int, timeout_s: float) -> Answer:
    """One streamed, greedy chat completion of one user message (``stream_messages``)."""
    return stream_messages(url, model, [{"role": "user", "content": content}], max_tokens, timeout_s)


def stream_messages(
    url: str, model: str, messages: list[dict], max_tokens: int, timeout_s: float
) -> Answer:
    """One streamed, greedy chat completion; the completion tokens counted from the server's usage
    (``stream_options.include_usage``) or, where it sends none, from its content chunks; the prompt
    tokens the server says it took from its cache (``usage.prompt_tokens_details.cached_tokens``)
    where it says so."""
    body = {
        "model": model, "messages": messages,
        "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    req = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    start = time.perf_counter()
    ttft, chunks, usage, text = None, 0, None, []
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        ttft = ttft if ttft is not None else time.perf_counter() - start
                        chunks += 1
                        text.append(piece)
            status = r.status
    except Exception as err:  # noqa: BLE001 - a failed request is a measured outcome
        return Answer(getattr(err, "code", 0), None, time.perf_counter() - start, 0, "", repr(err))
    tokens = (usage or {}).get("completion_tokens", chunks)
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    prompt = (usage or {}).get("prompt_tokens")
    return Answer(
        status, ttft, time.perf_counter() - start, tokens, "".join(text), "", cached, prompt
    )


def run_level(
    url: str, model: str, prompts: Sequence[str], requests: int, clients: int,
    max_tokens: int, timeout_s: float = 600.0,
) -> tuple[list[Answer], float]:  # fmt: skip
    """``requests`` chats shared by ``clients`` threads (prompts taken in turn); the answers in
    request order and the wall time of the whole level."""
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(
            lambda i: stream_chat(url, model, prompts[i % len(prompts)], max_tokens, timeout_s),
            range(requests),
        ))  # fmt: skip
    return answers, time.perf_counter() - start


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank percentile (``q`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def level_figures(answers: Sequence[Answer], wall_s: float) -> dict:
    ok = [a for a in answers if a.status == 200 and not a.error]
    tokens = sum(a.completion_tokens for a in ok)
    ttfts = [a.ttft_s for a in ok if a.ttft_s is not None]
    lats = [a.latency_s for a in ok]
    said = [a.cached_tokens for a in ok if a.cached_tokens is not None]
    prompts = [a.prompt_tokens for a in ok if a.prompt_tokens is not None]
    return {
        "requests": len(answers), "answered": len(ok), "completion_tokens": tokens,
        "wall_s": wall_s, "tok_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
        "latency_p50_s": percentile(lats, 50), "latency_p95_s": percentile(lats, 95),
        "errors": sorted({a.error for a in answers if a.error})[:3],
        # prompt tokens the server says it reused from a cache (None: it never said)
        "cached_tokens": sum(said) if said else None,
        # the answered requests' prompt tokens (None: the server's usage never said)
        "prompt_tokens": sum(prompts) if len(prompts) == len(ok) and ok else None,
    }  # fmt: skip


def cached_of(level: dict) -> str:
    """A level's prompt tokens from a cache, "of" all its prompt tokens where the server counted
    them; "-" where the server never said what it took from a cache."""
    cached, total = level.get("cached_tokens"), level.get("prompt_tokens")
    if cached is None:
        return "-"
    return f"{cached:,}" if total is None else f"{cached:,} of {total:,}"


class PeakPoller:
    """Polls ``sample()`` every ``every_s`` on a thread and keeps every value (e.g. a server's RSS,
    or its /status)."""

    def __init__(self, sample: Callable[[], object], every_s: float = 0.05):
        self.values: list[object] = []
        self._sample, self._every = sample, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.values.append(self._sample())
            except Exception:  # noqa: BLE001, S112 - a sample missed while the server moves on
                pass
            self._stop.wait(self._every)

    def __enter__(self) -> PeakPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
