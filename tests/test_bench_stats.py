"""dctms bench statistics against hand-computed values; the bootstrap is seeded and deterministic."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from dctms.benchmark import stats
from dctms.benchmark.stats import Sample

XS = [2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]


def test_mean_std_cv_by_hand():
    # mean 40 / 8 = 5; squared deviations 9+1+1+1+0+0+4+16 = 32; sample variance 32 / 7.
    assert stats.mean(XS) == 5.0
    assert stats.sample_std(XS) == pytest.approx(math.sqrt(32 / 7))
    assert stats.sample_std(XS) == pytest.approx(2.1380899353)
    assert stats.cv(XS) == pytest.approx(2.1380899353 / 5)


def test_undefined_values_are_none():
    assert stats.mean([]) is None
    assert stats.sample_std([3.0]) is None  # n - 1 = 0
    assert stats.cv([3.0]) is None
    assert stats.cv([0.0, 0.0]) is None  # mean 0
    assert stats.percentile([], 50) is None
    assert stats.percentile([3.0], 99) == 3.0


def test_percentile_type7_by_hand():
    # Sorted XS, n = 8: position h = (n - 1) q / 100 = 7 q / 100.
    assert stats.percentile(XS, 50) == pytest.approx(4.5)  # h = 3.5: 4 + 0.5 (5 - 4)
    assert stats.percentile(XS, 99) == pytest.approx(8.86)  # h = 6.93: 7 + 0.93 (9 - 7)
    assert stats.percentile(XS, 25) == pytest.approx(4.0)  # h = 1.75 between 4 and 4
    assert stats.percentile(XS, 0) == 2.0
    assert stats.percentile(XS, 100) == 9.0
    assert stats.percentile([10.0, 20.0], 99) == pytest.approx(19.9)  # h = 0.99
    with pytest.raises(ValueError):
        stats.percentile(XS, 101)


def test_percentile_matches_numpy_linear():
    rng = random.Random(7)
    for n in (1, 2, 3, 5, 50, 251):
        xs = [rng.lognormvariate(0, 1) for _ in range(n)]
        for q in (0, 1, 25, 50, 90, 99, 100):
            want = float(np.percentile(xs, q, method="linear"))
            assert stats.percentile(xs, q) == pytest.approx(want, rel=1e-12)


def _sample(lat_s, ttft_s=None, tokens=None, rss=None, mlx=None) -> Sample:
    n = len(lat_s)
    return Sample(
        list(lat_s),
        list(ttft_s or [0.0] * n),
        list(tokens or [1] * n),
        list(rss or [100] * n),
        list(mlx or [10] * n),
    )


def test_describe_by_hand():
    s = _sample([0.1, 0.2, 0.3], [0.05, 0.05, 0.05], [10, 10, 20], [5, 9, 7], [1, 3, 2])
    d = stats.describe(s)
    assert d["n"] == 3
    assert d["mean_ms"] == pytest.approx(200.0)
    assert d["std_ms"] == pytest.approx(100.0)
    assert d["cv"] == pytest.approx(0.5)
    assert d["p50_ms"] == pytest.approx(200.0)
    assert d["p99_ms"] == pytest.approx(298.0)  # h = 1.98: 200 + 0.98 * 100
    assert d["ttft_mean_ms"] == pytest.approx(50.0)
    assert d["tokens_per_s"] == pytest.approx(40 / 0.6)
    # tokens after the first / (latency - TTFT): (9 + 9 + 19) / (0.05 + 0.15 + 0.25)
    assert d["after_ttft_tokens_per_s"] == pytest.approx(37 / 0.45)
    assert d["decode_tokens_per_s"] is None  # no intervals between tokens recorded
    assert d["rss_peak_bytes"] == 9
    assert d["mlx_peak_bytes"] == 3


def test_vectorised_statistics_equal_describe():
    rng = random.Random(3)
    s = _sample(
        [rng.uniform(0.5, 2.0) for _ in range(17)],
        tokens=[rng.randint(1, 32) for _ in range(17)],
        rss=[rng.randint(10**6, 10**7) for _ in range(17)],
        mlx=[rng.randint(10**5, 10**6) for _ in range(17)],
    )
    d = stats.describe(s)
    arrays = stats._arrays(s, np.arange(len(s))[None, :])
    for name in stats.RATIO_METRICS:
        assert float(stats._VECTOR[name](arrays)[0]) == pytest.approx(d[name], rel=1e-12), name


def _two_systems(seed: int = 11):
    rng = random.Random(seed)
    base = [_sample([rng.gauss(1.0 + p, 0.05) for _ in range(40)]) for p in range(3)]
    run = [_sample([rng.gauss(1.1 * (1.0 + p), 0.03) for _ in range(40)]) for p in range(3)]
    return run, base


def test_bootstrap_is_deterministic_and_contains_point():
    run, base = _two_systems()
    a = stats.bootstrap_ratios(run, base, scope="all", resamples=2000, seed=0)
    b = stats.bootstrap_ratios(run, base, scope="all", resamples=2000, seed=0)
    assert a == b
    for name, r in a.items():
        assert r["low"] is not None and r["high"] is not None, name
        assert r["low"] <= r["ratio"] <= r["high"], name
    # The point ratio is the ratio of the pooled descriptions.
    pr, pb = stats.describe(stats.pool(run)), stats.describe(stats.pool(base))
    assert a["mean_ms"]["ratio"] == pytest.approx(pr["mean_ms"] / pb["mean_ms"])
    assert a["cv"]["ratio"] == pytest.approx(pr["cv"] / pb["cv"])
    # A 10 % slower runner: the mean ratio is near 1.1 with a narrow interval.
    m = a["mean_ms"]
    assert abs(m["ratio"] - 1.1) < 0.01 and m["high"] - m["low"] < 0.02
    # Another seed draws other resamples (so the seed is really used).
    c = stats.bootstrap_ratios(run, base, scope="all", resamples=2000, seed=1)
    assert c["mean_ms"]["ratio"] == a["mean_ms"]["ratio"]
    assert (c["mean_ms"]["low"], c["mean_ms"]["high"]) != (
        a["mean_ms"]["low"],
        a["mean_ms"]["high"],
    )


def test_bootstrap_seed_depends_on_scope_not_call_order():
    run, base = _two_systems()
    first = stats.bootstrap_ratios(run[:1], base[:1], scope="P1", resamples=500)
    stats.bootstrap_ratios(run, base, scope="all", resamples=500)
    again = stats.bootstrap_ratios(run[:1], base[:1], scope="P1", resamples=500)
    assert first == again


def test_bootstrap_single_call_strata():
    run = [_sample([2.0]), _sample([4.0])]
    base = [_sample([1.0]), _sample([2.0])]
    r = stats.bootstrap_ratios(run, base, resamples=100)
    # One call per stratum: resampling would only repeat it, so there is no interval.
    assert r["mean_ms"] == {"ratio": 2.0, "low": None, "high": None}
    # The pooled calls have a standard deviation; a single stratum's one call has none.
    assert r["std_ms"]["ratio"] == pytest.approx(
        stats.sample_std([2000, 4000]) / stats.sample_std([1000, 2000])
    )
    single = stats.bootstrap_ratios(run[:1], base[:1], resamples=100)
    assert single["std_ms"] == {"ratio": None, "low": None, "high": None}
    assert single["cv"]["ratio"] is None


def test_bootstrap_empty_side():
    r = stats.bootstrap_ratios([_sample([1.0, 2.0])], [_sample([])], resamples=50)
    assert all(v == {"ratio": None, "low": None, "high": None} for v in r.values())


def test_decode_rate_is_the_median_interval_between_tokens():
    """Where a pipeline puts its first decode step (in the TTFT or after it) changes the time
    after TTFT, not the steady interval between tokens: two calls with the same steps, one with a
    step moved from after its first token into its TTFT, have equal decode tok/s."""
    calls = [
        {"latency_s": 0.5, "ttft_s": 0.1, "tokens_generated": 5, "rss_peak_bytes": 1,
         "mlx_peak_bytes": 1, "token_latencies_s": [0.2, 0.05, 0.05, 0.1]},
        {"latency_s": 0.5, "ttft_s": 0.2, "tokens_generated": 5, "rss_peak_bytes": 1,
         "mlx_peak_bytes": 1, "token_latencies_s": [0.1, 0.05, 0.05, 0.1]},
    ]  # fmt: skip
    late, early = (stats.describe(Sample.of([c])) for c in calls)
    assert late["decode_tokens_per_s"] == early["decode_tokens_per_s"] == pytest.approx(1 / 0.075)
    assert late["after_ttft_tokens_per_s"] == pytest.approx(4 / 0.4)
    assert early["after_ttft_tokens_per_s"] == pytest.approx(4 / 0.3)
    pooled = stats.describe(stats.pool([Sample.of(calls[:1]), Sample.of(calls[1:])]))
    assert pooled["decode_tokens_per_s"] == pytest.approx(1 / 0.075)  # median of 8 intervals
