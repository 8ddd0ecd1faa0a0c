"""`dctms pool`: the combined envelope of plans in one process, and its command line."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from conftest import make_tiny_plan

from dctms.cli.main import main
from dctms.figures.pool import member, pool_of, pool_summary
from dctms.schema.io import read_plan, write_plan
from dctms.views.pool import pool_text

PLANS = Path(__file__).resolve().parents[1] / "plans"
SMALL, BIG = PLANS / "qwen1.5b.plan", PLANS / "qwen7b.plan"
MIB = 2**20


@pytest.fixture(scope="module")
def real_plans():
    return [("small", read_plan(SMALL)), ("big", read_plan(BIG))]


def test_serial_pool_sums_what_is_held_and_shares_one_arena(real_plans):
    (_, a), (_, b) = real_plans
    pool = pool_of(real_plans)
    ea, eb = a.envelope, b.envelope
    held = sum(e.weights + e.kv + e.persistent for e in (ea, eb))
    assert pool.held == held
    assert pool.intermediate == max(ea.intermediate, eb.intermediate)
    assert pool.provable == held + max(ea.intermediate, eb.intermediate)
    # the process baseline is paid once, not per plan
    assert pool.runtime == max(ea.runtime, eb.runtime)
    assert pool.total == pool.provable + pool.runtime
    assert pool.total < pool.separate_total == ea.total + eb.total


def test_concurrent_pool_sums_the_arenas(real_plans):
    (_, a), (_, b) = real_plans
    serial, concurrent = pool_of(real_plans), pool_of(real_plans, concurrent=True)
    assert concurrent.intermediate == a.envelope.intermediate + b.envelope.intermediate
    assert concurrent.total - serial.total == min(a.envelope.intermediate, b.envelope.intermediate)


def test_one_plan_pool_is_that_plans_envelope(real_plans):
    _, a = real_plans[0]
    pool = pool_of(real_plans[:1])
    assert (pool.provable, pool.total) == (a.envelope.provable, a.envelope.total)


def _with_cache(plan, slack: int = 64):
    """The plan as a runner that keeps MLX's buffer cache (limit = arena) would account it."""
    env = plan.envelope
    runtime = env.runtime + env.intermediate
    return msgspec.structs.replace(
        plan,
        target=msgspec.structs.replace(plan.target, allocator_slack=slack),
        envelope=msgspec.structs.replace(
            env, runtime=runtime, total=env.provable + runtime
        ),
    )


def test_buffer_cache_counts_once_when_serial_and_per_plan_when_concurrent():
    p = make_tiny_plan()
    q = msgspec.structs.replace(
        p, envelope=msgspec.structs.replace(p.envelope, intermediate=512, total=p.envelope.total + 384)
    )
    cached = [("p", _with_cache(p)), ("q", _with_cache(q))]
    assert member("p", cached[0][1]).cache == 128 and member("p", p).cache == 0
    assert member("p", cached[0][1]).baseline == p.envelope.runtime
    serial = pool_of(cached)
    assert serial.runtime == p.envelope.runtime + 512  # baseline once + the largest cache
    concurrent = pool_of(cached, concurrent=True)
    assert concurrent.runtime == p.envelope.runtime + 512 + 128


def test_budget_free_shortfall_and_the_prefix_that_fits(real_plans):
    pool = pool_of(real_plans, budget=8 * 2**30)
    assert pool.fits and pool.free == 8 * 2**30 - pool.total
    small_alone = pool_of(real_plans[:1]).total
    tight = pool_of(real_plans, budget=small_alone)
    assert not tight.fits and tight.free == small_alone - tight.total
    assert tight.prefix_that_fits() == 1
    assert pool_of(real_plans, budget=small_alone - 1).prefix_that_fits() == 0


def test_text_explains_what_is_shared_and_what_is_summed(real_plans):
    text = pool_text(pool_of(real_plans, budget=2 * 2**30))
    assert "weights, KV cache, persistent: summed" in text
    assert "intermediate arena: shared" in text and "largest arena" in text
    assert "process baseline once per process" in text
    assert "does NOT fit" in text and "first 1 plan(s) fit together (small)" in text
    concurrent = pool_text(pool_of(real_plans, concurrent=True))
    assert "intermediate arena: summed" in concurrent


def test_cli_fits_prints_free_and_exits_0(capsys):
    assert main(["pool", str(SMALL), str(BIG), "--memory", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert "all 2 plan(s) fit" in out and "free" in out
    assert "qwen1.5b" in out and "qwen7b" in out


def test_cli_short_exits_1_with_the_shortfall(capsys, real_plans):
    pool = pool_of(real_plans)
    budget = pool.total - 1000
    assert main(["pool", f"s={SMALL}", f"b={BIG}", "--memory", str(budget)]) == 1
    captured = capsys.readouterr()
    assert "1,000 bytes short" in captured.out
    assert captured.err.strip() == (
        f"dctms pool: the pool needs {pool.total:,} bytes, 1,000 more than the {budget:,}-byte budget"
    )


@pytest.mark.slow
def test_cli_json_matches_the_composition(capsys, real_plans):
    assert main(["pool", f"small={SMALL}", f"big={BIG}", "--memory", "8GiB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads(json.dumps(pool_summary(pool_of(real_plans, budget=8 * 2**30))))
    assert doc["plans_that_fit"] == 2 and [p["name"] for p in doc["plans"]] == ["small", "big"]
    assert main(["pool", str(SMALL), str(BIG), "--memory", "8GiB", "--json", "--concurrent"]) == 0
    assert json.loads(capsys.readouterr().out)["concurrent"] is True


@pytest.mark.parametrize(
    "args, words",
    [
        ([str(SMALL), "--memory", "lots"], "--memory: not a size"),
        ([str(SMALL), str(SMALL), "--memory", "8GiB"], "two plans are named 'qwen1.5b'"),
        (["missing.plan", "--memory", "8GiB"], "missing.plan"),
        ([f"={SMALL}", "--memory", "8GiB"], "expected PLAN or NAME=PLAN"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(capsys, args, words):
    assert main(["pool", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


def test_cli_refuses_a_broken_plan(tmp_path, capsys):
    bad = make_tiny_plan()
    bad = msgspec.structs.replace(
        bad, envelope=msgspec.structs.replace(bad.envelope, total=bad.envelope.total + 1)
    )
    path = tmp_path / "bad.plan"
    write_plan(bad, path)
    assert main(["pool", str(path), "--memory", "1GiB"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_process_extras_are_added_once_and_explained(real_plans):
    extras = (("HTTP stack (measured)", 16 * MIB), ("chat templates (measured)", 48 * MIB))
    plain, served = pool_of(real_plans), pool_of(real_plans, extras=extras)
    assert served.runtime == plain.runtime + 64 * MIB
    assert served.provable == plain.provable and served.total == plain.total + 64 * MIB
    text = pool_text(served)
    assert "+ HTTP stack (measured) (16 MiB)" in text and "chat templates (measured) (48 MiB)" in text
    assert pool_summary(served)["runtime_extras"][1] == {
        "what": "chat templates (measured)", "bytes": 48 * MIB
    }
    # the prefix search keeps the extras
    budget = pool_of(real_plans[:1], extras=extras).total
    assert pool_of(real_plans, budget=budget, extras=extras).prefix_that_fits() == 1
    assert pool_of(real_plans, budget=budget - 1, extras=extras).prefix_that_fits() == 0
