"""``dctms diff``: numbers taken from the two checked-in plans, exit codes 0/1/2, all three formats."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from dctms.cli import main as cli
from dctms.schema.io import read_plan, write_plan
from dctms.views.diff import (
    Threshold,
    diff_data,
    diff_markdown,
    diff_text,
    parse_threshold,
    verdict,
)

ROOT = Path(__file__).resolve().parents[1]
OLD = ROOT / "plans" / "qwen1.5b.plan"
NEW = ROOT / "plans" / "qwen7b.plan"
COMPONENTS = ("weights", "kv", "persistent", "intermediate", "runtime", "total")


@pytest.fixture(scope="module")
def plans():
    return read_plan(OLD), read_plan(NEW)


@pytest.fixture(scope="module")
def markdown(plans) -> str:
    return diff_markdown(diff_data(*plans, str(OLD), str(NEW)))


@pytest.fixture
def tiny_pair(tmp_path, tiny_plan) -> tuple[Path, Path]:
    """The hand-built tiny plan (M_max 1,664 B) and a copy whose runtime allowance is 1,000 B
    larger: reading them is instant, unlike the verified 2 MB plans (about 1 s each)."""
    env = tiny_plan.envelope
    bigger = msgspec.structs.replace(
        tiny_plan,
        envelope=msgspec.structs.replace(
            env, runtime=env.runtime + 1000, total=env.total + 1000, free=env.free - 1000
        ),
    )
    old, new = tmp_path / "old.plan", tmp_path / "new.plan"
    write_plan(tiny_plan, old)
    write_plan(bigger, new)
    return old, new


def diff(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["diff", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def table(markdown: str, first_header: str) -> dict[str, list[str]]:
    """The markdown table whose first header cell is ``first_header``, as {first cell: cells}."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("*")] = cells[1:]
    return rows


def number(cell: str) -> int:
    return int(cell.replace(",", "").replace("+", ""))


@pytest.mark.slow
def test_markdown_command_end_to_end(capsys, markdown):
    code, out, err = diff(capsys, "--format", "markdown", str(OLD), str(NEW))
    assert code == 0 and err == ""
    assert out == markdown


def test_markdown_envelope_table_has_the_plans_numbers(plans, markdown):
    old, new = plans
    out = markdown
    assert out.startswith(f"### dctms plan diff: `{OLD}` → `{NEW}`\n")
    rows = table(out, "memory envelope")
    for name in COMPONENTS:
        a, b = getattr(old.envelope, name), getattr(new.envelope, name)
        cells = rows["total = M_max" if name == "total" else name]
        assert [number(c) for c in cells[:3]] == [a, b, b - a] if b != a else [a, b, 0]
        if b != a:
            assert cells[3] == f"{(b - a) / 2**20:+,.2f}"
            assert cells[4] == f"{100 * (b - a) / a:+.2f} %"
    # The weights delta is the difference of the two envelopes' weights: 4,284,263,424 - 868,547,584.
    assert (
        number(rows["weights"][2]) == new.envelope.weights - old.envelope.weights == 3_415_715_840
    )
    assert out.rstrip().splitlines()[-1] == "✅ **PASS: no threshold or budget given**"


def test_markdown_stats_and_fingerprint(plans, markdown):
    old, new = plans
    out = markdown
    stats = table(out, "Table 1 and arena")
    assert [number(c) for c in stats["logical_tensors"][:3]] == [
        old.stats.logical_tensors,
        new.stats.logical_tensors,
        new.stats.logical_tensors - old.stats.logical_tensors,
    ]
    assert stats["reduction"][:2] == [f"{old.stats.reduction:.2%}", f"{new.stats.reduction:.2%}"]
    for phase_old, phase_new in zip(old.phases, new.phases, strict=True):
        cells = stats[f"arena {phase_old.name}"]
        assert [number(c) for c in cells[:2]] == [phase_old.arena_bytes, phase_new.arena_bytes]
    model = table(out, "model fingerprint")
    assert model["weights_count"] == [
        f"`{old.model.weights.count}`",
        f"`{new.model.weights.count}`",
    ]
    assert model["config_sha256"] == [
        f"`{old.model.config_sha256[:12]}`",
        f"`{new.model.config_sha256[:12]}`",
    ]
    assert "weights_layout_sha256" in model
    assert "architecture" not in model  # both qwen2: listed as unchanged instead
    assert "Unchanged model fingerprint: architecture, num_layers" in out
    assert "No change in bounds and target (input_tokens, output_tokens" in out


