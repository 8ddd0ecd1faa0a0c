"""Helpers of the hardening tests (issue 11): the issue's "tiny plan", CLI calls, plan edits.

"tiny plan" = ``dctms compile TINY -N 32 -M 16 --dtype float32`` of a random qwen2 folder with
vocab 384 (KV capacity 48).
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from conftest import TINY_QWEN2

TINY_CONFIG = {**TINY_QWEN2, "vocab_size": 384}
N, M = 32, 16


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def lines(self) -> list[str]:
        return self.err.splitlines()


def build_tiny(folder: Path) -> Path:
    """The tiny model folder with ``tiny.plan`` beside it; returns the plan's path."""
    from dctms.toolkit.tiny_model import write_tiny_model

    write_tiny_model(folder, TINY_CONFIG)
    plan = folder.parent / f"{folder.name}.plan"
    result = cli("compile", str(folder), "-N", str(N), "-M", str(M), "--dtype", "float32",
                 "-o", str(plan), "-q")  # fmt: skip
    assert result.code == 0, result.err
    return plan


def cli(*argv: str) -> Result:
    """``dctms ARGV`` in this process, stdout and stderr captured."""
    from dctms.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exit_:  # argparse
            code = exit_.code if isinstance(exit_.code, int) else 2
    return Result(code, out.getvalue(), err.getvalue())


def cli_subprocess(*argv: str, timeout: float = 120) -> Result:
    """``dctms ARGV`` in a fresh interpreter: a crash is a negative return code, not ours."""
    proc = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def assert_one_line_refusal(result: Result, command: str, *needles: str) -> str:
    assert result.code == 2, (result.code, result.out, result.err)
    assert "Traceback" not in result.err
    assert len(result.lines) == 1, result.err
    line = result.lines[0]
    assert line.startswith(f"dctms {command}: "), line
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def assert_invalid(result: Result, *needles: str) -> str:
    """``dctms validate``'s refusal: exit 2, one line per problem (PLAN: PATH: MESSAGE)."""
    assert result.code == 2, (result.code, result.out, result.err)
    assert "Traceback" not in result.err and result.out == ""
    for needle in needles:
        assert needle in result.err, (needle, result.err)
    return result.err


def edit_plan(source: Path, target: Path, edit: Callable[[dict], object]) -> Path:
    """A deliberate edit of a plan's JSON, written with its digest re-stamped (as someone who
    knows the format would), so that what is tested is the check behind the digest."""
    document = json.loads(source.read_text())
    edit(document)
    target.write_bytes(restamp(document))
    return target


def phase_named(document: dict, name: str) -> dict:
    """The phase called ``name`` in a plan's JSON (for an edit)."""
    return next(p for p in document["phases"] if p["name"] == name)


def restamp(document: dict) -> bytes:
    from dctms.schema.digest import stamp

    return stamp(document)
