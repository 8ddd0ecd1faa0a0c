"""`dctms check` and the compile request it re-compiles from (``Plan.compile``)."""

from __future__ import annotations

import json
import shlex
from dataclasses import fields
from pathlib import Path

import msgspec
import pytest
from conftest import TINY_QWEN2

import dctms
from dctms.cli.main import build_parser
from dctms.cli.main import main as cli
from dctms.schema.io import encode_plan, write_plan
from dctms.schema.types import CompileRequest
from dctms.toolkit.check import compile_command, first_difference, options_of
from dctms.toolkit.compiler import CompileOptions
from dctms.toolkit.tiny_model import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def write_config(folder: Path, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps({**TINY_QWEN2, **changes}, indent=2))
    return path


@pytest.fixture(scope="module")
def compiled_once(tmp_path_factory) -> bytes:
    """The plan `dctms compile` writes for the tiny config with N=16, M=8: compiled once for the
    module (the plan holds no path), copied into each test's folder by ``compiled``."""
    folder = tmp_path_factory.mktemp("check-compiled")
    config = write_config(folder / "model")
    plan = folder / "compiled.plan"
    assert cli(["compile", str(config), "-N", "16", "-M", "8", "-q", "-o", str(plan)]) == 0
    return plan.read_bytes()


@pytest.fixture
def compiled(tmp_path: Path, compiled_once: bytes) -> tuple[Path, Path]:
    """(config.json, plan compiled from it with N=16, M=8) in tmp_path, the test's own copy."""
    config = write_config(tmp_path / "model")
    plan = tmp_path / "compiled.plan"
    plan.write_bytes(compiled_once)
    return config, plan


def test_every_compile_option_is_recorded() -> None:
    # A new CompileOptions field that the plan does not record would make `check` inexact.
    options = {f.name for f in fields(CompileOptions)}
    assert options <= set(CompileRequest.__struct_fields__)
    # Beside the options: the config, the plan kind (toolkit/kinds/dispatch.kind_of reads it back), and
    # the Hugging Face id the model was named by (provenance, not compiled: cli/hf_cache.py).
    kind = {"vision", "draft_config", "num_draft"}
    assert set(CompileRequest.__struct_fields__) - options == {"config", "hub", *kind}


def test_the_request_records_the_options_as_given(tmp_path: Path) -> None:
    config = write_config(tmp_path / "m")
    plan = dctms.compile_plan(config, 16, 8, sync_every=1, memory="1GiB", alignment=128)
    req = plan.compile
    assert req is not None and req.config == TINY_QWEN2
    assert (req.sync_every, req.device_memory, req.alignment) == (1, 2**30, 128)
    assert req.prefill_chunk is None and req.dtype is None  # defaults stay defaults
    assert plan.bounds.prefill_chunk == 16 and plan.bounds.dtype == "float32"  # resolved ones
    assert options_of(req) == CompileOptions(
        16, 8, device_memory=2**30, alignment=128, sync_every=1
    )


def test_compile_command_parses_back_to_the_same_options(tmp_path: Path) -> None:
    req = CompileRequest(
        config=TINY_QWEN2, input_tokens=16, output_tokens=8, batch=2, prefill_chunk=4,
        dtype="float16", device_memory=2**30, backend="cpu", alignment=128,
        profile="cpu-x86-2core", sync_every=2, hash_weights=True, pack_seconds=0.5,
    )  # fmt: skip
    words = shlex.split(compile_command(req, "my model/config.json", "out.plan"))
    assert words[:3] == ["dctms", "compile", "my model/config.json"]
    args = build_parser().parse_args(words[1:])
    assert args.output == "out.plan"
    assert (args.input_tokens, args.output_tokens, args.batch, args.prefill_chunk) == (16, 8, 2, 4)
    assert (args.dtype, args.memory, args.backend, args.alignment) == (
        "float16", str(2**30), "cpu", 128,
    )  # fmt: skip
    assert (args.profile, args.sync_every, args.hash_weights) == ("cpu-x86-2core", 2, True)
    assert args.pack_seconds == 0.5
    sampled = CompileRequest(config=TINY_QWEN2, input_tokens=16, output_tokens=8, sampling=True)
    words = shlex.split(compile_command(sampled, "c.json", "p.plan"))
    assert build_parser().parse_args(words[1:]).sampling
    plain = CompileRequest(config=TINY_QWEN2, input_tokens=16, output_tokens=8)
    assert compile_command(plain, "c.json", "p.plan") == "dctms compile c.json -N 16 -M 8 -o p.plan"