def test_json_has_the_same_numbers(plans):
    old, new = plans
    data = json.loads(json.dumps(diff_data(*plans, budget=16 * 2**30)))
    env = {r["name"]: r for r in data["envelope"]}
    for name in COMPONENTS:
        a, b = getattr(old.envelope, name), getattr(new.envelope, name)
        assert (env[name]["old"], env[name]["new"], env[name]["delta"]) == (a, b, b - a)
    model = {r["name"]: r for r in data["model"]}
    assert model["weights_total_bytes"]["old"] == old.model.weights.total_bytes
    assert model["weights_layout_sha256"]["new"] == new.model.weights.layout_sha256
    assert model["quantization"] == {
        "name": "quantization",
        "old": "4-bit, group 64, affine",
        "new": "4-bit, group 64, affine",
        "changed": False,
    }
    v = data["verdict"]
    assert v["ok"] and v["budget"] == 16 * 2**30 and v["m_max_new"] == new.envelope.total


@pytest.mark.parametrize(
    "limits, ok",
    [
        ([], True),
        (["2%"], False),
        (["350%"], True),  # M_max grew by 313.69 %
        (["3GiB"], False),  # it grew by 3.46 GiB
        (["4GiB"], True),
        (["350%", "1GiB"], False),
    ],
)
def test_thresholds_on_the_real_plans(plans, limits, ok):
    old, new = plans
    v = verdict(old.envelope.total, new.envelope.total, tuple(map(parse_threshold, limits)), None)
    assert v["ok"] is ok
    assert len(v["failures"]) == (0 if ok else 1)


def test_budget_on_the_real_plans(plans):
    old, new = plans
    assert verdict(old.envelope.total, new.envelope.total, (), 5 * 2**30)["ok"]
    v = verdict(old.envelope.total, new.envelope.total, (parse_threshold("2%"),), 4 * 2**30)
    # 1,182,701,368 -> 4,892,715,256 bytes, worked out from the plans' own totals
    grown = new.envelope.total - old.envelope.total
    over = new.envelope.total - 4 * 2**30
    assert v["failures"] == [
        f"M_max grew by +{grown / 2**30:.2f} GiB (+{100 * grown / old.envelope.total:.2f} %), "
        "above --fail-above 2%",
        f"M_max {new.envelope.total / 2**30:.2f} GiB exceeds the 4.00 GiB budget by "
        f"{over / 2**20:.2f} MiB ({over:,} bytes)",
    ]
    text = diff_markdown(diff_data(*plans, thresholds=(parse_threshold("2%"),), budget=4 * 2**30))
    assert text.rstrip().splitlines()[-1] == "❌ **FAIL: " + "; ".join(v["failures"]) + "**"


@pytest.mark.parametrize(
    "limits, code",
    [
        ([], 0),
        (["--fail-above", "60%"], 1),  # 1,664 -> 2,664 bytes: +60.10 %
        (["--fail-above", "60.1%"], 0),
        (["--fail-above", "61%", "--fail-above", "999B"], 1),  # any crossed limit fails
        (["--fail-above", "1000B"], 0),  # exactly the growth: not above it
        (["--fail-above", "999"], 1),
        (["--budget", "2664"], 0),
        (["--budget", "2663"], 1),
    ],
)
def test_exit_codes(capsys, tiny_pair, limits, code):
    old, new = tiny_pair
    got, out, err = diff(capsys, *limits, str(old), str(new))
    assert got == code
    assert out.rstrip().splitlines()[-1].startswith("PASS" if code == 0 else "FAIL")
    if code:
        assert err and all(line.startswith("dctms diff: ") for line in err.splitlines())
    else:
        assert err == ""


def test_failure_lines_on_stderr(capsys, tiny_pair):
    old, new = tiny_pair
    code, out, err = diff(
        capsys, "--format", "json", "--fail-above", "50%", "--budget", "2KiB", str(old), str(new)
    )
    assert code == 1
    assert err.splitlines() == [
        "dctms diff: M_max grew by +1000 B (+60.10 %), above --fail-above 50%",
        "dctms diff: M_max 2.60 KiB exceeds the 2.00 KiB budget by 616 B (616 bytes)",
    ]
    assert json.loads(out)["verdict"]["failures"] == [line[12:] for line in err.splitlines()]


def test_shrinking_and_identical_plans_pass(capsys, tiny_pair):
    old, new = tiny_pair
    assert diff(capsys, "--fail-above", "0%", str(new), str(old))[0] == 0
    code, out, _ = diff(capsys, "--fail-above", "0%", "--fail-above", "1B", str(new), str(new))
    assert code == 0
    assert "(0 B, 0.00 %)" in out


