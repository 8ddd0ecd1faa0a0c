"""The README's checked examples are what the tool prints today: every fenced block that follows
the marker ``<!-- output checked by tests/test_readme_examples.py -->`` holds ``$ dctms ...``
command lines, each followed by its exact output (standard output and standard error, as a
terminal shows them); this test runs each command from the repository root and compares."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- output checked by tests/test_readme_examples.py -->"
BLOCK = re.compile(re.escape(MARKER) + r"\s*```[a-z]*\n(.*?)```", re.S)


def examples() -> list[tuple[str, str]]:
    """(command line, expected output) for every command in a checked block."""
    out = []
    for block in BLOCK.findall((ROOT / "README.md").read_text()):
        for chunk in re.split(r"^\$ ", block, flags=re.M)[1:]:
            command, _, expected = chunk.partition("\n")
            out.append((command, expected))
    return out


def test_the_readme_has_checked_examples() -> None:
    assert len(examples()) >= 2  # a marker whose block lost its commands would check nothing


@pytest.mark.parametrize("command,expected", examples(), ids=lambda v: v[:60])
def test_readme_example_output_is_current(command: str, expected: str) -> None:
    argv = shlex.split(command)
    assert argv[0] == "dctms", command
    proc = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", *argv[1:]],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.stdout + proc.stderr == expected, f"README example is stale: {command}"
