"""Issue 11, findings 1-3: a plan that validates must never crash the runner.

1. bounds edited past the KV cache really allocated; 2. ``model.vocab_size`` larger than the
embedding (or 0); 3. a phase, an input binding or the output binding renamed. Each is refused by
the verifier (``dctms validate``) and by ``dctms run`` in one line; the runner's own check against the
arrays it allocated is shown separately on plans that skip the verifier (in a subprocess, so that a
missing check would be a crash of that process, not of the tests).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hardening import (
    M,
    N,
    assert_invalid,
    assert_one_line_refusal,
    build_tiny,
    cli,
    cli_subprocess,
    edit_plan,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("harden-runner")
    folder = root / "tiny"
    return build_tiny(folder), folder


def _bounds(output_tokens: int, kv_capacity: int, input_tokens: int = N):
    def edit(doc: dict) -> None:
        doc["bounds"].update(
            input_tokens=input_tokens, output_tokens=output_tokens, kv_capacity=kv_capacity
        )

    return edit


def _vocab(size: int):
    def edit(doc: dict) -> None:
        doc["model"]["vocab_size"] = size

    return edit


# ------------------------------------------------------------------- 1. bounds vs the cache


@pytest.mark.parametrize(
    ("edit", "args"),
    [
        (_bounds(32, 64), ["--tokens", "1,2,3", "--max-tokens", "32"]),
        (_bounds(M, 80, input_tokens=64), ["--tokens", ",".join(["5"] * 64), "--max-tokens", "2"]),
    ],
    ids=["M 16->32, capacity 48->64", "N 32->64, capacity 48->80"],
)
def test_bounds_beyond_the_allocated_cache_are_refused(tiny, tmp_path, edit, args):
    plan, folder = tiny
    edited = edit_plan(plan, tmp_path / "edited.plan", edit)
    assert_invalid(cli("validate", str(edited)), "smaller than bounds.kv_capacity")
    result = cli_subprocess("run", str(edited), "--model", str(folder), *args)
    assert_one_line_refusal(result, "run", "kv_capacity")


def test_the_seven_b_plan_with_the_same_edit_is_refused(tmp_path):
    plan = Path(__file__).parent.parent / "plans" / "qwen7b.plan"
    edited = edit_plan(plan, tmp_path / "7b.plan", _bounds(512, 2560, input_tokens=2048))
    assert_invalid(cli("validate", str(edited)), "kv_capacity")


# Skipping the verifier: the runner's own check of what it allocated. The script builds the plan
# object in memory (no file, no verifier) and opens a Session on it.
_BYPASS = """
import sys, msgspec
from dctms.runner.load import check_runtime
from dctms.schema.model_folder import open_model_folder
from dctms.runner.request import validate_request
from dctms.runner.session import Session
from dctms.schema.errors import DctmsError
from dctms.schema.io import read_plan
plan = read_plan(sys.argv[1])
edit = sys.argv[3]
if edit == "capacity":
    plan = msgspec.structs.replace(plan, bounds=msgspec.structs.replace(
        plan.bounds, output_tokens=32, kv_capacity=64))
    prompt, count = [1, 2, 3], 32
else:
    plan = msgspec.structs.replace(plan, model=msgspec.structs.replace(
        plan.model, vocab_size=plan.model.vocab_size * 100))
    prompt, count = [1, 2, 30000], 2
check_runtime(plan)
request = validate_request(plan, prompt, count)
try:
    session = Session(plan, open_model_folder(sys.argv[2]))
except DctmsError as err:
    print(err)
    sys.exit(2)
