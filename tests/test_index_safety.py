"""Issue 35's memory-safety reproductions: re-stamped plan edits that used to validate and then
crash ``dctms run`` (SIGSEGV for an index out of its array, exit 70 for a shape MLX refuses at a
length point). Each is refused by ``dctms validate`` (rule ``index_safety``) and by ``dctms run``
in one line, before anything runs (in a subprocess: a missing check would be a crash of that
process, not of the tests)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import TINY_QWEN2
from hardening import (
    assert_invalid,
    assert_one_line_refusal,
    cli,
    cli_subprocess,
    edit_plan,
    phase_named,
)

TOKENS = ["--tokens", "1,2,3,4,5,6,7,8,9,10,11", "--max-tokens", "3"]


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    from dctms.toolkit.tiny_model import write_tiny_model

    root = tmp_path_factory.mktemp("index-safety")
    target = write_tiny_model(root / "target", {**TINY_QWEN2, "num_hidden_layers": 1})
    draft = write_tiny_model(root / "draft", {**TINY_QWEN2, "num_hidden_layers": 1}, seed=2)
    # M 48: decode runs at several window points (the slope cases change only the others)
    bounds = ["-N", "16", "-M", "48", "--prefill-chunk", "8", "--pack-seconds", "0", "-q"]
    out = {"model": target, "draft": draft}
    for name, extra in (("text", []), ("spec", ["--draft", str(draft), "--num-draft", "2"])):
        out[name] = root / f"{name}.plan"
        assert cli("compile", str(target), *bounds, *extra, "-o", str(out[name])).code == 0
    return out


def _op(phase: dict, primitive: str) -> int:
    return next(k for k, op in enumerate(phase["ops"]) if op["primitive"] == primitive)


def _constant_index(phase_name: str, primitive: str, value: int, dtype: str = "int32"):
    """The first ``primitive`` of the phase reads its index (a Gather's, or a DynamicSlice's
    start) from a new constant of the same shape, every entry ``value``."""

    def edit(doc: dict) -> None:
        phase = phase_named(doc, phase_name)
        op = phase["ops"][_op(phase, primitive)]
        slot = len(op["inputs"]) - 1 if primitive.startswith("Dynamic") else 1
        records = [*phase["inputs"], *phase["tensors"], *phase["constants"]]
        shape = next(r["shape"] for r in records if r["id"] == op["inputs"][slot])
        count = math.prod(shape)
        phase["constants"].append(
            {"id": "edited", "shape": shape, "dtype": dtype, "value": [value] * count}
        )
        op["inputs"][slot] = "edited"

    return edit


def _slope_minus_one(phase_name: str, primitive: str, path: str):
    """The first affine place ``o<k>/<path>`` on a ``primitive`` of the phase follows a function of
    slope -1 that still holds the plan's value at the bound (so only the other points differ)."""

    def edit(doc: dict) -> None:
        phase = phase_named(doc, phase_name)
        rec = phase["lengths"]
        for f in rec["affine"]:
            for place in f["at"]:
                k, _, at = place[1:].partition("/")
                if (
                    place[0] == "o"
                    and at == path
                    and phase["ops"][int(k)]["primitive"] == primitive
                ):
                    d = next(i for i, a in enumerate(f["k"]) if a)
                    value = sum(a * b for a, b in zip(f["k"], rec["bound"], strict=True)) + f["c"]
                    f["at"].remove(place)
                    slope = [0] * len(f["k"])
                    slope[d] = -1
                    rec["affine"].append({"k": slope, "c": value + rec["bound"][d], "at": [place]})
                    rec["affine"] = [g for g in rec["affine"] if g["at"]]
                    return
        raise AssertionError(f"no {primitive} place {path} in {phase_name}")

    return edit


