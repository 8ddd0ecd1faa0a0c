"""Measurement: MLX's own peak memory, and process RSS sampled every 10 ms on a thread."""

from __future__ import annotations

import threading
import time

import psutil


class RssSampler:
    """Samples this process's resident set size every ``interval_s`` until stopped.

    ``series`` holds ``(seconds since start, rss bytes)``; ``peak`` the largest sample.
    """

    def __init__(self, interval_s: float = 0.010):
        self.interval_s = interval_s
        self.series: list[tuple[float, int]] = []
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._t0 = 0.0

    @property
    def peak(self) -> int:
        return max((rss for _, rss in self.series), default=0)

    def __enter__(self) -> RssSampler:
        self._t0 = time.perf_counter()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        self.series.append((time.perf_counter() - self._t0, self._proc.memory_info().rss))

    def _loop(self) -> None:
        # Sleep to absolute deadlines so the interval does not drift with sampling cost.
        deadline = time.perf_counter()
        while not self._stop.is_set():
            deadline += self.interval_s
            self._stop.wait(max(0.0, deadline - time.perf_counter()))
            if not self._stop.is_set():
                self._sample()