session.generate(request)
print("generated")
"""


@pytest.mark.parametrize(
    ("edit", "needle"),
    # capacity: N + M + the spare position that keeps every attention window a proper slice
    [("capacity", "holds 49 along axis 2"), ("vocab", "fewer than the plan's vocab_size 38400")],
)
def test_the_session_checks_the_arrays_it_allocated(tiny, edit, needle):
    plan, folder = tiny
    proc = subprocess.run(
        [sys.executable, "-c", _BYPASS, str(plan), str(folder), edit],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert needle in proc.stdout, proc.stdout


# ------------------------------------------------------------------- 2. vocab_size vs embedding


@pytest.mark.parametrize("size", [38400, 0])
def test_vocab_size_is_checked_against_the_embedding(tiny, tmp_path, size):
    plan, folder = tiny
    edited = edit_plan(plan, tmp_path / "vocab.plan", _vocab(size))
    assert_invalid(cli("validate", str(edited)), "vocab_size")
    for ids in ("1,2,30000", "1,2,400"):
        result = cli_subprocess("run", str(edited), "--model", str(folder), "--tokens", ids)
        assert_one_line_refusal(result, "run", "vocab")


def test_an_id_past_the_real_vocabulary_is_refused(tiny):
    plan, folder = tiny
    result = cli("run", str(plan), "--model", str(folder), "--tokens", "1,2,400")
    assert_one_line_refusal(result, "run", "token 2 is 400", "[0, 384)")
    assert result.out == ""


# ------------------------------------------------------------------- 3. names the runner uses


def _rename_phase(doc: dict) -> None:
    doc["phases"][1]["name"] = "step"


def _rename_input(doc: dict) -> None:
    next(b for b in doc["phases"][0]["inputs"] if b["name"] == "last_index")["name"] = "last"


def _rename_output(doc: dict) -> None:
    next(b for b in doc["phases"][1]["outputs"] if b["kind"] == "output")["name"] = "token"


@pytest.mark.parametrize(
    ("edit", "validate_needle", "run_needle"),
    [
        (_rename_phase, None, "no phase named 'decode'"),
        (_rename_input, "the runner feeds prefill only", "the runner feeds prefill only"),
        (_rename_output, "no output binding named 'next_token'", "next_token"),
    ],
    ids=["phase", "input binding", "output binding"],
)
def test_renamed_names_are_refused_in_one_line(
    tiny, tmp_path, edit, validate_needle, run_needle
):
    plan, folder = tiny
    edited = edit_plan(plan, tmp_path / "renamed.plan", edit)
    if validate_needle is not None:
        assert_invalid(cli("validate", str(edited)), validate_needle)
    result = cli("run", str(edited), "--model", str(folder), "--tokens", "1,2")
    assert_one_line_refusal(result, "run", run_needle)
    bench = cli("bench", str(edited), "--model", str(folder), "--reps", "1", "-q",
                "--out", str(tmp_path / "bench"))  # fmt: skip
    assert_one_line_refusal(bench, "bench", run_needle)
    assert not (tmp_path / "bench").exists()



# ------------------------------------------------------------------- issue 10.5: one path


def test_a_run_validates_once_and_configures_mlx_once(tiny, monkeypatch):
    """check_runtime is pure; the request is validated once (not again in generate); the device
    is set once, when the Session opens."""
    import mlx.core as mx

    import dctms.runner.request as request

    plan, folder = tiny
    calls: list[str] = []
    set_device, validate = mx.set_default_device, request.validate_requests

    def counted_device(device):
        calls.append("device")
        return set_device(device)

    def counted_validate(*args, **kwargs):
        calls.append("validate")
        return validate(*args, **kwargs)

    monkeypatch.setattr(mx, "set_default_device", counted_device)
    monkeypatch.setattr(request, "validate_requests", counted_validate)
    from dctms.runner.load import load_checked_plan

    load_checked_plan(plan)
    assert calls == []  # reading and checking the plan changes no MLX state
    result = cli("run", str(plan), "--model", str(folder), "--tokens", "1,2,3", "--max-tokens", "3")
    # 3 is possible here: in-process, MLX's peak also counts arrays other tests hold
    assert result.code in (0, 3) and len(result.out.split(",")) == 3, result.err
    assert calls.count("validate") == 1 and calls.count("device") == 1, calls


def test_generate_takes_only_a_request_of_its_own_plan(tiny):
    import msgspec

    from dctms.runner.load import load_checked_plan
    from dctms.runner.request import validate_request
    from dctms.runner.session import Session
    from dctms.schema.model_folder import open_model_folder

    plan_path, folder = tiny
    plan = load_checked_plan(plan_path)
    session = Session(plan, open_model_folder(folder))
    assert session.generate(validate_request(plan, [1, 2], 2)).tokens
    other = msgspec.structs.replace(plan)  # an equal plan, but not the session's
    with pytest.raises(ValueError, match="another plan"):
        session.generate(validate_request(other, [1, 2], 2))
