"""Issue 34, item 1: each family's phases packed against their lower bound (tests/data/families).

The slow test compiles every config of the corpus and asserts arena / lower bound <= 1.01 per
phase, except the phases listed in ``ABOVE``: for those it asserts the structure the docs give as
the reason (docs/explanation/packer.md, "Real families"): one part, periodic lifetimes, and a window
of two periods that packs better on its own than the whole phase does. A phase of ``ABOVE`` that
reaches the goal fails the test too, so the list only shrinks.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from dctms.toolkit.pack.problem import make_problem
from dctms.toolkit.pack.structure import period, structure

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ROOT / "tests/data/families"
GOAL = 1.01
# Phases above GOAL at the default budget today (packer.md, "Real families", has their table).
ABOVE = {
    ("cohere", "prefill"),
    ("gemma2", "prefill"),
    ("gemma3_text", "prefill"),
    ("phi", "prefill"),
    ("phi3", "prefill"),
    ("phi3", "decode"),
    ("qwen3", "prefill"),
    ("stablelm", "prefill"),
}
# Configs the compiler does not accept today (the README says why).
REFUSED = {"internlm2"}


def _planner():
    spec = importlib.util.spec_from_file_location("planner", ROOT / "bench/planner.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_corpus_has_twelve_families_mlx_lm_supports():
    from mlx_lm.utils import _get_classes

    configs = sorted(FAMILIES.glob("*.json"))
    types = {json.loads(c.read_text())["model_type"] for c in configs}
    assert len(types) == len(configs) >= 12 + len(REFUSED)
    for c in configs:
        cfg = json.loads(c.read_text())
        assert c.stem == cfg["model_type"]
        _get_classes(cfg)  # raises for a model_type mlx-lm does not have
    readme = (FAMILIES / "README.md").read_text()
    assert all(f"`{c.name}`" in readme for c in configs)


def _periodic(layers: int, shift: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Per layer: two activations overlapping a third; one buffer lives throughout.
    start, end, size = [0], [layers * shift + 10], [64]
    for k in range(layers):
        t = k * shift
        start += [t, t + 3, t + 5]
        end += [t + 8, t + 12, t + 9]
        size += [1024, 512, 2048]
    return np.array(start), np.array(end), np.array(size)


def test_period_found_on_repeated_layers_and_not_elsewhere():
    s, e, z = _periodic(6, 10)
    shift, matched = period(make_problem(s, e, z, 64))
    assert shift == 10
    assert matched == 3 * 5  # every layer's three buffers but the last layer's
    rng = np.random.default_rng(0)
    s = rng.integers(0, 10_000, 50)
    random = make_problem(s, s + rng.integers(1, 100, 50), rng.integers(1, 1 << 20, 50) * 64, 64)
    assert period(random) == (None, 0)


def test_structure_reports_period_peaks_and_window():
    s, e, z = _periodic(8, 10)
    st = structure(make_problem(s, e, z, 64), 0.1)
    assert (st.parts, st.period, st.periodic) == (1, 10, 21)
    assert st.peak_periods >= 7  # every full layer reaches the bound
    assert st.window_ratio == 1.0  # three buffers a layer pack at the bound
    assert "period 10 slots" in st.describe()


@pytest.mark.slow
def test_every_family_phase_within_one_percent_or_its_structure_explained():
    planner = _planner()
    # real_lengths=False: the phases at the bound are the same graphs and the same packing problems
    # (the length grid's extra traces do not enter the arena); 4x faster than the default. Without
    # the bench's second packing of every phase (its greedy and time columns): the compiled arena
    # is what is asserted, and the packing work halves (25 of 78 s profiled, 2026-12-03).
    rows = planner.family_rows(FAMILIES, real_lengths=False, repack=False)
    assert {r["family"] for r in rows if r["phase"] is None} == REFUSED
    seen = set()
    for r in rows:
        if r["phase"] is None:
            continue
        key = (r["family"], r["phase"])
        seen.add(key)
        if key not in ABOVE:
            assert r["ratio"] <= GOAL, f"{key}: {r['ratio']:.4f}"
            continue
        assert r["ratio"] > GOAL, f"{key} now meets the goal ({r['ratio']:.4f}): drop it from ABOVE"
        st = structure(r["problem"], r["budget"])
        assert st.parts == 1, key
        assert st.periodic >= 0.6 * st.buffers, (key, st)
        assert st.peak_periods >= 1, (key, st)
        assert st.window_ratio < r["ratio"], (key, st)
    assert ABOVE <= seen
    assert len({f for f, _ in seen}) >= 12