def test_text_marks_changes(plans):
    out = diff_text(diff_data(*plans))
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert lines["config_sha256"].endswith("*")
    assert not lines["architecture"].endswith("*")
    assert "+3,415,715,840" in lines["weights"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fail-above", "5x"], "--fail-above '5x'"),
        (["--fail-above", "abc%"], "--fail-above 'abc%'"),
        (["--budget", "lots"], "--budget: not a size"),
    ],
)
def test_bad_limits_exit_2(capsys, argv, message):
    code, out, err = diff(capsys, *argv, str(OLD), str(NEW))  # refused before reading the plans
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1


def test_bad_plans_exit_2_in_a_fresh_process(tmp_path):
    broken = tmp_path / "broken.plan"
    broken.write_text(NEW.read_text()[:1000])
    for old, new in ((tmp_path / "missing.plan", broken), (broken, broken)):
        proc = subprocess.run(
            [sys.executable, "-m", "dctms.cli.main", "diff", str(old), str(new)],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("dctms diff: ")


def test_thresholds_and_verdict():
    assert parse_threshold("2%") == Threshold("2%", percent=2.0)
    assert parse_threshold("64MiB") == Threshold("64MiB", bytes=64 * 2**20)
    assert verdict(100, 102, (parse_threshold("2%"),), None)["ok"]
    assert not verdict(100, 103, (parse_threshold("2%"),), None)["ok"]
    assert not verdict(0, 1, (parse_threshold("50%"),), None)["ok"]  # any growth from nothing
    v = verdict(100, 200, (), 150)
    assert not v["ok"] and v["failures"] == [
        "M_max 200 B exceeds the 150 B budget by 50 B (50 bytes)"
    ]


def test_labels_name_the_plans(capsys, tiny_pair):
    old, new = tiny_pair
    code, out, _ = diff(
        capsys,
        "--format",
        "markdown",
        "--old-label",
        "main:plans/tiny.plan",
        "--new-label",
        "plans/tiny.plan (this PR)",
        str(old),
        str(new),
    )
    assert code == 0
    assert out.splitlines()[0] == (
        "### dctms plan diff: `main:plans/tiny.plan` → `plans/tiny.plan (this PR)`"
    )
    assert out.splitlines()[2] == "**M_max 1,664 → 2,664 bytes (+1000 B, +60.10 %)**"


# ----------------------------------------------------------------- predicted speed (roofline)


def test_roofline_rows_are_each_plans_prediction(plans, markdown):
    from dctms.figures.roofline import plan_roofline

    old, new = plans
    rows = {r["name"]: r for r in diff_data(*plans)["roofline"]["rows"]}
    prompt = min(old.bounds.input_tokens, new.bounds.input_tokens)
    a, b = plan_roofline(old, prompt_tokens=prompt), plan_roofline(new, prompt_tokens=prompt)
    speed = rows["decode_tokens_per_s"]
    assert (speed["old"], speed["new"]) == (a.decode_tokens_per_s, b.decode_tokens_per_s)
    assert speed["delta"] == pytest.approx(b.decode_tokens_per_s - a.decode_tokens_per_s)
    assert rows["ttft_s"]["old"] == a.ttft_s and rows["ttft_s"]["new"] == b.ttft_s
    assert rows["ttft_s"]["label"] == f"TTFT s, {prompt:,}-token prompt"
    # CPU plans scheduled on the reference-BLAS profile are predicted on OpenBLAS, and say so
    assert "| predicted at the roofline (cpu-x86-2core-openblas) | old | new | Δ | Δ % |" in markdown
    assert "| decode tok/s |" in markdown


def test_a_twice_as_fast_target_doubles_the_predicted_speed(tiny_plan):
    p = tiny_plan.target.profile
    fast = msgspec.structs.replace(
        p,
        name="fast",
        peak_flops=2 * p.peak_flops,
        bandwidth_bytes_per_s=2 * p.bandwidth_bytes_per_s,
    )
    new = msgspec.structs.replace(
        tiny_plan, target=msgspec.structs.replace(tiny_plan.target, profile=fast)
    )
    data = diff_data(tiny_plan, new)
    rows = {r["name"]: r for r in data["roofline"]["rows"]}
    assert rows["decode_tokens_per_s"]["delta_percent"] == pytest.approx(100.0)
    assert rows["decode_ms_per_token"]["delta_percent"] == pytest.approx(-50.0)
    assert data["roofline"]["profiles"] == {"old": p.name, "new": "fast"}
    out = diff_text(data)
    assert f"predicted at the roofline ({p.name} -> fast)" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("decode tok/s"))
    assert line.rstrip().endswith("+100.00 %")
