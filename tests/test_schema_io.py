"""Canonical plan I/O: deterministic layout, non-finite floats, versions, errors, atomic writes."""

from __future__ import annotations

import difflib
import math
import os
import re
import stat

import msgspec
import pytest
from msgspec.structs import replace

from dctms.schema import io
from dctms.schema.errors import DctmsError, PlanError
from dctms.schema.io import (
    decode_plan,
    encode_plan,
    read_plan,
    write_plan,
)
from dctms.schema.types import SCHEMA_VERSION, Plan, Weights
from dctms.schema.values import from_json_value, to_json_value

# -------------------------------------------------------------------------------------- canonical text


def test_same_plan_same_bytes(tiny_plan: Plan) -> None:
    first = encode_plan(tiny_plan)
    assert first == encode_plan(tiny_plan)
    assert encode_plan(decode_plan(first)) == first
    assert first.endswith(b"}\n") and b"\r" not in first and not first.endswith(b"\n\n")


def test_layout_one_record_per_line(tiny_plan: Plan) -> None:
    lines = encode_plan(tiny_plan).decode().splitlines()
    assert lines[:2] == ["{", f'  "schema_version": {SCHEMA_VERSION},']
    phase = tiny_plan.phases[0]
    assert sum('"primitive":' in line for line in lines) == len(phase.ops)
    assert sum('"interval":' in line for line in lines) == len(phase.tensors)
    assert "        [1,3]," in lines  # one slot per line, compact
    assert (
        '        {"primitive":"Multiply","inputs":["t1","c_half"],"outputs":["t2"],'
        '"memory_bound":true},' in lines
    )
    assert all(not line.endswith(" ") for line in lines)


def test_small_change_small_diff(tiny_plan: Plan) -> None:
    tensors = list(tiny_plan.phases[0].tensors)
    tensors[2] = replace(tensors[2], offset=128)
    changed = replace(tiny_plan, phases=[replace(tiny_plan.phases[0], tensors=tensors)])
    before = encode_plan(tiny_plan).decode().splitlines()
    after = encode_plan(changed).decode().splitlines()
    diff = [d for d in difflib.unified_diff(before, after, n=0, lineterm="") if d[:1] in "+-"]
    # ---/+++ headers, one line out, one line in; and the digest line (schema.digest)
    assert len(diff) == 6
    assert '"offset":128' in diff[3] and diff[-1].startswith('+  "digest": ')


def test_defaults_omitted_and_plain_dict_keys_sorted(tiny_plan: Plan) -> None:
    text = encode_plan(tiny_plan).decode()
    assert '"view_of"' in text and '"view_of":null' not in text
    # Op.scratch is written only where it is not 0 (op 3); Target.run_ahead_dispatches is 0 here.
    assert text.count('"scratch":') == 1 and '"args":[[1]],"scratch":8}' in text
    assert '"run_ahead_dispatches"' not in text and '"evaluate":[]' not in text
    assert '"provable"' not in text  # a property computed from the envelope, not a field
    files = {"z.safetensors": "a" * 64, "a.safetensors": "b" * 64}
    weights = replace(tiny_plan.model.weights, files_sha256=files)
    plan = replace(tiny_plan, model=replace(tiny_plan.model, weights=weights))
    text = encode_plan(plan).decode()
    assert text.index('"a.safetensors"') < text.index('"z.safetensors"')
    assert isinstance(weights, Weights)


def test_no_absolute_paths_or_timestamps(tiny_plan: Plan) -> None:
    text = encode_plan(tiny_plan).decode()
    assert os.getcwd() not in text and "/tmp" not in text
    assert not re.search(r"\d{4}-\d\d-\d\d|timestamp|created", text)


# ------------------------------------------------------------------------------------ non-finite floats


def test_json_value_helpers_round_trip() -> None:
    value = [1.0, math.inf, [-math.inf, {"k": math.nan}], "x", 3, None, True]
    encoded = to_json_value(value)
    assert encoded == [1.0, "inf", ["-inf", {"k": "nan"}], "x", 3, None, True]
    back = from_json_value(encoded)
    assert back[1] == math.inf and back[2][0] == -math.inf and math.isnan(back[2][1]["k"])
    assert back[3:] == ["x", 3, None, True]
    assert msgspec.json.decode(msgspec.json.encode(encoded)) == encoded


