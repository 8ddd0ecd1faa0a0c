"""The Python API in ``dctms`` (dctms_pkg/__init__.py): stable names, typed, light to import."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_QWEN2

import dctms
from dctms.cli.main import main as cli
from dctms.schema.io import encode_plan

ROOT = Path(__file__).resolve().parents[1]
FUNCTIONS = ["read_plan", "write_plan", "compile_plan", "fit", "check_plan"]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "model/config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({**TINY_QWEN2, "max_position_embeddings": 4096}))
    return path


def test_public_names_exist_documented_and_typed() -> None:
    for name in dctms.__all__:
        assert getattr(dctms, name) is not None, name
    for name in FUNCTIONS:
        function = getattr(dctms, name)
        assert function.__doc__ and len(function.__doc__) > 40, name
        signature = inspect.signature(function)
        assert signature.return_annotation is not inspect.Signature.empty, name
        for parameter in signature.parameters.values():
            assert parameter.annotation is not inspect.Parameter.empty, (name, parameter.name)
    assert dctms.__doc__ and "dctms.read_plan" in dctms.__doc__
    assert issubclass(dctms.PlanError, dctms.DctmsError)


def test_compile_plan_takes_every_compile_option() -> None:
    # `dctms compile` passes each CompileOptions field as a keyword (device_memory as memory).
    from dataclasses import fields

    from dctms.toolkit.compiler import CompileOptions

    options = {f.name for f in fields(CompileOptions)} - {"device_memory"} | {"memory"}
    keywords = set(inspect.signature(dctms.compile_plan).parameters) - {"model", "progress"}
    assert keywords == options


def test_reading_a_plan_imports_no_mlx_and_no_compiler() -> None:
    code = (
        "import sys, dctms\n"
        "plan = dctms.read_plan(sys.argv[1])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('mlx', 'mlx_lm', 'numpy', 'textual', 'transformers') or m.startswith('dctms.toolkit'))\n"
        "print(plan.envelope.total, heavy)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "plans/qwen7b.plan")],
        capture_output=True,
        text=True,
        check=True,
    )
    total, heavy = proc.stdout.split(" ", 1)
    assert int(total) > 4 * 2**30 and heavy.strip() == "[]"


def test_read_plan_refuses_a_broken_plan(tmp_path: Path) -> None:
    path = tmp_path / "x.plan"
    path.write_text('{"schema_version": 3}')
    with pytest.raises(dctms.PlanError) as err:
        dctms.read_plan(path)
    assert err.value.problems and str(path) in str(err.value)


def test_compile_plan_is_what_the_cli_writes(config: Path, tmp_path: Path) -> None:
    plan = dctms.compile_plan(config, 32, 8, memory="1GiB", prefill_chunk=16)
    out = tmp_path / "cli.plan"
    argv = ["compile", str(config), "-N", "32", "-M", "8", "--memory", "1GiB"]
    assert cli([*argv, "--prefill-chunk", "16", "-q", "-o", str(out)]) == 0
    mine = tmp_path / "api.plan"
    dctms.write_plan(plan, mine)
    assert mine.read_bytes() == out.read_bytes()
    env = plan.envelope
    assert env.device == 2**30 and env.free == 2**30 - env.total
    assert encode_plan(dctms.read_plan(mine)) == encode_plan(plan)
    assert dctms.compile_plan(config.parent, 32, 8, memory=2**30, prefill_chunk=16) == plan


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory": "lots"}, "memory: not a size"),
        ({"memory": 0}, "memory must be at least 1 byte"),
        ({"memory": 1.5}, "memory must be a byte count"),
        ({"batch": 0}, "batch must be at least 1"),
    ],
)
def test_compile_plan_bad_options(config: Path, kwargs, message) -> None:
    with pytest.raises(dctms.DctmsError, match=message):
        dctms.compile_plan(config, 8, 4, **kwargs)


def test_fit_matches_the_cli(config: Path, capsys) -> None:
    budget = dctms.compile_plan(config, 100, 8).envelope.total  # N = 100 fits exactly
    result = dctms.fit(config, budget, output_tokens=8)
    assert result.searched == "input_tokens" and result.output_tokens == 8
    assert result.value == result.input_tokens and result.value >= 100
    assert result.plan is not None and result.plan.envelope.total <= budget
    assert result.plan.bounds.input_tokens == result.value
    assert result.totals[result.value] <= budget < result.totals[result.value + 1]
    assert result.compiles == len(result.totals) and not result.capped
    assert cli(["fit", str(config), "--memory", str(budget), "-M", "8", "-q", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["value"] == result.value

    m_result = dctms.fit(config, budget, input_tokens=16)
    assert m_result.searched == "output_tokens" and m_result.input_tokens == 16
    assert m_result.value is not None and m_result.value > 8


def test_fit_nothing_fits_and_bad_calls(config: Path) -> None:
    nothing = dctms.fit(config, "1KiB", output_tokens=8)
    assert nothing.value is None and nothing.plan is None
    assert list(nothing.totals) == [nothing.cap, 1]  # the cap first, then 1: even 1 is over
    with pytest.raises(dctms.DctmsError, match="exactly one of"):
        dctms.fit(config, "1GiB")
    with pytest.raises(dctms.DctmsError, match="exactly one of"):
        dctms.fit(config, "1GiB", input_tokens=4, output_tokens=4)
    with pytest.raises(dctms.DctmsError, match="at least 1"):
        dctms.fit(config, "1GiB", output_tokens=0)


def test_fit_takes_every_compile_option() -> None:
    # fit once copied compile's options and silently lacked some; the two keyword sets must match.
    import inspect

    compile_keys = set(inspect.signature(dctms.compile_plan).parameters)
    fit_keys = set(inspect.signature(dctms.fit).parameters)
    assert compile_keys - {"input_tokens", "output_tokens"} <= fit_keys
