"""The two systems under test behind one interface, and one measured call.

- ``Baseline``: mlx-lm's stock generation — ``mlx_lm.generate.generate_step`` (greedy sampler, its
  own dynamically growing KV cache) over the model loaded by ``mlx_lm.utils.load_model``, under
  MLX's default memory and cache limits.
- ``Runner``: ``dctms.runner.session.Session.generate`` executing the plan, under the plan's limits.

Both live in one process, so both sets of weights are resident during every call. MLX's limits are
process-wide: each system's ``prepare`` sets its own before its call (the baseline gets the defaults
captured before the runner was created), so neither runs under the other's settings.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import mlx.core as mx

from dctms.runner.measure import RssSampler

BASELINE = "baseline"
RUNNER = "runner"
LABELS = {BASELINE: "mlx-lm baseline", RUNNER: "dctms runner"}


@dataclass
class Output:
    tokens: list[int]
    ttft_s: float
    token_latencies_s: list[float] = field(default_factory=list)


def record_token(out: Output, token: int, start: float, last: float) -> float:
    """Append ``token`` to ``out`` with its latency (the TTFT for the first); returns now."""
    now = time.perf_counter()
    if out.tokens:
        out.token_latencies_s.append(now - last)
    else:
        out.ttft_s = now - start
    out.tokens.append(int(token))
    return now


class System(Protocol):
    name: str

    def prepare(self) -> None: ...

    def generate(self, ids: list[int], max_tokens: int, stop: set[int]) -> Output: ...


@dataclass(frozen=True)
class MlxLimits:
    """MLX's process-wide memory settings, captured so they can be put back."""

    memory: int
    cache: int
    wired: int | None

    @classmethod
    def capture(cls) -> MlxLimits:
        cache = mx.set_cache_limit(0)
        mx.set_cache_limit(cache)
        wired = None
        if platform.system() == "Darwin":
            wired = mx.set_wired_limit(0)
            mx.set_wired_limit(wired)
        return cls(mx.get_memory_limit(), cache, wired)

    def apply(self) -> None:
        mx.set_memory_limit(self.memory)
        mx.set_cache_limit(self.cache)
        if self.wired is not None:
            mx.set_wired_limit(self.wired)


class Baseline:
    name = BASELINE

    def __init__(self, folder: Path, defaults: MlxLimits):
        from mlx_lm.utils import load_model

        self.defaults = defaults
        self.model, _ = load_model(Path(folder))

    def prepare(self) -> None:
        self.defaults.apply()

    def generate(self, ids: list[int], max_tokens: int, stop: set[int]) -> Output:
        from mlx_lm.generate import generate_step, generation_stream

        start = last = time.perf_counter()
        out = Output([], 0.0)
        steps = generate_step(mx.array(ids, dtype=mx.int32), self.model, max_tokens=max_tokens)
        try:
            for token, _logprobs in steps:
                last = record_token(out, token, start, last)
                if token in stop:
                    break
        finally:
            steps.close()
        # generate_step keeps one step in flight (async_eval); the call ends when the device is idle.
        mx.synchronize(generation_stream)
        return out


class Runner:
    name = RUNNER

    def __init__(self, session, requests=()):
        """``requests``: the calls' ``validate_request`` results, made before anything was loaded;
        a call not among them is validated when it is made."""
        self.session = session
        self._requests = {(r.prompt, r.max_tokens, r.stop): r for r in requests}

    def prepare(self) -> None:
        # The Session's own limits (the throttling memory limit, the buffer cache as the plan
        # assumes, wired on macOS/GPU), re-applied because the baseline's call put MLX's defaults
        # back; the memory limit also covers what the baseline holds in this process.
        foreign = max(0, mx.get_active_memory() - self.session.held_bytes())
        self.foreign_bytes = foreign  # recorded with the call: its MLX peak minus this is the runner's
        self.session.apply_limits(foreign)

    def generate(self, ids: list[int], max_tokens: int, stop: set[int]) -> Output:
        from dctms.runner.request import validate_request

        key = (tuple(ids), max_tokens, frozenset(stop))
        request = self._requests.get(key)
        if request is None:
            request = validate_request(self.session.plan, ids, max_tokens, stop)
        g = self.session.generate(request)
        return Output(g.tokens, g.ttft_s, list(g.token_latencies_s))


def measure_call(system: System, ids: list[int], max_tokens: int, stop: set[int]) -> dict:
    """One call with everything the protocol records (times in s, memory in bytes).

    ``latency_s`` is wall time (``time.perf_counter``) around ``generate`` only; the RSS sampler
    (every 10 ms) runs around it, and MLX's peak is reset just before."""
    system.prepare()
    mx.reset_peak_memory()
    active_before = mx.get_active_memory()
    with RssSampler() as rss:
        t0 = time.perf_counter()
        out = system.generate(ids, max_tokens, stop)
        latency = time.perf_counter() - t0
    mlx_peak = mx.get_peak_memory()
    n = len(out.tokens)
    return {
        "latency_s": latency,
        "ttft_s": out.ttft_s,
        "tokens_generated": n,
        "tokens_per_s": n / latency if latency > 0 else None,
        "rss_peak_bytes": rss.peak,
        "rss_start_bytes": rss.series[0][1] if rss.series else None,
        "mlx_peak_bytes": mlx_peak,
        "mlx_active_before_bytes": active_before,
        "mlx_foreign_bytes": getattr(system, "foreign_bytes", 0),
        "token_latencies_s": [round(x, 7) for x in out.token_latencies_s],
        "tokens": out.tokens,
        "rss_series": [[round(t, 4), b] for t, b in rss.series],
    }