def test_non_finite_constants_and_args_round_trip(tiny_plan: Plan) -> None:
    phase = tiny_plan.phases[0]
    ops = list(phase.ops)
    ops[4] = replace(ops[4], args=[math.nan, [math.inf, -math.inf], 2.5])
    plan = replace(tiny_plan, phases=[replace(phase, ops=ops)])
    data = encode_plan(plan)
    assert b'"value":["-inf"]' in data and b'"args":["nan",["inf","-inf"],2.5]' in data
    back = decode_plan(data)
    assert back.phases[0].constants[1].value == [-math.inf]
    args = back.phases[0].ops[4].args
    assert math.isnan(args[0]) and args[1] == [math.inf, -math.inf] and args[2] == 2.5
    assert encode_plan(back) == data


def test_non_finite_float_elsewhere_cannot_be_written(tiny_plan: Plan) -> None:
    profile = replace(tiny_plan.target.profile, peak_flops=math.inf)
    plan = replace(tiny_plan, target=replace(tiny_plan.target, profile=profile))
    with pytest.raises(PlanError) as err:
        encode_plan(plan)
    assert err.value.problems[0].path == "$.target.profile.peak_flops"


# --------------------------------------------------------------------------------------------- versions


def _with(data: bytes, **top) -> bytes:
    document = msgspec.json.decode(data)
    document.update(top)
    return msgspec.json.encode(document)


def test_newer_schema_version_one_line(tiny_plan_bytes: bytes) -> None:
    # A newer plan also has fields we do not know: the version message must win.
    data = _with(tiny_plan_bytes, schema_version=SCHEMA_VERSION + 2, new_field=1)
    with pytest.raises(PlanError) as err:
        decode_plan(data, "new.plan")
    assert len(err.value.problems) == 1
    assert str(err.value) == (
        f"new.plan: plan schema_version {SCHEMA_VERSION + 2} is newer than this dctms understands "
        f"({SCHEMA_VERSION}); upgrade dctms (pip install -U dctms) or recompile the plan with this version"
    )


@pytest.mark.parametrize("version", [0, -1])
def test_unknown_old_schema_version(tiny_plan_bytes: bytes, version: int) -> None:
    with pytest.raises(PlanError) as err:
        decode_plan(_with(tiny_plan_bytes, schema_version=version))
    assert err.value.problems[0].rule == "schema_version"
    assert f"schema_version {version} is not a dctms plan version" in str(err.value)


def test_older_schema_version_says_how_to_recompile(tiny_plan_bytes: bytes) -> None:
    # A version-1 document: tensors carry no "kind" tag and scratch names its op only in its id.
    def as_v1(document: dict) -> None:
        document["schema_version"] = 1
        for t in document["phases"][0]["tensors"]:
            t.pop("op", None)
            if t["kind"] == "intermediate":
                del t["kind"]

    with pytest.raises(PlanError) as err:
        decode_plan(_mutated(tiny_plan_bytes, as_v1), "old.plan")
    assert len(err.value.problems) == 1
    assert str(err.value) == (
        f"old.plan: plan schema_version 1 is older than this dctms ({SCHEMA_VERSION}): "
        "recompile it with `dctms compile`"
    )


def test_a_v2_plan_with_op_indices_is_refused_in_one_line(tiny_plan_bytes: bytes) -> None:
    # Schema 2 wrote each op's position as "index"; 3 dropped it. The version wins over the field.
    def as_v2(document: dict) -> None:
        document["schema_version"] = 2
        for phase in document["phases"]:
            phase["ops"] = [{"index": i, **op} for i, op in enumerate(phase["ops"])]

    with pytest.raises(PlanError) as err:
        decode_plan(_mutated(tiny_plan_bytes, as_v2), "v2.plan")
    assert len(err.value.problems) == 1
    assert str(err.value) == (
        f"v2.plan: plan schema_version 2 is older than this dctms ({SCHEMA_VERSION}): "
        "recompile it with `dctms compile`"
    )


def test_a_v3_plan_is_refused_in_one_line(tiny_plan_bytes: bytes) -> None:
    # Schema 4 added Weights.fused; a version 3 plan predates it (and the compiler's rewrites).
    def as_v3(document: dict) -> None:
        document["schema_version"] = 3

    with pytest.raises(PlanError) as err:
        decode_plan(_mutated(tiny_plan_bytes, as_v3), "v3.plan")
    assert str(err.value) == (
        f"v3.plan: plan schema_version 3 is older than this dctms ({SCHEMA_VERSION}): "
        "recompile it with `dctms compile`"
    )


