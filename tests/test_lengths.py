"""Real-length phases: one plan traced at its bound, every call run at a verified smaller length.

Compiler side (``dctms.toolkit.lengths``): the length grid, the affine fit (and its refusals), the
points kept only where the lifetime pass gives the bound's decisions. Runner side
(``dctms.runner.lengths`` + ``Session``): a call runs at the smallest verified point that holds it,
never at an unverified one; the greedy ids equal the bound's (padded) run and mlx-lm's; every call's
MLX peak stays within the envelope; the recorded (replayed) graphs give the same ids.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import TINY_QWEN2

from dctms.runner.execute import PhaseProgram
from dctms.runner.load import load_checked_plan
from dctms.runner.request import validate_request
from dctms.runner.session import Session
from dctms.schema.errors import DctmsError
from dctms.schema.model_folder import open_model_folder
from dctms.schema.verify import verify_plan
from dctms.toolkit import lengths as L
from dctms.toolkit.lifetimes import Life, PhaseLives
from dctms.toolkit.trace import TracedOp, TracedPhase, TracedTensor

N, M, CHUNK = 40, 12, 16

# ------------------------------------------------------------------------------------ the grid


@pytest.mark.parametrize("bound, step", [(512, 16), (2305, 32), (16, 16), (7, 16), (100, 16)])
def test_length_grid(bound: int, step: int) -> None:
    grid = L.length_grid(bound, step)
    assert grid[-1] == bound and grid == sorted(set(grid))
    assert all(v % step == 0 for v in grid[:-1])
    for small, big in zip(grid, grid[1:], strict=False):
        # any length in (small, big] is padded to big: at most one step, or ~1/8 beyond 8 steps
        assert big - small <= max(step, small // 8)


def test_sample_lengths_are_distinct_and_not_one() -> None:
    assert L.sample_lengths(512) == (256, 170)
    assert L.sample_lengths(5) is None  # 5 // 3 = 1: size-1 axes behave differently in MLX


def test_sample_lengths_step_past_special_windows() -> None:
    # a ring of 32 slots: a 32-position window traces without one broadcast, so it is not sampled
    assert L.sample_lengths(97, avoid=[32]) == (48, 31)
    assert L.sample_lengths(64, avoid=[32, 31]) == (30, 21)
    assert L.sample_lengths(64, avoid=[21]) == (32, 20)
    assert L.sample_lengths(6, avoid=[3, 2]) is None


# ------------------------------------------------------------------------------------ the fit


def _phase(n: int, w: int, *, square: bool = False, primitive: str = "Add") -> TracedPhase:
    """A two-op phase whose sizes follow n (tokens) and w (window)."""
    cols = n * n if square else 2 * n + 1
    ops = [
        TracedOp("Slice", [[0, 0], [n, w], [1, 1]], ("x",), ("y",)),
        TracedOp(primitive, [cols, "keep"], ("y",), ("z",)),
    ]
    tensors = {
        "y": TracedTensor("y", (n, w), "float32"),
        "z": TracedTensor("z", (n, cols), "float32"),
    }
    return TracedPhase("p", n, [], [], [], ops, tensors)


def _samples(**kw) -> list:
    points = [(8, 30), (4, 30), (8, 15), (3, 10)]  # bound, two basis points, one check
    return [(p, _phase(*p, **kw)) for p in points]


def test_fit_finds_the_affine_functions() -> None:
    lf = L.fit([L.TOKENS, L.WINDOW], _samples())
    assert lf.args[(0, (1, 0))] == L.Affine((1, 0), 0)  # the slice stop follows tokens
    assert lf.args[(0, (1, 1))] == L.Affine((0, 1), 0)  # ... and the window
    assert lf.args[(1, (0,))] == L.Affine((2, 0), 1)  # 2 * tokens + 1
    assert (1, (1,)) not in lf.args  # "keep" never changes
    assert lf.shapes["z"] == {0: L.Affine((1, 0), 0), 1: L.Affine((2, 0), 1)}
    small = L.instantiate(_phase(8, 30), lf, (5, 20))
    assert small.ops[0].args == [[0, 0], [5, 20], [1, 1]] and small.ops[1].args == [11, "keep"]
    assert small.tensors["z"].shape == (5, 11) and small.tokens == 5


def test_fit_refuses_a_size_the_check_sample_contradicts() -> None:
    with pytest.raises(L.NotAffine, match="not affine"):
        L.fit([L.TOKENS, L.WINDOW], _samples(square=True))  # tokens**2 fits two points only


def test_fit_refuses_another_graph() -> None:
    samples = _samples()
    samples[2] = (samples[2][0], _phase(8, 15, primitive="Multiply"))
    with pytest.raises(L.NotAffine, match="op 1 is Multiply"):
        L.fit([L.TOKENS, L.WINDOW], samples)


def test_fit_refuses_a_shrinking_tensor() -> None:
    def shrinking(n: int, w: int) -> TracedPhase:
        p = _phase(n, w)
        return replace(p, tensors={**p.tensors, "y": TracedTensor("y", (40 - n, w), "float32")})

    points = [(8, 30), (4, 30), (8, 15), (3, 10)]
    with pytest.raises(L.NotAffine, match="shrinks"):
        L.fit([L.TOKENS, L.WINDOW], [(p, shrinking(*p)) for p in points])


def _lives(kind: str, end: int, size: int) -> PhaseLives:
    life = Life("t", (size,), "uint8", size, kind, None, 0, end)
    return PhaseLives({"t": life}, {"t": (0, end)}, [0, 0], [2, 2])


def test_a_point_with_other_lifetimes_or_larger_tensors_is_dropped() -> None:
    bound = _lives("intermediate", 1, 64)
    assert L._differs(bound, _lives("intermediate", 1, 32)) == ""
    assert "larger" in L._differs(bound, _lives("intermediate", 1, 128))
    assert "over [0, 0]" in L._differs(bound, _lives("intermediate", 0, 64))
    assert "view" in L._differs(bound, _lives("view", 1, 64))


# ------------------------------------------------------------------------------- a real model


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, Path]:
    from dctms.schema.io import write_plan
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions, compile_plan
    from dctms.toolkit.tiny_model import write_tiny_model

    folder = tmp_path_factory.mktemp("lengths-model")
    write_tiny_model(folder, dict(TINY_QWEN2))
    plan = compile_plan(open_model(folder), CompileOptions(N, M, prefill_chunk=CHUNK))
    write_plan(plan, folder / "model.plan")
    return folder / "model.plan", folder


def test_compiled_phases_carry_verified_points(model) -> None:
    plan = load_checked_plan(model[0])
    assert verify_plan(plan) == []
    phases = {p.name: p for p in plan.phases}
    window = plan.bounds.kv_capacity - 1
    prefill, decode = phases["prefill"].lengths, phases["decode"].lengths
    # prefill attends at most over the padded prompt (3 chunks of 16), decode over N + M
    assert prefill.names == ["tokens", "window"] and prefill.bound == [CHUNK, 48]
    assert decode.names == ["window"] and decode.bound == [window]
    assert [16, 16] in prefill.points and [16, 32] in prefill.points  # chunks 1 and 2
    assert [32] in decode.points and [window] in decode.points
    # the tokens input follows the tokens length; some op arguments follow the window
    places = {place for f in prefill.affine for place in f.at}
    tokens_input = next(b.id for b in phases["prefill"].inputs if b.name == "tokens")
    assert f"i{tokens_input}/1" in places
    assert any(f.k == [0, 1] for f in prefill.affine)


def prompt(n: int) -> list[int]:
    return [(11 * i + 5) % 256 for i in range(n)]


@pytest.fixture(scope="module")
def session(model):
    memory = mx.get_memory_limit()
    mx.synchronize()
    mx.clear_cache()
    foreign = mx.get_active_memory()  # arrays other tests in this process still hold
    s = Session(load_checked_plan(model[0]), open_model_folder(model[1]))
    s.apply_limits(foreign)  # else MLX's throttle would hold back the plan's run-ahead
    yield s
    mx.set_memory_limit(memory)


def test_calls_run_at_the_smallest_verified_point(session) -> None:
    session.generate(validate_request(session.plan, prompt(5), 3))
    used = set(session.prefill._variants) | set(session.decode._variants)
    assert (16, 16) in used  # a 5-token prompt: one 16-token chunk over a 16-position window
    assert (32,) in used  # decode at positions 5..7: the 32-position window
    lengths = session.prefill.lengths
    assert lengths.pick({"tokens": 5, "window": 5}) == (16, 16)
    assert lengths.pick({"tokens": 8, "window": 24}) == (16, 32)
    with pytest.raises(DctmsError, match="not one the plan verified"):
        session.decode.variant((33,))


@pytest.mark.parametrize("n", [1, 5, CHUNK, 23, N])
def test_real_length_ids_equal_the_bound_and_mlx_lm(session, model, n) -> None:
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    ids = prompt(n)
    real = session.generate(validate_request(session.plan, ids, M)).tokens
    # The same plan at its bound only: every chunk padded to 16 tokens, every window the largest.
    bound = Session.__new__(Session)
    bound.__dict__.update(session.__dict__)
    bound.prefill = PhaseProgram(replace_lengths(session.prefill.lengths.phase, session))
    bound.decode = PhaseProgram(replace_lengths("decode", session))
    assert bound.generate(validate_request(bound.plan, ids, M)).tokens == real
    baseline, _ = load_model(model[1])
    steps = generate_step(mx.array(ids, dtype=mx.int32), baseline, max_tokens=M)
    assert [int(t) for t, _ in steps] == real


def replace_lengths(name: str, session: Session):
    """The session's phase ``name`` without its lengths record (fixed shapes at the bound)."""
    import msgspec

    phase = next(p for p in session.plan.phases if p.name == name)
    return msgspec.structs.replace(phase, lengths=None)


def test_every_call_stays_within_the_envelope(session) -> None:
    # Above what the process already holds (the session's weights, cache and constants, and
    # whatever other tests left), a call may use at most the provable envelope's other part.
    allowed = session.plan.envelope.provable - session.held_bytes()
    for n in (2, 9, CHUNK + 1, N):
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        session.generate(validate_request(session.plan, prompt(n), M))
        mx.synchronize()
        assert mx.get_peak_memory() - before <= allowed, n


def test_replayed_graphs_give_the_same_ids(session) -> None:
    ids = prompt(23)
    first = session.generate(validate_request(session.plan, ids, M)).tokens  # recorded by now: the variants ran before
    assert all(v.runs >= 1 for v in session.decode._variants.values())
    again = session.generate(validate_request(session.plan, ids, M)).tokens
    assert again == first
    assert any(r is not None for v in session.decode._variants.values() for r in v.replays)