def test_fresh_plan_is_ok(compiled, capsys) -> None:
    config, plan = compiled
    assert cli(["check", str(plan)]) == 0
    assert cli(["check", str(plan), "--config", str(config)]) == 0
    assert cli(["check", str(plan), "--model", str(config.parent)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{plan}: ok (re-compiles to the same bytes)"] * 3
    assert dctms.check_plan(plan).ok


@pytest.mark.slow  # re-compiles both checked-in plans (the 7B's real-length points included)
def test_checked_in_plans_are_up_to_date(capsys) -> None:
    plans = sorted(str(p) for p in (ROOT / "plans").glob("*.plan"))
    assert plans and cli(["check", *plans]) == 0, capsys.readouterr().err


def test_grown_model_is_stale_with_the_first_figure(compiled, capsys) -> None:
    config, plan = compiled
    grown = write_config(config.parent.parent / "grown", num_hidden_layers=3)
    before = plan.read_bytes()
    assert cli(["check", str(plan), "--config", str(grown)]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    old = dctms.read_plan(plan).envelope.total
    assert line.startswith(f"{plan}: stale: M_max (envelope.total) {old:,} bytes in the plan, ")
    assert "the model's config.json changed" in line
    assert line.endswith(f"re-make with: dctms compile {grown} -N 16 -M 8 -o {plan}")
    assert plan.read_bytes() == before  # check alone never writes


def test_tool_version_drift_is_stale_and_write_fixes_it(compiled, capsys) -> None:
    _, plan = compiled
    recorded = dctms.read_plan(plan)
    old = msgspec.structs.replace(recorded.generator, mlx="0.31.0")
    write_plan(msgspec.structs.replace(recorded, generator=old), plan)
    result = dctms.check_plan(plan)
    assert result.verdict == "stale"
    assert result.reason.startswith("generator.mlx 0.31.0 in the plan, ")
    assert f"mlx 0.31.0 -> {recorded.generator.mlx}" in result.reason
    assert result.remedy == f"dctms check --write {plan}"
    assert cli(["check", "--write", str(plan)]) == 1  # reported stale, and rewritten
    assert "(rewritten)" in capsys.readouterr().err
    assert plan.read_bytes() == encode_plan(recorded)
    assert cli(["check", str(plan)]) == 0


def test_hand_edits_are_refused(compiled, capsys) -> None:
    _, plan = compiled
    text = plan.read_text()
    # Same plan, different text: not what dctms writes.
    plan.write_text(text.replace('"schema_version": ', '"schema_version":  ', 1))
    assert cli(["check", str(plan)]) == 1
    err = capsys.readouterr().err
    assert "edited: not the canonical text dctms writes" in err and "line 2 differs" in err
    # A change the verifier cannot see and no figure shows (runtime_source is free text).
    recorded = dctms.read_plan(plan)
    env = msgspec.structs.replace(recorded.envelope, runtime_source="made up by hand")
    write_plan(msgspec.structs.replace(recorded, envelope=env), plan)
    result = dctms.check_plan(plan)
    assert result.verdict == "edited" and "every figure agrees" in result.reason


def test_an_edit_the_digest_catches_is_edited(compiled, capsys) -> None:
    _, plan = compiled
    text = plan.read_text()
    source = dctms.read_plan(plan).envelope.runtime_source
    assert source and source in text
    plan.write_text(text.replace(source, "made up by hand", 1))  # the digest is left as it was
    assert cli(["check", str(plan)]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{plan}: edited: the plan was changed after it was written")


def test_edited_figure_is_refused_by_validation(compiled, capsys) -> None:
    _, plan = compiled
    recorded = dctms.read_plan(plan)
    env = msgspec.structs.replace(recorded.envelope, total=recorded.envelope.total - 1)
    write_plan(msgspec.structs.replace(recorded, envelope=env), plan)
    assert cli(["check", str(plan)]) == 2
    assert "envelope" in capsys.readouterr().err


def test_sync_every_is_checked_exactly(tmp_path: Path, capsys) -> None:
    config = write_config(tmp_path / "m")
    plan = tmp_path / "s.plan"
    args = [str(config), "-N", "8", "-M", "4", "--sync-every", "1", "-q", "-o", str(plan)]
    assert cli(["compile", *args]) == 0
    assert cli(["check", str(plan)]) == 0
    # The same plan compiled without --sync-every has fewer sync points: a different plan (its
    # first difference may come earlier: fewer sync points let MLX donate more buffers).
    other = dctms.compile_plan(config, 8, 4)
    assert first_difference(dctms.read_plan(plan), other) is not None
    recorded = dctms.read_plan(plan).phases[0]
    assert len(recorded.sync_points) > len(other.phases[0].sync_points)


def test_bad_input_is_one_line_exit_2(tmp_path: Path, plan_file: Path, compiled, capsys) -> None:
    _, plan = compiled
    cases = [
        (["check", str(plan_file)], "records no compile request"),
        (["check", str(tmp_path / "missing.plan")], "no such file"),
        (["check", str(plan), "--model", str(plan)], "not a folder"),
        (["check", str(plan), "--config", str(tmp_path / "nope.json")], "no such file"),
    ]
    for argv, message in cases:
        assert cli(argv) == 2, argv
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and message in err, err


def test_hashed_weights_need_the_model_folder(tmp_path: Path, capsys) -> None:
    folder = write_tiny_model(tmp_path / "w", TINY_QWEN2, tokenizer=False)
    plan = tmp_path / "h.plan"
    argv = ["compile", str(folder), "-N", "8", "-M", "4", "--hash-weights", "-q", "-o", str(plan)]
    assert cli(argv) == 0
    assert cli(["check", str(plan)]) == 2
    assert "give --model DIR" in capsys.readouterr().err
    assert cli(["check", str(plan), "--model", str(folder)]) == 0
    (folder / "model.safetensors").write_bytes(
        (folder / "model.safetensors").read_bytes()[:-4] + b"\0\0\0\0"
    )  # same header, other weights
    assert cli(["check", str(plan), "--model", str(folder)]) == 1
    assert "model.weights.files_sha256" in capsys.readouterr().err
