"""Statistics of a benchmark: per-group figures and runner ÷ baseline ratios with bootstrap intervals.

Definitions (stated in every summary):
- ``mean``: arithmetic mean; ``sample_std``: standard deviation with Bessel's correction (n - 1),
  undefined (``None``) for fewer than two values; ``cv`` = sample_std / mean (CV_L).
- ``percentile``: linear interpolation between closest ranks, Hyndman & Fan type 7 (NumPy's default
  ``method="linear"``): position h = (n - 1) q / 100, value x[floor h] + (h - floor h)(x[floor h + 1]
  - x[floor h]) on the sorted values.
- tok/s: generated tokens ÷ wall latency summed over the group's calls (end to end, prefill included);
  decode tok/s: 1 ÷ the median interval between consecutive tokens after the first (the group's
  calls pooled): the cost of one decode step in the steady state; tok/s after TTFT: tokens after
  the first ÷ (latency − TTFT), summed. The two differ by where a system's pipeline puts its
  first decode step: mlx-lm's ``generate_step`` launches it before it yields the first token (in
  its TTFT), the runner after (in its time after TTFT), and at a stop token both have one more
  step in flight that the call waits for.
- Bootstrap: percentile interval of ``resamples`` ratios statistic(runner*) / statistic(baseline*),
  each system's calls resampled with replacement independently, within each prompt (stratified), from
  a ``numpy.random.default_rng`` seeded by (seed, scope) — the same input always gives the same interval.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

DEFAULT_RESAMPLES = 2000
DEFAULT_SEED = 0
DEFAULT_CONFIDENCE = 0.95


def mean(xs: Sequence[float]) -> float | None:
    return math.fsum(xs) / len(xs) if xs else None


def sample_std(xs: Sequence[float]) -> float | None:
    """Standard deviation with n - 1 in the denominator; ``None`` for n < 2."""
    n = len(xs)
    if n < 2:
        return None
    m = math.fsum(xs) / n
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (n - 1))


def cv(xs: Sequence[float]) -> float | None:
    m, s = mean(xs), sample_std(xs)
    if m is None or s is None or m == 0:
        return None
    return s / m


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (type 7, NumPy's default); q in [0, 100]."""
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    s = sorted(xs)
    h = (len(s) - 1) * q / 100
    lo = math.floor(h)
    if lo + 1 >= len(s):
        return float(s[-1])
    return s[lo] + (h - lo) * (s[lo + 1] - s[lo])


@dataclass(frozen=True)
class Sample:
    """The per-call figures one group's statistics are computed from (parallel lists)."""

    latency_s: list[float]
    ttft_s: list[float]
    tokens: list[int]
    rss_peak: list[int]
    mlx_peak: list[int]
    intervals_s: list[float] = field(default_factory=list)  # between tokens after the first, pooled

    @classmethod
    def of(cls, calls: Sequence[dict]) -> Sample:
        return cls(
            [c["latency_s"] for c in calls],
            [c["ttft_s"] for c in calls],
            [c["tokens_generated"] for c in calls],
            [c["rss_peak_bytes"] for c in calls],
            [c["mlx_peak_bytes"] for c in calls],
            [x for c in calls for x in c.get("token_latencies_s", [])],
        )

    def __len__(self) -> int:
        return len(self.latency_s)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def describe(s: Sample) -> dict:
    """One group's figures; latencies in ms, memory in bytes, ``None`` where undefined."""
    ms = [x * 1000 for x in s.latency_s]
    total = math.fsum(s.latency_s)
    decode_time = math.fsum(lat - ttft for lat, ttft in zip(s.latency_s, s.ttft_s, strict=True))
    decode_tokens = sum(max(t - 1, 0) for t in s.tokens)
    step = percentile(s.intervals_s, 50)
    return {
        "n": len(s),
        "mean_ms": mean(ms),
        "std_ms": sample_std(ms),
        "cv": cv(ms),
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "min_ms": min(ms, default=None),
        "max_ms": max(ms, default=None),
        "ttft_mean_ms": mean([x * 1000 for x in s.ttft_s]),
        "tokens_mean": mean(s.tokens),
        "tokens_per_s": sum(s.tokens) / total if total > 0 else None,
        "decode_tokens_per_s": 1 / step if step else None,
        "after_ttft_tokens_per_s": decode_tokens / decode_time if decode_time > 0 else None,
        "rss_peak_bytes": max(s.rss_peak, default=None),
        "mlx_peak_bytes": max(s.mlx_peak, default=None),
    }