@pytest.mark.parametrize("version", ["1", 1.5, True, None])
def test_non_integer_schema_version_is_a_schema_error(tiny_plan_bytes: bytes, version) -> None:
    with pytest.raises(PlanError) as err:
        decode_plan(_with(tiny_plan_bytes, schema_version=version))
    assert [p.path for p in err.value.problems] == ["$.schema_version"]


# ------------------------------------------------------------------------------------------- decoding


def test_decode_returns_the_plan(tiny_plan: Plan, tiny_plan_bytes: bytes) -> None:
    assert encode_plan(decode_plan(tiny_plan_bytes)) == encode_plan(tiny_plan)


def test_the_same_bytes_are_verified_once(tiny_plan_bytes: bytes, monkeypatch) -> None:
    """Bytes that passed every check are not verified again in this process (the run-only rules
    once more when first asked for); bytes that failed are checked every time."""
    calls: list[bool] = []
    real = io.verify_plan

    def counting(plan, *, for_run=True):
        calls.append(for_run)
        return real(plan, for_run=for_run)

    monkeypatch.setattr(io, "verify_plan", counting)
    monkeypatch.setattr(io, "_VERIFIED", type(io._VERIFIED)())
    data = tiny_plan_bytes + b" "  # bytes no other test has verified in this process
    decode_plan(data)
    decode_plan(data)
    assert calls == [False]
    decode_plan(data, for_run=True)
    decode_plan(data, for_run=True)
    decode_plan(data)
    assert calls == [False, True]
    broken = _mutated(tiny_plan_bytes, lambda d: d["bounds"].update(batch=0))
    for _ in range(2):
        with pytest.raises(PlanError):
            decode_plan(broken)
    assert len(calls) == 4


def _mutated(data: bytes, edit) -> bytes:
    document = msgspec.json.decode(data)
    edit(document)
    return msgspec.json.encode(document)


def _problems(data: bytes) -> list[tuple[str, str, str]]:
    with pytest.raises(PlanError) as err:
        decode_plan(data)
    return [(p.path, p.message, p.rule) for p in err.value.problems]


def test_all_schema_errors_are_collected(tiny_plan_bytes: bytes) -> None:
    def edit(d):
        d["phases"][0]["tensors"][3]["interval"] = "late"
        d["bounds"]["batch"] = -1
        del d["envelope"]["kv"]
        d["stats"]["colour"] = "red"
        d["phases"][0]["tensors"][0]["offset"] = 10**30

    assert _problems(_mutated(tiny_plan_bytes, edit)) == [
        ("$.bounds.batch", "must be >= 0, got -1", "schema"),
        ("$.envelope.kv", "missing required field", "schema"),
        ("$.phases[0].tensors[0].offset", "must be <= 9007199254740992, got 1.000e+30", "schema"),
        ("$.phases[0].tensors[3].interval", 'expected array, got "late"', "schema"),
        ("$.stats.colour", "unknown field (not in the plan schema)", "schema"),
    ]


def test_optional_field_messages(tiny_plan_bytes: bytes) -> None:
    def edit(d):
        d["phases"][0]["tensors"][0]["buffer"] = "zero"
        d["phases"][0]["tensors"][2]["buffer"] = -3

    assert _problems(_mutated(tiny_plan_bytes, edit)) == [
        ("$.phases[0].tensors[0].buffer", 'expected integer or null, got "zero"', "schema"),
        ("$.phases[0].tensors[2].buffer", "must be >= 0, got -3", "schema"),
    ]


def test_integral_float_for_an_integer_is_refused(tiny_plan_bytes: bytes) -> None:
    # JSON Schema calls 16.0 an integer; msgspec does not. The plan is refused with msgspec's path.
    data = tiny_plan_bytes.replace(b'"bytes":16,"interval":[0,2]', b'"bytes":16.0,"interval":[0,2]')
    assert _problems(data) == [
        ("$.phases[0].tensors[0].bytes", "expected `int`, got `float`", "schema")
    ]


def test_semantic_problems_come_from_the_verifier(tiny_plan_bytes: bytes) -> None:
    data = tiny_plan_bytes.replace(b'[4,4],"buffer":1,"offset":64}', b'[4,4],"buffer":1,"offset":0}')
    # out (tensors[6]) moved onto t3's bytes while both are live in slot 4.
    assert _problems(data) == [
        (
            "$.phases[0].tensors[6]",
            "bytes [0, 4) overlap tensor 't3' [0, 16) while both are live (slots 4..4)",
            "arena_overlap",
        )
    ]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty input (no JSON document)"),
        (b"  \n", "empty input (no JSON document)"),
        (b"\xff\xfe\x00garbage", "not valid JSON: JSON is malformed: invalid character (byte 0)"),
        (b'{"schema_version": 1,', "not valid JSON: Input data was truncated"),
        (b"[" * 100_000, "nested too deeply"),
        (b"1e400", "not valid JSON: Number out of range"),
    ],
)
def test_undecodable_input(data: bytes, message: str) -> None:
    assert _problems(data) == [("$", message, "json")]