CASES = {
    "prefill DynamicSlice start 2^31-1": ("text", _constant_index("prefill", "DynamicSlice", 2**31 - 1)),
    "prefill DynamicSlice start -2^31": ("text", _constant_index("prefill", "DynamicSlice", -(2**31))),
    "decode token Gather index 2^32-1": (
        "text", _constant_index("decode", "Gather", 2**32 - 1, "uint32")
    ),
    "verify token Gather index 2^32-1": (
        "spec", _constant_index("verify", "Gather", 2**32 - 1, "uint32")
    ),
    "decode KV Slice stop, slope -1": ("text", _slope_minus_one("decode", "Slice", "1.2")),
    "decode Arange stop, slope -1": ("text", _slope_minus_one("decode", "Arange", "1")),
    "prefill DynamicSlice size, slope -1": (
        "text", _slope_minus_one("prefill", "DynamicSlice", "1.1")
    ),
    "prefill mask Arange stop, slope -1": ("text", _slope_minus_one("prefill", "Arange", "1")),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_edit_is_refused_by_validate_and_run(plans, tmp_path, case) -> None:
    kind, edit = CASES[case]
    edited = edit_plan(plans[kind], tmp_path / "edited.plan", edit)
    value = case.rpartition(" ")[2]
    needle = {"2^31-1": "ranges over [2147483647", "-2^31": "ranges over [-2147483648",
              "2^32-1": "ranges over [4294967295"}.get(value, "at lengths point [")  # fmt: skip
    err = assert_invalid(cli("validate", str(edited)), needle)
    assert all(line.startswith(str(edited)) for line in err.splitlines())
    extra = ["--draft-model", str(plans["draft"])] if kind == "spec" else []
    result = cli_subprocess("run", str(edited), "--model", str(plans["model"]), *TOKENS, *extra)
    assert_one_line_refusal(result, "run")


def test_the_unedited_plans_run(plans) -> None:
    """The plans the edits start from are valid and run (so each refusal is the edit's)."""
    for kind in ("text", "spec"):
        assert cli("validate", str(plans[kind])).code == 0
        extra = ["--draft-model", str(plans["draft"])] if kind == "spec" else []
        result = cli_subprocess("run", str(plans[kind]), "--model", str(plans["model"]), *TOKENS,
                                *extra)  # fmt: skip
        assert result.code == 0, result.err


def test_a_runtime_index_is_bounded_by_what_the_runner_feeds(plans) -> None:
    """The starts the runner feeds (last_index, position) are bounded by the rule's runtime
    ranges: the prefill DynamicSlice reads ``last_index`` and the plan proves it in range."""
    doc = json.loads(plans["text"].read_text())
    prefill = phase_named(doc, "prefill")
    op = prefill["ops"][_op(prefill, "DynamicSlice")]
    names = {b["id"]: b["name"] for b in prefill["inputs"]}
    reshaped = {
        o["outputs"][0]: o["inputs"][0] for o in prefill["ops"] if o["primitive"] == "Reshape"
    }
    assert names.get(reshaped.get(op["inputs"][1], op["inputs"][1])) == "last_index"


def test_a_generated_id_past_the_vocabulary_is_refused(plans, tmp_path) -> None:
    """The runner feeds ``next_token`` back as the next call's token ids, unchecked on the host:
    the argmax it comes from must range below ``model.vocab_size`` (257 logits here)."""

    def edit(doc: dict) -> None:
        doc["model"]["vocab_size"] = 200

    edited = edit_plan(plans["text"], tmp_path / "edited.plan", edit)
    assert_invalid(cli("validate", str(edited)), "ranges over [0, 256], outside [0, 199]")


def test_value_ranges_of_sorts_counts_and_clamps() -> None:
    """The ranges that prove a sampling plan's gathers: an argsort's ids lie along its axis, an
    integer sum of n values in [a, b] lies in [n a, n b], and a clamp of an unknown unsigned value
    by a known one is bounded by it (and by its dtype's zero); an unknown signed one is not
    bounded below by the clamp."""
    from dctms.schema.abstract_eval import _dtype_range, _reduced_range, _value_range

    assert _reduced_range([2, [1]], (1, 257), (0, 1)) == (0, 257)  # a count of booleans
    assert _reduced_range([2, [0, 1]], (2, 3), (-1, 4)) == (-6, 24)
    assert _reduced_range([5, [1]], (1, 9), (3, 7)) == (3, 7)
    assert _dtype_range("uint32") == (0, 2**32 - 1) and _dtype_range("float32") is None
    assert _value_range("Minimum", [], [None, (256, 256)], "uint32") == (0, 256)
    assert _value_range("Minimum", [], [None, (256, 256)], "int32") == (-(2**31), 256)
    assert _value_range("Minimum", [], [None, (256, 256)], "float32") is None


def test_reading_a_plan_for_its_figures_leaves_index_safety_to_validate_and_run(plans, tmp_path):
    """``read_plan`` (show, diff, pool, the TUI) skips the run-only rules, seconds on a 7B plan;
    ``read_plan(for_run=True)``, which ``dctms validate`` and the runner's ``load_checked_plan``
    use, refuses the edit (so a plan that passes validate was proven, and one that runs was)."""
    from dctms.runner.load import load_checked_plan
    from dctms.schema.errors import PlanError
    from dctms.schema.io import read_plan
    from dctms.schema.verify import RULES, RUN_ONLY

    assert RUN_ONLY == {"index_safety"} and RUN_ONLY <= set(RULES)
    edit = CASES["decode KV Slice stop, slope -1"][1]
    edited = edit_plan(plans["text"], tmp_path / "edited.plan", edit)
    assert read_plan(edited).envelope.total > 0
    for read in (lambda p: read_plan(p, for_run=True), load_checked_plan):
        with pytest.raises(PlanError) as err:
            read(edited)
        assert {p.rule for p in err.value.problems} == {"index_safety"}
