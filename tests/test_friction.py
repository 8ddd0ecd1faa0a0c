"""The friction a first user hits (issue 32, item 6): each fixed behaviour, tested as a user meets it.

``--version`` and the reports' ``dctms_version``; ``compile`` requires ``-o`` and says what it wrote;
over-budget bytes with separators; ``show`` of a model config; the API's ``OverBudgetError`` and
``check_plan``'s empty remedy on an up-to-date plan.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from conftest import TINY_QWEN2

import dctms
from dctms.cli.main import main as cli
from dctms.schema.io import decode_plan, read_plan


def dctms_cli(*argv: str) -> subprocess.CompletedProcess:
    """``dctms ARGV`` in a fresh process, stdout and stderr captured (neither is a terminal)."""
    return subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", *argv], capture_output=True, check=False
    )


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("friction") / "model" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY_QWEN2))
    return path


# ----------------------------------------------------------------------------------- version


def test_version_is_the_installed_one(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        cli(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"dctms {version('dctms')}\n"
    assert dctms.__version__ == version("dctms")


def test_run_report_records_the_version(tiny_plan) -> None:
    from dctms.runner.report import build_report
    from dctms.runner.session import Generation

    gen = Generation(tokens=[1, 2], ttft_s=0.01, token_latencies_s=[0.005])
    report = build_report(tiny_plan, gen, 10, 10, [], None)
    assert report["dctms_version"] == version("dctms")


class _System:
    """A stand-in system that generates ``max_tokens`` zeros at once."""

    def __init__(self, name: str):
        self.name = name

    def prepare(self) -> None:
        pass

    def generate(self, ids, max_tokens, stop):
        from dctms.benchmark.systems import Output

        return Output([0] * max_tokens, 0.001, [0.001] * (max_tokens - 1))


def test_bench_files_record_the_version(tmp_path: Path) -> None:
    from dctms.benchmark.execute import execute
    from dctms.benchmark.prompts import Prompt, PromptIds
    from dctms.benchmark.protocol import Settings
    from dctms.benchmark.systems import BASELINE, RUNNER

    prompts = [PromptIds(Prompt("P1", "one", "x"), [1, 2])]
    systems = [_System(BASELINE), _System(RUNNER)]
    settings = Settings(reps=1, max_tokens=2, warmup=0)
    execute(systems, prompts, settings, tmp_path, {}, resamples=10, figures=False)
    for name in ("calls.json", "summary.json"):
        assert json.loads((tmp_path / name).read_text())["dctms_version"] == version("dctms")


# ----------------------------------------------------------------------------------- compile -o


def test_compile_without_o_is_refused_before_any_work(config: Path) -> None:
    proc = dctms_cli("compile", str(config), "-N", "8", "-M", "4")
    assert proc.returncode == 2 and proc.stdout == b""
    assert proc.stderr.decode().splitlines() == [
        "dctms compile: give -o PLAN (the plan file to write; -o - writes it to stdout)"
    ]


def test_compile_to_stdout_says_so_on_stderr(config: Path) -> None:
    proc = dctms_cli("compile", str(config), "-N", "8", "-M", "4", "-o", "-")
    assert proc.returncode == 0, proc.stderr
    plan = decode_plan(proc.stdout)  # stdout holds the plan and nothing else
    total = plan.envelope.total
    (line,) = proc.stderr.decode().splitlines()  # stderr is not a terminal: the summary all the same
    assert line.startswith("wrote the plan to stdout: M_max ") and f"({total:,} B;" in line


def test_compile_to_a_file_names_it_and_quiet_says_nothing(config: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiny.plan"
    proc = dctms_cli("compile", str(config), "-N", "8", "-M", "4", "-o", str(out))
    assert proc.returncode == 0 and proc.stdout == b""
    total = read_plan(out).envelope.total
    assert re.fullmatch(rf"wrote {re.escape(str(out))}: M_max .* \({total:,} B; .*\)\n",
                        proc.stderr.decode())  # fmt: skip
    quiet = dctms_cli("compile", str(config), "-N", "8", "-M", "4", "-o", str(out), "-q")
    assert quiet.returncode == 0 and quiet.stderr == b""


def test_over_budget_prints_bytes_with_separators(config: Path, tmp_path: Path) -> None:
    out = tmp_path / "big.plan"
    proc = dctms_cli("compile", str(config), "-N", "8", "-M", "4", "-o", str(out), "-q",
                     "--memory", "1MiB")  # fmt: skip
    assert proc.returncode == 1
    env = read_plan(out).envelope  # written all the same
    assert env.free is not None and env.free < 0 and -env.free > 999_999
    (line,) = proc.stderr.decode().splitlines()
    assert f"({env.total:,} B)" in line and "(1,048,576 B) budget" in line
    assert line.endswith(f"short by {dctms_human(-env.free)} ({-env.free:,} B)")
    assert str(-env.free) not in line  # never the bare digits


def dctms_human(n: int) -> str:
    from dctms.figures.units import human

    return human(n)


# ----------------------------------------------------------------------------------- show config


def test_show_of_a_model_config_says_how_to_compile_it(config: Path) -> None:
    for path in (config, config.parent):
        proc = dctms_cli("show", str(path))
        assert proc.returncode == 2 and proc.stdout == b""
        (line,) = proc.stderr.decode().splitlines()
        assert "model_type 'qwen2'), not a plan" in line
        assert f"dctms compile {path} -N 2048 -M 256 -o model.plan" in line


def test_show_of_other_json_is_still_the_plan_error(tmp_path: Path) -> None:
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hidden_size": 8}))  # no model_type: not recognisably a config
    proc = dctms_cli("show", str(other))
    assert proc.returncode == 2 and "not a plan" not in proc.stderr.decode()


# ----------------------------------------------------------------------------------- API


def test_compile_plan_over_budget_raises_with_the_shortfall(config: Path) -> None:
    with pytest.raises(dctms.OverBudgetError) as err:
        dctms.compile_plan(config, 8, 4, memory="1MiB")
    assert isinstance(err.value, dctms.DctmsError) and err.value.exit_code == 1
    env = err.value.plan.envelope
    assert env.device == 2**20 and env.free < 0
    assert f"short by {dctms_human(-env.free)} ({-env.free:,} B)" in str(err.value)
    # and what fits is returned, as before
    assert dctms.compile_plan(config, 8, 4, memory=env.total).envelope.free == 0


def test_check_plan_of_an_up_to_date_plan_has_no_remedy(config: Path, tmp_path: Path) -> None:
    path = tmp_path / "fresh.plan"
    dctms.write_plan(dctms.compile_plan(config, 8, 4), path)
    result = dctms.check_plan(path)
    assert result.ok and result.remedy == ""
    grown = tmp_path / "grown" / "config.json"
    grown.parent.mkdir()
    grown.write_text(json.dumps({**TINY_QWEN2, "num_hidden_layers": 3}))
    stale = dctms.check_plan(path, grown)
    assert stale.verdict == "stale" and stale.remedy.startswith("dctms compile ")


# ----------------------------------------------------------------------------------- config mismatch


def test_config_differences_name_each_key() -> None:
    from dctms.schema.fingerprint import config_differences

    plan_cfg = {"model_type": "qwen2", "num_hidden_layers": 2, "a": 1, "b": 1, "c": 1}
    given = {"model_type": "llama", "num_hidden_layers": 4, "a": 1, "b": 2, "d": [1]}
    assert config_differences(given, plan_cfg, most=9) == (
        "b 2 vs 1, c absent vs 1, d [1] vs absent, model_type 'llama' vs 'qwen2', "
        "num_hidden_layers 4 vs 2"
    )
    assert config_differences(given, plan_cfg, most=2) == "b 2 vs 1, c absent vs 1 (+3 more)"
    assert config_differences(plan_cfg, dict(reversed(plan_cfg.items()))) == ""


def test_run_with_another_config_names_what_differs(tmp_path: Path) -> None:
    from dctms.toolkit.tiny_model import write_tiny_model

    folder = tmp_path / "m"
    write_tiny_model(folder, TINY_QWEN2)
    plan = tmp_path / "m.plan"
    dctms.write_plan(dctms.compile_plan(folder, 8, 4), plan)
    changed = {**TINY_QWEN2, "model_type": "llama", "rms_norm_eps": 1e-5}
    (folder / "config.json").write_text(json.dumps(changed))
    proc = dctms_cli("run", str(plan), "--model", str(folder), "--tokens", "1")
    assert proc.returncode == 2
    (line,) = proc.stderr.decode().splitlines()
    assert line.endswith(
        "differs from the config the plan was compiled for (this folder's vs the plan's: "
        "model_type 'llama' vs 'qwen2', rms_norm_eps 1e-05 vs 1e-06)"
    )


# ----------------------------------------------------------------------------------- demo


def test_demo_leaves_an_unchanged_plan_alone(tmp_path: Path, tiny_plan) -> None:
    import os

    import msgspec

    from dctms.cli.commands.demo import keep_or_write_plan
    from dctms.schema.io import encode_plan

    path = tmp_path / "demo.plan"
    assert keep_or_write_plan(tiny_plan, path)
    os.utime(path, ns=(10**18, 10**18))  # an old mtime: any rewrite would change it
    assert not keep_or_write_plan(tiny_plan, path)
    assert path.stat().st_mtime_ns == 10**18
    other = msgspec.structs.replace(
        tiny_plan, bounds=msgspec.structs.replace(tiny_plan.bounds, output_tokens=7)
    )
    assert keep_or_write_plan(other, path)
    assert path.read_bytes() == encode_plan(other) and path.stat().st_mtime_ns != 10**18


@pytest.mark.slow
def test_a_second_demo_keeps_the_cached_plan(tmp_path: Path) -> None:
    folder = tmp_path / "demo"
    argv = ("demo", "--dir", str(folder), "-N", "64", "-M", "4")
    first = dctms_cli(*argv)
    assert first.returncode == 0, first.stderr
    assert f"plan written to {folder / 'demo.plan'}" in first.stdout.decode()
    before = (folder / "demo.plan").stat().st_mtime_ns
    second = dctms_cli(*argv)
    assert second.returncode == 0, second.stderr
    assert f"plan unchanged in {folder / 'demo.plan'}" in second.stdout.decode()
    assert (folder / "demo.plan").stat().st_mtime_ns == before


# ----------------------------------------------------------------------------------- dctms-tui


@pytest.mark.parametrize(
    ("argv", "needle"),
    [([], "the following arguments are required: PLAN"),
     (["a", "b", "c"], "give one PLAN, or OLD NEW to compare two plans"),
     (["--screen", "nope", "x"], "argument --screen: invalid choice: 'nope'")],
)  # fmt: skip
def test_tui_usage_errors_are_one_line(argv: list[str], needle: str, capsys) -> None:
    from dctms.tui.app import main as tui

    with pytest.raises(SystemExit) as done:
        tui(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dctms-tui: {needle}") and err.endswith("(see dctms-tui --help)\n")
    assert err.count("\n") == 1 and "usage:" not in err


# ----------------------------------------------------------------------------------- explain

PLANS = Path(__file__).resolve().parent.parent / "plans"


def test_explain_headline_names_where_most_of_the_peak_lives() -> None:
    from dctms.figures.explain import peak_sentence, phase_peak, subtree_bytes, where_it_lives

    plan = read_plan(PLANS / "qwen7b.plan")
    prefill = next(p for p in plan.phases if p.name == "prefill")
    pk = phase_peak(plan, prefill)
    path, held, parts = where_it_lives(pk)
    under = subtree_bytes(pk.modules)
    # the deepest module holding more than half of the peak: none of its children does
    assert held == under[path] and 2 * held > pk.bytes
    children = [k for k in under if k.startswith(path + ".") and "." not in k[len(path) + 1 :]]
    assert children and all(2 * under[k] <= pk.bytes for k in children)
    assert sum(b for _, b in parts) == held
    # here a layer, which the first module at the peak (its attention) holds less than half of
    top = pk.modules[0].module
    assert top.startswith(path + ".") and 2 * pk.modules[0].bytes < pk.bytes
    sentence = peak_sentence(pk)
    assert f"{100 * held / pk.bytes:.1f} % in {path} (" in sentence
    assert f"largest module {top}: " in sentence


def test_explain_headline_without_a_majority_lists_the_largest() -> None:
    from dctms.figures.explain import ModuleShare, PhasePeak, peak_sentence

    shares = [ModuleShare("lm_head", 30, 1, ()), ModuleShare("model.norm", 40, 1, ()),
              ModuleShare("(step)", 30, 2, ())]  # fmt: skip
    pk = PhasePeak("decode", 3, 9, 100, 100, sorted(shares, key=lambda s: -s.bytes), [])
    assert "across model 40.0 %, (step) 30.0 %, lm_head 30.0 %;" in peak_sentence(pk)


# ----------------------------------------------------------------------------------- roofline


def test_predictions_default_to_the_blas_dctms_runs_with() -> None:
    from dctms.figures.roofline import CPU_OPENBLAS, plan_roofline, prediction_profile
    from dctms.toolkit.profiles import PROFILES

    plan = read_plan(PLANS / "qwen7b.plan")
    own = plan.target.profile
    assert own.name == "cpu-x86-2core" and "reference" not in own.name  # the plan is unchanged
    assert prediction_profile(plan) is CPU_OPENBLAS and PROFILES[CPU_OPENBLAS.name] is CPU_OPENBLAS
    assert "OpenBLAS" in CPU_OPENBLAS.peak_flops_source and CPU_OPENBLAS.peak_flops > own.peak_flops
    default, scheduled = plan_roofline(plan), plan_roofline(plan, own)
    assert default.profile is CPU_OPENBLAS
    assert default.ttft_s < scheduled.ttft_s / 5  # not the reference BLAS's thousands of seconds
    # a profile with no such substitute is its own prediction profile (e.g. a GPU plan's)
    gpu = msgspec_replace_target(plan, backend="gpu", profile=PROFILES["apple-m4-16gb"])
    assert prediction_profile(gpu) is gpu.target.profile


def msgspec_replace_target(plan, **fields):
    import msgspec

    return msgspec.structs.replace(plan, target=msgspec.structs.replace(plan.target, **fields))


def test_every_predicted_time_names_its_profile(tmp_path: Path) -> None:
    plan = str(PLANS / "qwen1.5b.plan")
    roofline = dctms_cli("roofline", plan).stdout.decode()
    assert "on profile cpu-x86-2core-openblas" in roofline
    diff = dctms_cli("diff", plan, str(PLANS / "qwen7b.plan")).stdout.decode()
    assert "predicted at the roofline (cpu-x86-2core-openblas)" in diff
