"""The optimised BLAS: when to preload it, the re-execution that does it, and what is reported.

The re-execution is tested on real child processes started *without* the preload (the test process
itself already runs with it, see conftest): same pid after the exec, stdin still readable, the exit
status passed through, no second exec, the switch that turns it off, and ``dctms run`` reporting the
BLAS that really ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import TINY_QWEN2

from dctms.runner import blas
from dctms.schema.errors import DctmsError

REF = ["/site/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0"]
OPEN = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
needs_openblas = pytest.mark.skipif(
    not (os.path.isfile(blas.openblas_path()) and blas.bundled_reference_blas()),
    reason="needs MLX's bundled reference BLAS and Debian's libopenblas0-pthread",
)


def decide(environ: dict, system: str = "Linux", ref=REF, exists: bool = True) -> str | None:
    return blas.preload_decision(environ, system, ref, OPEN, exists)


# ------------------------------------------------------------------------- the decision (pure)


def test_preloads_openblas_when_mlx_carries_the_reference_blas():
    assert decide({}) == OPEN
    assert decide({"DCTMS_BLAS": "auto"}) == OPEN


def test_keeps_other_preloaded_libraries_and_adds_openblas():
    assert decide({"LD_PRELOAD": "/lib/libjemalloc.so.2"}) == f"/lib/libjemalloc.so.2:{OPEN}"


@pytest.mark.parametrize(
    "environ, system, ref, exists",
    [
        ({"DCTMS_BLAS": "off"}, "Linux", REF, True),  # the switch
        ({"DCTMS_BLAS": " OFF "}, "Linux", REF, True),
        ({"DCTMS_BLAS_REEXEC": "1"}, "Linux", REF, True),  # already re-executed once: no loop
        ({}, "Darwin", REF, True),  # Accelerate on macOS
        ({}, "Linux", [], True),  # MLX without the reference BLAS
        ({}, "Linux", REF, False),  # OpenBLAS not installed
        ({"LD_PRELOAD": OPEN}, "Linux", REF, True),  # already preloaded
        ({"LD_PRELOAD": "/opt/mkl/libmkl_rt_blas.so"}, "Linux", REF, True),  # the user's BLAS
    ],
)
def test_no_preload(environ, system, ref, exists):
    assert decide(environ, system, ref, exists) is None


def test_an_unknown_switch_value_is_refused():
    with pytest.raises(DctmsError, match="DCTMS_BLAS='fast' is not understood"):
        decide({"DCTMS_BLAS": "fast"})


def test_mapped_libraries_and_classification():
    maps = textwrap.dedent(
        f"""\
        7f00-7f01 r--p 00000000 08:01 12 {REF[0]}
        7f01-7f02 r-xp 00001000 08:01 12 {REF[0]}
        7f02-7f03 r--p 00000000 08:01 13 {OPEN}
        7f03-7f04 rw-p 00000000 00:00 0
        7f04-7f05 r--p 00000000 00:00 0 [heap]
        """
    )
    assert blas.mapped_libraries(maps) == [REF[0], OPEN]
    assert blas.classify(REF[0]) == "reference"
    assert blas.classify(OPEN) == "openblas"
    assert blas.classify("/usr/lib/libfoo.so") == "other"


# --------------------------------------------------------------------- this process (conftest)


@needs_openblas
def test_the_test_process_runs_on_openblas():
    import mlx.core  # noqa: F401  (maps MLX's own BLAS too)

    if os.environ.get("DCTMS_BLAS", "auto") == "off":
        pytest.skip("DCTMS_BLAS=off")
    info = blas.loaded_blas()
    assert info.kind == "openblas", info
    assert "OpenBLAS" in info.describe() and info.library.endswith("libblas.so.3")


# --------------------------------------------------------------------- real re-executions


def clean_env(**extra: str) -> dict:
    """This environment without the preload and the re-exec mark (as a user's shell has it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.REEXEC_MARK)}
    env.update(extra)
    return env


PROBE = textwrap.dedent(
    """\
    import os, sys
    from dctms.runner import blas
    print(os.getpid(), os.environ.get("LD_PRELOAD", "-"), flush=True)
    blas.reexec_with_fast_blas()
    print("stdin:", sys.stdin.read().strip(), flush=True)
    sys.exit(int(sys.argv[1]))
    """
)


@needs_openblas
def test_reexec_keeps_pid_stdin_and_exit_status_and_happens_once(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    proc = subprocess.run(
        [sys.executable, str(probe), "7"],
        input="hello", capture_output=True, text=True, env=clean_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 7, proc.stderr
    first, second, rest = proc.stdout.splitlines()
    pid1, preload1 = first.split()
    pid2, preload2 = second.split()
    assert pid1 == pid2  # replaced in place: a signal sent to the pid reaches the new program
    assert preload1 == "-" and preload2 == blas.openblas_path()
    assert rest == "stdin: hello"  # exactly one exec: two banners, then the program ran on


@needs_openblas
def test_switch_off_means_no_reexec(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    proc = subprocess.run(
        [sys.executable, str(probe), "0"],
        input="x", capture_output=True, text=True, env=clean_env(DCTMS_BLAS="off"), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[1:] == ["stdin: x"]


def dctms(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", *args],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip


def test_refusal_through_the_reexec_is_one_line_and_exit_2(tmp_path):
    proc = dctms("run", str(tmp_path / "none.plan"), "--model", str(tmp_path), "--tokens", "1",
                 env=clean_env())  # fmt: skip
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr


def test_a_bad_switch_value_is_one_line_and_exit_2(tmp_path):
    proc = dctms("compile", str(tmp_path / "x.json"), env=clean_env(DCTMS_BLAS="fast"))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [proc.stderr.strip()]
    assert "DCTMS_BLAS='fast' is not understood" in proc.stderr


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, Path]:
    from dctms.schema.io import write_plan
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions, compile_plan
    from dctms.toolkit.tiny_model import write_tiny_model

    folder = tmp_path_factory.mktemp("blas-model")
    write_tiny_model(folder, dict(TINY_QWEN2))
    plan = folder / "model.plan"
    write_plan(compile_plan(open_model(folder), CompileOptions(16, 4, prefill_chunk=8)), plan)
    return plan, folder


@needs_openblas
@pytest.mark.parametrize("switch, kind", [("auto", "openblas"), ("off", "reference")])
def test_dctms_run_reports_the_blas_that_ran(tiny_run, tmp_path, switch, kind):
    plan, folder = tiny_run
    report = tmp_path / "r.json"
    proc = dctms("run", str(plan), "--model", str(folder), "--tokens", "1,2,3", "--ignore-eos",
                 "--report", str(report), env=clean_env(DCTMS_BLAS=switch))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(report.read_text())["blas"]["kind"] == kind
    line = next(x for x in proc.stderr.splitlines() if x.startswith("BLAS: "))
    assert ("OpenBLAS" in line) == (kind == "openblas")