# Ratio metrics: name -> (key in describe(), vectorised statistic over resampled rows).
# Each vectorised statistic takes arrays of shape (B, n) and returns shape (B,).
def _std(lat: np.ndarray) -> np.ndarray:
    if lat.shape[1] < 2:
        return np.full(lat.shape[0], np.nan)
    return lat.std(axis=1, ddof=1)


_VECTOR: dict[str, Callable[[dict[str, np.ndarray]], np.ndarray]] = {
    "mean_ms": lambda a: a["lat"].mean(axis=1),
    "std_ms": lambda a: _std(a["lat"]),
    "cv": lambda a: _std(a["lat"]) / a["lat"].mean(axis=1),
    "p50_ms": lambda a: np.percentile(a["lat"], 50, axis=1, method="linear"),
    "p99_ms": lambda a: np.percentile(a["lat"], 99, axis=1, method="linear"),
    "tokens_per_s": lambda a: a["tok"].sum(axis=1) / (a["lat"].sum(axis=1) / 1000),
    "rss_peak_bytes": lambda a: a["rss"].max(axis=1),
    "mlx_peak_bytes": lambda a: a["mlx"].max(axis=1),
}
RATIO_METRICS = tuple(_VECTOR)


def _arrays(s: Sample, idx: np.ndarray) -> dict[str, np.ndarray]:
    return {
        "lat": np.asarray(s.latency_s, dtype=np.float64)[idx] * 1000,
        "tok": np.asarray(s.tokens, dtype=np.float64)[idx],
        "rss": np.asarray(s.rss_peak, dtype=np.float64)[idx],
        "mlx": np.asarray(s.mlx_peak, dtype=np.float64)[idx],
    }


def _resample(strata: Sequence[Sample], rng: np.random.Generator, b: int) -> dict[str, np.ndarray]:
    """Row r holds one stratified resample: each stratum's calls drawn with replacement."""
    parts = [_arrays(s, rng.integers(0, len(s), size=(b, len(s)))) for s in strata if len(s)]
    return {k: np.concatenate([p[k] for p in parts], axis=1) for k in parts[0]}


def scope_seed(seed: int, scope: str) -> list[int]:
    """Seed material for one scope: independent of the order scopes are computed in."""
    return [seed, zlib.crc32(scope.encode("utf-8"))]


def bootstrap_ratios(
    runner: Sequence[Sample],
    baseline: Sequence[Sample],
    scope: str = "all",
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    confidence: float = DEFAULT_CONFIDENCE,
) -> dict[str, dict]:
    """Runner ÷ baseline for every ratio metric: point value and percentile bootstrap interval.

    ``runner`` and ``baseline`` are lists of strata (one ``Sample`` per prompt). The point ratio
    uses ``describe`` on the pooled calls. The interval is ``None`` when a stratum holds a single
    call (resampling one value only repeats it), and where a statistic is undefined (e.g. a
    baseline standard deviation of zero) in more than half of the resamples.
    """
    if resamples < 1:
        raise ValueError("resamples must be at least 1")
    pooled_r = describe(pool(runner))
    pooled_b = describe(pool(baseline))
    out: dict[str, dict] = {}
    # An interval needs variation to resample: every stratum present needs two calls or more.
    have = any(len(s) for s in runner) and any(len(s) for s in baseline)
    have = have and all(len(s) >= 2 for s in (*runner, *baseline) if len(s))
    if have:
        rng = np.random.default_rng(scope_seed(seed, scope))
        rr = _resample(runner, rng, resamples)
        bb = _resample(baseline, rng, resamples)
    alpha = (1 - confidence) / 2 * 100
    for name in RATIO_METRICS:
        point = _ratio(pooled_r[name], pooled_b[name])
        lo = hi = None
        if have:
            with np.errstate(divide="ignore", invalid="ignore"):
                ratios = _VECTOR[name](rr) / _VECTOR[name](bb)
            finite = ratios[np.isfinite(ratios)]
            if finite.size * 2 > resamples:
                lo, hi = (float(v) for v in np.percentile(finite, [alpha, 100 - alpha]))
        out[name] = {"ratio": point, "low": lo, "high": hi}
    return out


def pool(strata: Sequence[Sample]) -> Sample:
    """All strata's calls as one sample."""
    return Sample(
        [x for s in strata for x in s.latency_s],
        [x for s in strata for x in s.ttft_s],
        [x for s in strata for x in s.tokens],
        [x for s in strata for x in s.rss_peak],
        [x for s in strata for x in s.mlx_peak],
        [x for s in strata for x in s.intervals_s],
    )
