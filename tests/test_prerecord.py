"""Pre-recording: a session records the graphs of the length points its calls will use before the
first call (``Session.prerecord``), computing nothing, so no call pays for a first use.

Checked here: the points ``runner.prerecord`` predicts are exactly those the calls run at; after
pre-recording, a generation records and builds nothing new and gives the ids of a session that
recorded on first use; pre-recording allocates nothing and leaves the KV cache untouched."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY_QWEN2

from dctms.runner.execute import PhaseProgram
from dctms.runner.lengths import LengthTable
from dctms.runner.load import load_checked_plan
from dctms.runner.prerecord import request_points
from dctms.runner.request import validate_request
from dctms.runner.session import Session
from dctms.schema.model_folder import open_model_folder

N, M, CHUNK = 40, 12, 16


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, Path]:
    from dctms.schema.io import write_plan
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions, compile_plan
    from dctms.toolkit.tiny_model import write_tiny_model

    folder = tmp_path_factory.mktemp("prerecord-model")
    write_tiny_model(folder, dict(TINY_QWEN2))
    plan = compile_plan(open_model(folder), CompileOptions(N, M, prefill_chunk=CHUNK))
    write_plan(plan, folder / "model.plan")
    return folder / "model.plan", folder


@pytest.fixture
def session(model):
    memory = mx.get_memory_limit()
    s = Session(load_checked_plan(model[0]), open_model_folder(model[1]))
    yield s
    mx.set_memory_limit(memory)


def prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 256 for i in range(n)]


def _points_run(session: Session, request) -> tuple[set, set]:
    """The points each phase's ``run`` is called with during one generation."""
    seen: dict[str, set] = {"prefill": set(), "decode": set()}
    for program in (session.prefill, session.decode):
        original = program.run

        def spy(*args, _original=original, _name=program.name, **kwargs):
            seen[_name].add(tuple(kwargs["point"]))
            return _original(*args, **kwargs)

        program.run = spy
    try:
        session.generate(request)
    finally:
        del session.prefill.run, session.decode.run
    return seen["prefill"], seen["decode"]


@pytest.mark.parametrize("n, max_tokens", [(1, 2), (5, M), (CHUNK, 7), (23, M), (N, M)])
def test_predicted_points_are_the_points_the_calls_run_at(session, n, max_tokens) -> None:
    request = validate_request(session.plan, prompt(n), max_tokens)
    predicted = request_points(
        session.prefill.lengths, session.decode.lengths, session.chunk, n, max_tokens
    )
    assert _points_run(session, request) == predicted


def test_after_prerecording_a_call_records_nothing(session, model) -> None:
    requests = [validate_request(session.plan, prompt(n), M) for n in (3, 23, N)]
    done = session.prerecord(requests)
    assert done.points > 0 and done.seconds >= 0
    recorded = {
        (p.name, point): list(v.replays)
        for p in (session.prefill, session.decode)
        for point, v in p._variants.items()
    }
    assert session.prefill.checked and session.decode.checked
    assert all(r is not None for replays in recorded.values() for r in replays)

    def fail(*_args, **_kwargs):
        raise AssertionError("a call recorded a graph after pre-recording")

    for program in (session.prefill, session.decode):
        program._record = fail
    ids = [session.generate(r).tokens for r in requests]
    # no new variant, and every call ran on the recorded graphs (none through Python)
    assert {(p.name, point) for p in (session.prefill, session.decode) for point in p._variants} == set(
        recorded
    )
    # the same ids as a session that recorded each point at its first use
    fresh = Session(load_checked_plan(model[0]), open_model_folder(model[1]))
    again = [validate_request(fresh.plan, list(r.prompt), r.max_tokens) for r in requests]
    assert [fresh.generate(r).tokens for r in again] == ids


def test_prerecording_everything_covers_every_verified_point(session) -> None:
    done = session.prerecord()
    for program in (session.prefill, session.decode):
        assert set(program._variants) == set(program.lengths.points)
        assert all(r is not None for v in program._variants.values() for r in v.replays)
    assert done.points == len(session.prefill.lengths.points) + len(session.decode.lengths.points)
    assert session.prerecord().points == 0  # nothing left to record


def test_prerecording_computes_and_allocates_nothing(session) -> None:
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    session.prerecord()
    mx.synchronize()
    # Nothing was evaluated: MLX's exporter materialises only the scalar constants it stores in
    # the recorded file (12 bytes here), against phase arenas of KiBs.
    assert mx.get_peak_memory() - before <= 64
    assert mx.get_active_memory() <= before
    assert min(p.arena_bytes for p in session.plan.phases) > 1024
    for name, cache in session.state.items():  # the placeholders wrote nothing into the cache
        assert not np.any(np.array(cache)), name


def test_a_shape_the_plan_does_not_say_is_refused_at_prerecording(session) -> None:
    from dctms.schema.errors import DctmsError

    program = session.decode
    step = program._variants[program.lengths.bound].steps[0][0]
    wrong = tuple(tuple(d + 1 for d in s) for s in step.shapes)
    broken = list(program._variants[program.lengths.bound].steps[0])
    broken[0] = type(step)(**{**step.__dict__, "shapes": wrong})
    program._variants[program.lengths.bound].steps[0] = tuple(broken)
    with pytest.raises(DctmsError, match="the plan says"):
        program.prepare(session.weights, session.state)
    assert isinstance(program, PhaseProgram) and not program.checked


def test_dctms_run_reports_the_recording_as_set_up(model, tmp_path, capsys) -> None:
    import json

    from dctms.cli.main import main as cli

    report = tmp_path / "r.json"
    ids = ",".join(map(str, prompt(23)))
    args = ["run", str(model[0]), "--model", str(model[1]), "--tokens", ids, "--max-tokens", "5"]
    assert cli([*args, "--ignore-eos", "--report", str(report)]) == 0
    err = capsys.readouterr().err
    plan = load_checked_plan(model[0])
    phases = {p.name: p for p in plan.phases}
    pre, dec = request_points(
        LengthTable(phases["prefill"]), LengthTable(phases["decode"]), CHUNK, 23, 5
    )
    setup = json.loads(report.read_text())["setup"]
    assert setup["recorded_points"] == len(pre) + len(dec) > 0 and setup["record_s"] > 0
    assert f"set-up: graphs of {len(pre) + len(dec)} length points recorded in" in err
    assert "before the first token (not in TTFT)" in err


def test_dctms_run_counts_only_its_own_memory_in_a_shared_process(model, tmp_path) -> None:
    """Run as a library call, beside arrays the caller holds (here 8 MB, far above this plan's
    provable envelope), the run's observed peak is its own: within the envelope, and not below
    what the session itself must hold."""
    import json

    import mlx.core as mx

    from dctms.cli.main import main as cli

    held = mx.ones((2_000_000,), dtype=mx.float32)
    mx.eval(held)
    report = tmp_path / "r.json"
    ids = ",".join(map(str, prompt(9)))
    args = ["run", str(model[0]), "--model", str(model[1]), "--tokens", ids, "--max-tokens", "3"]
    assert cli([*args, "--ignore-eos", "--report", str(report)]) == 0
    doc = json.loads(report.read_text())
    plan = load_checked_plan(model[0])
    observed = doc["observed"]["mlx_peak_bytes"]
    assert doc["within_envelope"] and observed <= plan.envelope.provable < held.nbytes
    assert observed >= plan.envelope.weights + plan.envelope.kv
    del held
