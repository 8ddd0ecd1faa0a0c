"""``dctms fit``: the search (pure, counted) and the command on a tiny qwen2 config (real compiles)."""

from __future__ import annotations

import argparse
import functools
import json
import math
from pathlib import Path

import pytest

from dctms.cli import main as cli
from dctms.schema.io import read_plan
from dctms.schema.model_folder import open_model
from dctms.toolkit.compiler import CompileOptions, compile_plan
from dctms.toolkit.tiny_model import DEMO_CONFIG
from dctms.views.fit import largest_fitting, max_positions

M = 16


def write_config(folder: Path, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**DEMO_CONFIG, **changes}))
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("fit") / "tiny")


# Each (folder, N, M[, chunk]) is compiled once per session: a certificate often repeats the
# compile its test's budget came from (the folders are never changed).
@functools.cache
def m_max(folder: Path, n: int, m: int) -> int:
    return compile_plan(open_model(folder), CompileOptions(n, m)).envelope.total


# ------------------------------------------------------------------------------ the search alone


def counted(f):
    calls = []

    def measure(v: int) -> int:
        calls.append(v)
        return f(v)

    return measure, calls


@pytest.mark.parametrize("budget", [1_000, 1_010, 5_000, 123_456, 10**7])
def test_search_finds_the_boundary_with_logarithmic_calls(budget):
    measure, calls = counted(lambda v: 1_000 + 10 * v)
    result = largest_fitting(measure, budget, cap=2**20)
    expected = (budget - 1_000) // 10
    if expected < 1:
        assert result.best is None and calls == [1]
        return
    assert result.best == expected
    assert len(calls) == len(set(calls))  # never the same value twice
    assert len(calls) <= 2 * math.ceil(math.log2(expected + 1)) + 2
    assert result.probe(expected).fits and not result.probe(expected + 1).fits


def test_search_stops_at_the_cap():
    measure, calls = counted(lambda v: v)
    result = largest_fitting(measure, 10**9, cap=100)
    assert result.best == 100 and result.capped
    assert calls == [1, 2, 100]  # the line through 1 and 2 reaches the budget past the cap
    assert largest_fitting(lambda v: v, 10**9, cap=1).best == 1
    assert largest_fitting(lambda v: v, 10**9, cap=0).best is None


