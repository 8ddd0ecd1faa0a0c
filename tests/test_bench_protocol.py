"""dctms bench protocol: call order, calls.json after every call, Ctrl-C partial results, the
10 ms RSS sampler, prompt files and the N check (no model needed: systems are stand-ins)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest

from dctms.benchmark.execute import execute
from dctms.benchmark.prompts import (
    Prompt,
    PromptIds,
    byte_token_ids,
    check_bounds,
    default_prompts_file,
    load_prompts,
)
from dctms.benchmark.protocol import CallsFile, Settings, schedule
from dctms.benchmark.systems import BASELINE, RUNNER, Output, measure_call
from dctms.runner.measure import RssSampler
from dctms.schema.errors import DctmsError

REPO = Path(__file__).resolve().parent.parent


class FakeSystem:
    """Generates ``max_tokens`` tokens, sleeping a little per token."""

    def __init__(self, name: str, per_token_s: float = 0.001):
        self.name = name
        self.per_token_s = per_token_s
        self.prepared = 0

    def prepare(self) -> None:
        self.prepared += 1

    def generate(self, ids: list[int], max_tokens: int, stop: set[int]) -> Output:
        out = Output([], 0.0)
        t0 = last = time.perf_counter()
        for i in range(max_tokens):
            time.sleep(self.per_token_s)
            now = time.perf_counter()
            if i == 0:
                out.ttft_s = now - t0
            else:
                out.token_latencies_s.append(now - last)
            last = now
            out.tokens.append((sum(ids) + i) % 50)
        return out


def _prompts(n: int = 3) -> list[PromptIds]:
    return [
        PromptIds(Prompt(f"P{i + 1}", f"category {i + 1}", "x" * (i + 1)), list(range(i + 2)))
        for i in range(n)
    ]


def test_schedule_alternates_systems_call_by_call():
    order = schedule(n_prompts=5, reps=3)
    assert len(order) == 30
    assert [s for _, _, s in order] == [0, 1] * 15
    # Each (rep, prompt) pair is run by both systems back to back, prompts in order within a rep.
    assert order[:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert order[10] == (1, 0, 0)


def test_calls_file_is_valid_json_at_every_step(tmp_path: Path):
    f = CallsFile(tmp_path / "calls.json", {"format": "x", "prompts": []})
    f.write("running")
    assert json.loads(f.path.read_text())["calls"] == []
    for i in range(3):
        f.add({"index": i, "latency_s": 0.5 + i, "tokens": [1, 2]})
        f.write("running")
        doc = json.loads(f.path.read_text())
        assert [c["index"] for c in doc["calls"]] == list(range(i + 1))
        assert doc["completed_calls"] == i + 1
    f.add({"warmup": 0}, warmup=True)
    f.write("complete")
    doc = json.loads(f.path.read_text())
    assert doc["status"] == "complete" and doc["warmup"] == [{"warmup": 0}]
    assert not list(tmp_path.glob(".calls.json.*"))  # no temporary files left


def test_complete_run_with_stand_in_systems(tmp_path: Path):
    systems = [FakeSystem(BASELINE), FakeSystem(RUNNER, 0.002)]
    outcome, summary, note = execute(
        systems,
        _prompts(),
        Settings(reps=2, max_tokens=3, warmup=1),
        tmp_path,
        {"reps": 2},
        resamples=200,
        figures=False,
    )
    assert not outcome.interrupted and len(outcome.calls) == outcome.planned == 12
    assert len(outcome.warmup) == 2 and systems[0].prepared == systems[1].prepared == 7
    doc = json.loads((tmp_path / "calls.json").read_text())
    assert doc["status"] == "complete" and len(doc["calls"]) == 12
    assert [c["system"] for c in doc["calls"]] == [BASELINE, RUNNER] * 6
    assert summary["systems"][RUNNER]["n"] == 6
    assert summary["greedy_agreement"]["P1"]["identical"] is True
    md = (tmp_path / "summary.md").read_text()
    assert "Partial result" not in md and "--no-plot" in md


@pytest.mark.parametrize("after", [0, 1, 4])
def test_ctrl_c_leaves_a_valid_partial_result(tmp_path: Path, after: int):
    """KeyboardInterrupt during call ``after + 1``: calls.json holds exactly ``after`` calls,
    summary.md/summary.json describe them, and every intermediate calls.json was valid."""
    seen = []

    def measure(system, ids, max_tokens, stop):
        doc = json.loads((tmp_path / "calls.json").read_text())  # valid before every call
        seen.append(len(doc["calls"]))
        if len(seen) == after + 1:
            raise KeyboardInterrupt
        return measure_call(system, ids, max_tokens, stop)

    outcome, summary, _ = execute(
        [FakeSystem(BASELINE), FakeSystem(RUNNER)],
        _prompts(),
        Settings(reps=3, max_tokens=2, warmup=0),
        tmp_path,
        {"reps": 3},
        resamples=100,
        measure=measure,
    )
    assert outcome.interrupted
    assert seen == list(range(after + 1))
    doc = json.loads((tmp_path / "calls.json").read_text())
    assert doc["status"] == "interrupted"
    assert len(doc["calls"]) == doc["completed_calls"] == after
    assert doc["planned_calls"] == 18
    for c in doc["calls"]:
        assert c["latency_s"] > 0 and c["tokens_generated"] == 2 and c["rss_peak_bytes"] > 0
    md = (tmp_path / "summary.md").read_text()
    assert f"{after} of 18 calls completed" in md
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["completed_calls"] == after and s["status"] == "interrupted"
    # Statistics cover the paired calls: a baseline call whose runner call was cut is left out.
    n = s["systems"][BASELINE]["n"] + s["systems"][RUNNER]["n"]
    assert n == s["paired_calls"] == after - after % 2
    assert ("left out of the statistics" in md) == bool(after % 2)


def test_measure_call_records_everything():
    call = measure_call(FakeSystem(RUNNER, 0.02), [1, 2, 3], 5, set())
    assert call["tokens_generated"] == 5 == len(call["tokens"])
    assert len(call["token_latencies_s"]) == 4
    assert 0.1 <= call["latency_s"] < 2.0
    assert 0 < call["ttft_s"] < call["latency_s"]
    assert call["rss_peak_bytes"] >= call["rss_start_bytes"] > 0
    assert call["rss_peak_bytes"] == max(b for _, b in call["rss_series"])
    assert call["mlx_peak_bytes"] >= 0 and call["mlx_active_before_bytes"] >= 0
    # ~0.1 s of sampling at 10 ms: several samples, not one per call.
    assert len(call["rss_series"]) >= 5


def test_rss_sampler_spacing_is_about_10_ms():
    """The median spacing of the thread's samples over ~0.5 s (robust to a late wake-up on a
    loaded machine), not a timed assert on the whole run."""
    with RssSampler() as rss:
        time.sleep(0.5)
    # The first and last samples are taken on entry and exit, outside the 10 ms loop.
    times = [t for t, _ in rss.series[1:-1]]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert len(gaps) >= 20
    assert 0.007 <= statistics.median(gaps) <= 0.013
    assert all(b > 0 for _, b in rss.series)


def test_shipped_prompts_cover_the_five_categories():
    path = default_prompts_file()
    assert path == REPO / "plans" / "prompts" / "p1-p5.json"
    prompts = load_prompts(path)
    assert [p.id for p in prompts] == ["P1", "P2", "P3", "P4", "P5"]
    assert [p.category for p in prompts] == [
        "short factual",
        "multi-step reasoning",
        "summarisation",
        "structured output",
        "longer-context comprehension",
    ]
    sizes = {p.id: len(p.text.encode("utf-8")) for p in prompts}
    # P5 is the long one, and fits the checked-in plans' N = 2048 even at one token per byte.
    assert sizes["P5"] == max(sizes.values()) and 1500 <= sizes["P5"] <= 2048
    check_bounds([PromptIds(p, byte_token_ids(p.text, 257)) for p in prompts], 2048)


def test_prompt_longer_than_n_is_refused_naming_both_numbers():
    prompts = [
        PromptIds(Prompt("P1", "short", "ab"), [1, 2]),
        PromptIds(Prompt("P5", "long", "x"), [7] * 300),
    ]
    check_bounds(prompts, 300)
    with pytest.raises(DctmsError) as err:
        check_bounds(prompts, 128)
    msg = str(err.value)
    assert "P5" in msg and "300 tokens" in msg and "N = 128" in msg and "P1" not in msg


def test_byte_token_ids():
    assert byte_token_ids("Aé", 257) == [65, 0xC3, 0xA9]
    assert byte_token_ids("Aé", 100) == [65, 0xC3 % 100, 0xA9 % 100]
    with pytest.raises(DctmsError):
        byte_token_ids("x", 0)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{", "unreadable prompts file"),
        ('{"prompts": []}', "non-empty list"),
        ('{"prompts": [{"id": "P1", "category": "c"}]}', r"prompts\[0\]\.text"),
        (
            '[{"id": "P1", "category": "c", "text": "a"}, {"id": "P1", "category": "d", "text": "b"}]',
            "duplicate prompt ids P1",
        ),
    ],
)
def test_bad_prompt_files(tmp_path: Path, content: str, message: str):
    path = tmp_path / "prompts.json"
    path.write_text(content)
    with pytest.raises(DctmsError, match=message):
        load_prompts(path)
    with pytest.raises(DctmsError, match="not found"):
        load_prompts(tmp_path / "missing.json")


@pytest.mark.parametrize(
    ("order", "firsts"),
    [
        ("alternate", ["runner", "baseline", "runner"]),
        ("runner-first", ["runner"]),
        ("baseline-first", ["baseline"]),
    ],
)
def test_load_order_is_balanced_over_the_repetitions(tmp_path: Path, order, firsts):
    """``alternate``: both systems re-loaded between repetitions, the other one first each time,
    then warmed up again; every call of a repetition runs on that repetition's copies."""
    from dctms.benchmark.loading import Loaded

    made: list[str] = []

    def maker(name: str, kind: str):
        def make():
            made.append(kind)
            return FakeSystem(name)

        return make

    loaded = Loaded(maker(BASELINE, "baseline"), maker(RUNNER, "runner"), order)
    loaded.before_rep(0)
    first_pair = list(loaded.systems)
    outcome, _, _ = execute(
        loaded.systems,
        _prompts(2),
        Settings(reps=3, max_tokens=2, warmup=1),
        tmp_path,
        {},
        resamples=100,
        figures=False,
        before_rep=loaded.before_rep,
    )
    assert made[::2] == firsts and len(made) == 2 * len(firsts) == 2 * loaded.loads
    assert [s.name for s in loaded.systems] == [BASELINE, RUNNER]  # the protocol's order stays
    assert len(outcome.calls) == 12
    assert [w["before_rep"] for w in outcome.warmup] == [
        r for r in (0, 1, 2)[: len(firsts)] for _ in (0, 1)
    ]
    if order == "alternate":
        # the last repetition's calls ran on systems made after the first repetition's
        assert all(s not in first_pair for s in loaded.systems)
        assert first_pair[0].prepared == 1 + 2  # its warm-up and rep 1's two prompts only
