"""Issue 11, findings 11-12: duplicate JSON keys, and a plan edited after compilation.

The digest (``dctms.schema.digest``) is the sha256 of the plan's canonical body; every reader
recomputes it. It catches an edit that did not re-stamp it; it is not a signature (``stamp``
re-stamps), which the last test pins down as the documented limit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hardening import assert_invalid, assert_one_line_refusal, build_tiny, cli, restamp

PLANS = Path(__file__).parent.parent / "plans"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("harden-integrity")
    return build_tiny(root / "tiny"), root / "tiny"


# ------------------------------------------------------------------- 11. duplicate keys


def test_a_duplicate_key_is_refused(tmp_path):
    text = (PLANS / "qwen7b.plan").read_text()
    real = json.loads(text)["envelope"]["total"]
    # "total": 1 first, the real value last: a JSON reader keeping the last sees a valid plan
    doubled = text.replace(f'"total": {real}', f'"total": 1,\n    "total": {real}', 1)
    assert doubled != text
    path = tmp_path / "dup.plan"
    path.write_text(doubled)
    err = assert_invalid(cli("validate", str(path)), "duplicate key 'total'")
    assert len(err.splitlines()) == 1


def test_reformatting_a_plan_is_no_change(tmp_path):
    """Key order and white space are not content: a re-indented plan still reads."""
    document = json.loads((PLANS / "qwen1.5b.plan").read_text())
    path = tmp_path / "pretty.plan"
    path.write_text(json.dumps(document, indent=4))
    result = cli("validate", str(path))
    assert result.code == 0, result.err


# ------------------------------------------------------------------- 12. edited after compile


def _first_add(document: dict) -> dict:
    decode = next(p for p in document["phases"] if p["name"] == "decode")
    return next(op for op in decode["ops"] if op["primitive"] == "Add")


def test_an_op_edited_after_compilation_is_refused_by_validate_and_run(tiny, tmp_path):
    plan, folder = tiny
    document = json.loads(plan.read_text())
    _first_add(document)["primitive"] = "Subtract"
    edited = tmp_path / "edited.plan"
    # written as a text editor would: the rest of the file untouched, the digest left as it was
    edited.write_text(
        plan.read_text().replace('"primitive":"Add"', '"primitive":"Subtract"', 1)
    )
    assert json.loads(edited.read_text())["digest"] == json.loads(plan.read_text())["digest"]
    assert_invalid(cli("validate", str(edited)), "changed after it was written")
    result = cli("run", str(edited), "--model", str(folder), "--tokens", "1,2,3")
    assert_one_line_refusal(result, "run", "changed after it was written")
    assert result.out == ""


def test_a_plan_without_a_digest_is_refused(tmp_path):
    document = json.loads((PLANS / "qwen1.5b.plan").read_text())
    del document["digest"]
    path = tmp_path / "nodigest.plan"
    path.write_text(json.dumps(document))
    assert_invalid(cli("validate", str(path)), "has no digest")
    assert_one_line_refusal(cli("show", str(path)), "show", "has no digest")


@pytest.mark.slow
def test_a_wrong_digest_is_refused_by_every_reader(tmp_path):
    document = json.loads((PLANS / "qwen1.5b.plan").read_text())
    document["digest"] = "0" * 64
    path = tmp_path / "wrong.plan"
    path.write_text(json.dumps(document))
    for argv in (["show", str(path)], ["trace", str(path), "-o", str(tmp_path / "t.json")],
                 ["diff", str(path), str(PLANS / "qwen1.5b.plan")]):  # fmt: skip
        assert_one_line_refusal(cli(*argv), argv[0], "changed after it was written")
    assert not (tmp_path / "t.json").exists()


def test_the_digest_is_a_checksum_not_a_signature(tiny, tmp_path):
    """The documented limit: whoever re-stamps an edit makes it pass the digest; the verifier and
    (for what it cannot re-derive) re-compiling against the model are what remain."""
    plan, _ = tiny
    document = json.loads(plan.read_text())
    _first_add(document)["primitive"] = "Subtract"
    path = tmp_path / "restamped.plan"
    path.write_bytes(restamp(document))
    assert cli("validate", str(path)).code == 0


def test_checked_in_plans_carry_their_digest():
    from dctms.schema.digest import body_sha256

    for name in ("qwen1.5b.plan", "qwen7b.plan"):
        document = json.loads((PLANS / name).read_text())
        assert document["digest"] == body_sha256(document)