def test_search_with_flat_steps():
    # M_max that stays flat over ranges (e.g. padded chunks): still the largest value that fits.
    result = largest_fitting(lambda v: 100 * (v // 7), 100 * 5, cap=2**20)
    assert result.best == 41  # 41 // 7 = 5, 42 // 7 = 6


def test_linear_m_max_takes_a_handful_of_calls():
    # M_max is close to linear in N: the interpolation finds the crossing in a few compiles,
    # where doubling + bisection would take ~2 log2(answer) = 34 here.
    measure, calls = counted(lambda v: 4_000_000 + 131_072 * v + (v // 64) * 999)
    budget = 16 * 2**30
    result = largest_fitting(measure, budget, cap=2**20)
    expected = max(
        v for v in range(1, 2**20) if 4_000_000 + 131_072 * v + (v // 64) * 999 <= budget
    )
    assert result.best == expected
    assert len(calls) <= 8, calls


@pytest.mark.parametrize("hint", [2, 500, 1_000, 1_234, 1_300, 5_000, 2**20])
def test_hint_near_the_answer_saves_calls(hint):
    f = lambda v: 10 * v  # noqa: E731
    measure, calls = counted(f)
    result = largest_fitting(measure, 12_345, cap=2**20, hint=hint)
    assert result.best == 1_234
    assert result.probe(1_234).fits and not result.probe(1_235).fits
    assert len(calls) == len(set(calls)) and len(calls) <= 8, calls


def test_search_is_exact_on_monotone_functions_of_any_shape():
    # Convex, concave, staircase and flat-then-jump M_max: always the true boundary, within
    # ~4 log2(cap) calls, never a value twice.
    import random

    rng = random.Random(7)
    cap = 5_000
    for trial in range(60):
        steps = sorted(rng.choices(range(0, 50_000), k=rng.randint(1, 30)))
        shape = trial % 4
        curve = [
            (v * v // 50, int(3_000 * math.sqrt(v)), sum(s <= v * 10 for s in steps) * 97, v)[shape]
            for v in range(cap + 2)
        ]
        for k in range(1, cap + 2):  # make it monotone
            curve[k] = max(curve[k], curve[k - 1])
        budget = rng.randint(curve[1], curve[cap] + 10)
        measure, calls = counted(lambda v, c=curve: c[v])
        hint = rng.choice([None, rng.randint(1, cap)])
        result = largest_fitting(measure, budget, cap, hint=hint)
        truth = max(v for v in range(1, cap + 1) if curve[v] <= budget)
        assert result.best == truth, (trial, hint)
        assert len(calls) == len(set(calls))
        assert len(calls) <= 4 * math.ceil(math.log2(cap)) + 4, (trial, len(calls))
        if truth < cap:
            assert not result.probe(truth + 1).fits


def _classes_and_curve(rng, cap: int, chunk: int, m: int):
    """A compile-like M_max over N: equal on each length class (a plateau while the padded prompt
    holds N + M, then one class per N), growing per class and jumping at each chunk."""
    extent = {}
    for v in range(1, cap + 1):
        k = -(-v // chunk)
        plateau = v + m <= k * chunk
        extent[v] = ((k - 1) * chunk + 1, min(k * chunk - m, cap)) if plateau else (v, v)
    curve = [0] * (cap + 2)
    for v in range(1, cap + 2):
        k = -(-v // chunk)
        width = v + m if v + m > k * chunk else k * chunk
        curve[v] = 5_000 + 3 * width + 40 * k * chunk + rng.randint(0, 2)
    for v in range(2, cap + 2):  # monotone, and equal within a class
        curve[v] = max(curve[v], curve[v - 1])
    for v in range(1, cap + 1):
        first, last = extent[v]
        curve[v] = curve[last]
    return extent, curve


@pytest.mark.parametrize("seed", range(8))
def test_search_with_length_classes_is_exact_and_compiles_once_per_class(seed):
    import random

    rng = random.Random(seed)
    cap, chunk, m = 3_000, rng.choice([64, 128, 256]), rng.choice([16, 40])
    extent, curve = _classes_and_curve(rng, cap, chunk, m)
    budget = rng.randint(curve[1], curve[cap] + 5)
    measure, calls = counted(lambda v: curve[v])
    hint = rng.choice([None, cap, rng.randint(2, cap), [cap, rng.randint(2, cap)]])
    result = largest_fitting(
        measure, budget, cap, hint=hint, step=chunk, extent=lambda v: extent[v]
    )
    truth = max((v for v in range(1, cap + 1) if curve[v] <= budget), default=None)
    assert result.best == truth
    # never two compiles of one class, and each compile is its class's largest value
    assert len({extent[v] for v in calls}) == len(calls)
    assert all(extent[v][1] == v for v in calls)
    assert len(calls) <= 10, calls
    if truth is not None and truth < cap:
        over = result.probe(truth + 1)
        assert over is not None and not over.fits and over.first <= truth + 1 <= over.value


def test_search_without_classes_creeps_where_the_classes_jump():
    # The same compile-like curve searched value by value takes many more compiles: what the
    # classes and the chunk grid save (`dctms fit` on the 7B at 8 GiB: 27 compiles -> 10).
    import random

    extent, curve = _classes_and_curve(random.Random(3), 3_000, 256, 16)
    budget = curve[1_500]
    plain, plain_calls = counted(lambda v: curve[v])
    classed, classed_calls = counted(lambda v: curve[v])
    a = largest_fitting(plain, budget, 3_000, hint=3_000)
    b = largest_fitting(classed, budget, 3_000, hint=3_000, step=256, extent=lambda v: extent[v])
    assert a.best == b.best
    assert len(classed_calls) < len(plain_calls)


def test_max_positions():
    assert max_positions({"max_position_embeddings": 4096}) == 4096
    assert max_positions({"text_config": {"max_position_embeddings": 8192}}) == 8192
    assert max_positions({"model_type": "x"}) is None


# ------------------------------------------------------------------- the command, real compiles


@pytest.mark.slow
def test_fit_n_is_the_largest_that_fits(tiny, tmp_path, capsys):
    budget = m_max(tiny, 300, M)  # a budget from a real compile, so the answer is not trivial
    out_plan = tmp_path / "fit.plan"
    code = cli.main(
        ["fit", str(tiny), "--memory", str(budget), "-M", str(M), "--json", "-o", str(out_plan)]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out)
    n = summary["value"]
    assert n >= 300 and not summary["capped"]
    # Independent compiles: N fits, N + 1 does not.
    assert m_max(tiny, n, M) == summary["envelope"]["total"] <= budget
    assert m_max(tiny, n + 1, M) == summary["next_value_total"] > budget
    assert summary["envelope"]["free"] == budget - summary["envelope"]["total"]
    assert summary["compiles"] <= 2 * math.ceil(math.log2(n)) + 2
    assert captured.err.count("\n") == summary["compiles"]  # one progress line per compile
    plan = read_plan(out_plan)
    assert (plan.bounds.input_tokens, plan.bounds.output_tokens) == (n, M)
    assert plan.envelope.device == budget


def test_fit_m_text_and_max_position_cap(tmp_path, capsys):
    folder = write_config(tmp_path / "short", max_position_embeddings=64)
    code = cli.main(["fit", str(folder), "--memory", "1TiB", "-N", "16", "-q"])
    captured = capsys.readouterr()
    assert code == 0 and captured.err == ""
    lines = captured.out.splitlines()
    assert (
        lines[0]
        == "qwen2 (4 layers): largest M = 48 for N = 16 within 1,024.00 GiB (1,099,511,627,776 bytes)"
    )
    assert (
        lines[1] == "  stopped at max_position_embeddings 64 (N + M); the budget would allow more"
    )
    assert "total = M_max" in captured.out and "\n  free " in captured.out
    assert "\n1 compile in " in captured.out  # the cap first, and it fits


def test_a_position_limit_past_the_compilers_stops_at_the_compilers(tmp_path, capsys):
    # max_position_embeddings 2^31 - 1 is a valid config; the compiler takes N + M <= 2^24, so
    # that is where the search stops (once it probed far past it and failed on float overflow).
    folder = write_config(tmp_path / "long", max_position_embeddings=2**31 - 1)
    code = cli.main(["fit", str(folder), "--memory", "1TiB", "-N", "16", "-q"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out[0].startswith(f"qwen2 (4 layers): largest M = {2**24 - 16:,} for N = 16")
    assert out[1] == "  stopped at the compiler's limit of 16,777,216 (N + M); the budget would allow more"


def test_even_one_token_does_not_fit(tiny, capsys):
    code = cli.main(["fit", str(tiny), "--memory", "10MiB", "-M", str(M), "-q"])
    err = capsys.readouterr().err
    short = m_max(tiny, 1, M) - 10 * 2**20
    assert code == 1
    assert err.startswith("dctms fit: even N = 1 (M = 16) needs M_max ")
    assert f"({short:,} bytes) more than the 10.00 MiB budget" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--memory", "lots", "-M", "16"], "--memory: not a size"),
        (["--memory", "1GiB", "-M", "0"], "-M must be at least 1"),
        (["--memory", "1GiB", "-M", "4096"], "leaves no room"),
    ],
)
def test_bad_input_exit_2(tiny, capsys, argv, message):
    code = cli.main(["fit", str(tiny), *argv, "-q"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


def test_missing_model_exit_2(tmp_path, capsys):
    assert cli.main(["fit", str(tmp_path / "none"), "--memory", "1GiB", "-M", "16"]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_one_length_key_one_plan_and_a_probe_has_the_full_envelope(tiny):
    # What `fit` relies on to compile once per class: every N of a length_extent compiles to the
    # same phases and envelope (tiny config, chunk 64, M = 16: N in 65..112 pads to 128 positions,
    # which hold N + M, so the cache is 129 positions for all of them); the next N does not.
    from dataclasses import replace

    import msgspec

    from dctms.toolkit.compiler import length_extent, length_key

    base = CompileOptions(100, M, prefill_chunk=64, real_lengths=False)
    first, last = length_extent(base, True, cap=4_000)(100)
    assert (first, last) == (65, 112)
    source = open_model(tiny)

    def probe(n: int):
        return compile_plan(source, replace(base, input_tokens=n), probe=True)

    a, b, after = probe(first), probe(last), probe(last + 1)
    assert length_key(replace(base, input_tokens=last + 1)) != length_key(base)
    assert a.envelope == b.envelope and after.envelope.total > b.envelope.total
    assert msgspec.json.encode(a.phases) == msgspec.json.encode(b.phases)
    # a probe leaves out the module paths and the verifier, nothing the envelope depends on
    full = compile_plan(source, replace(base, input_tokens=last))
    assert full.envelope == b.envelope and full.modules is not None and b.modules is None


# --------------------------------------------------------------------------- --search chunk


@functools.cache
def m_max_at(folder: Path, n: int, m: int, chunk: int) -> int:
    return compile_plan(
        open_model(folder), CompileOptions(n, m, prefill_chunk=chunk)
    ).envelope.total


@pytest.mark.slow
def test_search_chunk_table_and_certificates(tiny, tmp_path, capsys):
    # A budget from a real compile at chunk 64, N = 900: smaller chunks fit more tokens.
    budget = m_max_at(tiny, 900, M, 64)
    out_plan = tmp_path / "best.plan"
    argv = ["fit", str(tiny), "--memory", str(budget), "-M", str(M), "--search", "chunk"]
    code = cli.main([*argv, "--chunks", "128,16,64", "--json", "-o", str(out_plan)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    doc = json.loads(captured.out)
    rows = doc["chunks"]
    assert [r["prefill_chunk"] for r in rows] == [16, 64, 128]  # sorted
    for r in rows:  # every row's certificate, by independent compiles
        n, chunk = r["value"], r["prefill_chunk"]
        assert m_max_at(tiny, n, M, chunk) == r["m_max"] <= budget
        assert m_max_at(tiny, n + 1, M, chunk) == r["next_value_total"] > budget
        assert r["ttft_s"] > 0 and r["decode_tokens_per_s"] > 0
    values = [r["value"] for r in rows]
    assert values[0] >= values[1] >= 900 > values[2]  # the trade the table shows
    best = doc["best"]
    assert best["value"] == max(values) and best["prefill_chunk"] in (16, 64)
    assert best["compiles"] == sum(r["compiles"] for r in rows)
    assert "searching 3 prefill chunks" in captured.err
    assert captured.err.count("\n") == 1 + best["compiles"]  # one line per compile
    plan = read_plan(out_plan)
    assert plan.bounds.prefill_chunk == best["prefill_chunk"]
    assert plan.bounds.input_tokens == best["value"]
    # TTFT at the common prompt: more, smaller calls cost at least as much weight traffic
    assert doc["prompt_tokens"] == min(values)


@pytest.mark.slow
def test_probes_compiled_ahead_by_workers_give_the_same_search(tiny, capsys, monkeypatch):
    # The workers start only after a slow probe (the 7B's); forced on here for the tiny model,
    # the search, its compiles and every figure are the same as without them.
    from dctms.cli.commands import fit as fit_command

    budget = m_max_at(tiny, 600, M, 64)
    argv = ["fit", str(tiny), "--memory", str(budget), "-M", str(M), "--search", "chunk"]
    monkeypatch.setattr(fit_command, "_spawn_can_start_here", lambda: True)  # pytest-xdist's main
    taken = []
    take = fit_command._Ahead.take
    monkeypatch.setattr(
        fit_command._Ahead, "take", lambda self, o: taken.append(take(self, o)) or taken[-1]
    )
    docs = []
    for min_s in (float("inf"), 0.0):
        monkeypatch.setattr(fit_command._Ahead, "AHEAD_MIN_S", min_s)
        assert cli.main([*argv, "--chunks", "16,32,64", "--json", "-q"]) == 0
        doc = json.loads(capsys.readouterr().out)
        doc["best"].pop("seconds")
        docs.append(doc)
    assert docs[0] == docs[1]
    assert sum(plan is not None for plan in taken) == 2  # chunks 32 and 64 came from the workers


@pytest.mark.slow
def test_search_chunk_text(tiny, capsys):
    budget = m_max_at(tiny, 600, M, 64)
    argv = ["fit", str(tiny), "--memory", str(budget), "-M", str(M), "--search", "chunk", "-q"]
    assert cli.main([*argv, "--chunks", "32,128", "--prompt-tokens", "100"]) == 0
    out = capsys.readouterr().out
    assert "prefill chunk -> largest N; predicted on cpu-x86-2core-openblas" in out
    assert "TTFT @ 100" in out and "<- most tokens" in out
    assert "the fit at chunk " in out and "total = M_max" in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--search", "chunk", "--prefill-chunk", "64"], "--prefill-chunk fixes the chunk"),
        (["--search", "chunk", "--chunks", "64,x"], "--chunks: not a comma-separated list"),
        (["--search", "chunk", "--chunks", "0,64"], "every chunk must be at least 1"),
        (["--chunks", "64"], "--chunks and --prompt-tokens need --search chunk"),
        (["--search", "chunk", "--max-compiles", "3"], "stopped after --max-compiles 3"),
        (["--search", "chunk", "--prompt-tokens", "0"], "--prompt-tokens must be at least 1"),
    ],
)
def test_search_chunk_bad_input_exit_2(tiny, capsys, extra, message):
    code = cli.main(["fit", str(tiny), "--memory", "1GiB", "-M", str(M), "-q", *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


# ------------------------------------------------------------- one option set for compile and fit


def _options(command: str) -> dict[str, argparse.Action]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {s: a for a in sub.choices[command]._actions for s in a.option_strings}


def test_fit_takes_every_compile_option():
    compile_opts, fit_opts = _options("compile"), _options("fit")
    own = {"-o", "--output", "--progress", "-q", "--quiet", "-h", "--help"}
    bounds = {"-N", "--input-tokens", "-M", "--output-tokens"}
    missing = set(compile_opts) - set(fit_opts) - own
    assert not missing, f"fit lacks compile options {sorted(missing)}"
    for name in set(compile_opts) - own - bounds:
        a, b = compile_opts[name], fit_opts[name]
        assert (a.dest, a.type, a.choices, a.default) == (b.dest, b.type, b.choices, b.default)
    assert fit_opts["--memory"].required and not compile_opts["--memory"].required


def test_fit_passes_the_options_to_the_compiler(tiny, tmp_path, capsys):
    out_plan = tmp_path / "opts.plan"
    argv = ["fit", str(tiny), "--memory", "1GiB", "-N", "8", "-q", "-o", str(out_plan)]
    extra = ["--alignment", "256", "--profile", "apple-m1-pro", "--sync-every", "2", "--batch", "2"]
    assert cli.main([*argv, *extra, "--dtype", "float16"]) == 0
    plan = read_plan(out_plan)
    assert plan.target.alignment == 256 and plan.target.profile.name == "apple-m1-pro"
    assert plan.bounds.batch == 2 and plan.bounds.dtype == "float16"
    assert len(plan.phases[1].sync_points) > 1  # synced every 2 layers, not at the end only