@pytest.mark.parametrize("data", [b"[1, 2]", b'"plan"', b"null", b"3"])
def test_not_an_object(data: bytes) -> None:
    assert _problems(data) == [("$", "expected a JSON object (a dctms plan)", "schema")]


# -------------------------------------------------------------------------------------------- files


def test_write_then_read(tmp_path, tiny_plan: Plan) -> None:
    path = tmp_path / "p.plan"
    write_plan(tiny_plan, path)
    assert path.read_bytes() == encode_plan(tiny_plan)
    assert encode_plan(read_plan(path)) == encode_plan(tiny_plan)
    assert os.listdir(tmp_path) == ["p.plan"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_overwrite_keeps_mode(tmp_path, tiny_plan: Plan) -> None:
    path = tmp_path / "p.plan"
    path.write_text("old")
    path.chmod(0o640)
    write_plan(tiny_plan, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert path.read_bytes() == encode_plan(tiny_plan)


@pytest.mark.parametrize("failing", ["replace", "fsync"])
def test_failed_write_leaves_old_file_and_no_temp(
    tmp_path, tiny_plan: Plan, monkeypatch, failing
) -> None:
    path = tmp_path / "p.plan"
    path.write_bytes(b"old contents")

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(io.os, failing, boom)
    with pytest.raises(DctmsError, match="cannot write .*p.plan: No space left on device"):
        write_plan(tiny_plan, path)
    assert path.read_bytes() == b"old contents"
    assert os.listdir(tmp_path) == ["p.plan"]


def test_interrupted_write_removes_temp(tmp_path, tiny_plan: Plan, monkeypatch) -> None:
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(io.os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        write_plan(tiny_plan, tmp_path / "p.plan")
    assert os.listdir(tmp_path) == []


def test_write_into_missing_directory(tmp_path, tiny_plan: Plan) -> None:
    with pytest.raises(DctmsError, match="cannot write .*p.plan: folder .*nope does not exist"):
        write_plan(tiny_plan, tmp_path / "nope" / "p.plan")


def _read_error(path) -> str:
    with pytest.raises(PlanError) as err:
        read_plan(path)
    text = str(err.value)
    assert "\n" not in text
    return text


def test_read_errors_name_the_file(tmp_path, monkeypatch) -> None:
    assert _read_error(tmp_path / "missing.plan") == f"{tmp_path / 'missing.plan'}: no such file"
    assert _read_error(tmp_path) == f"{tmp_path}: is a directory, not a plan file"
    empty = tmp_path / "empty.plan"
    empty.write_bytes(b"")
    assert _read_error(empty) == f"{empty}: file is empty"
    blank = tmp_path / "blank.plan"
    blank.write_bytes(b" \n\t")
    assert _read_error(blank) == f"{blank}: file contains only whitespace"
    fifo = tmp_path / "fifo.plan"
    os.mkfifo(fifo)
    assert _read_error(fifo) == f"{fifo}: is not a regular file"
    big = tmp_path / "big.plan"
    big.write_bytes(b"{}" * 10)
    monkeypatch.setattr(io, "MAX_PLAN_FILE_BYTES", 8)
    assert _read_error(big) == f"{big}: file is too large for a plan (20 bytes)"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file(plan_file) -> None:
    plan_file.chmod(0)
    assert _read_error(plan_file) == f"{plan_file}: permission denied"


def test_plan_error_lists_every_problem(tiny_plan_bytes: bytes) -> None:
    data = _mutated(tiny_plan_bytes, lambda d: d["bounds"].update(batch="1", dtype=3))
    with pytest.raises(PlanError) as err:
        decode_plan(data, "x.plan")
    assert str(err.value) == 'x.plan: $.bounds.batch: expected integer, got "1" (+1 more)'
    assert len(err.value.problems) == 2


def test_permission_denied_is_one_line(plan_file, monkeypatch) -> None:
    # The same path as test_unreadable_file, reachable when the tests run as root.
    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(io.Path, "read_bytes", denied)
    assert _read_error(plan_file) == f"{plan_file}: permission denied"
