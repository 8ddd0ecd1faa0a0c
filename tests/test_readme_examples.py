"""The checked examples of the README and of the documentation site (every page under ``docs/``) are
what the tool prints today: every fenced block that follows the marker
``<!-- output checked by tests/test_readme_examples.py -->`` holds ``$ dctms ...`` command lines,
each followed by its exact output (standard output and standard error, as a terminal shows them);
this test runs each command from the repository root and compares. A line ``...`` alone in an
expected output stands for lines left out (a long output shown by its first and last lines): the
lines around it must match, in order, with the first ones first and the last ones last. A page's
generated reference (docs/reference) is checked by tests/test_docs.py instead."""

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


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def page_examples(page: Path) -> list[tuple[str, str]]:
    """(command line, expected output) for every command in a checked block of ``page``."""
    out = []
    for block in BLOCK.findall(page.read_text()):
        for chunk in re.split(r"^\$ ", block, flags=re.M)[1:]:
            command, _, expected = chunk.partition("\n")
            out.append((command, expected))
    return out


def examples() -> list[tuple[str, str, str]]:
    """(page, command line, expected output) over the README and every docs page."""
    return [
        (page.relative_to(ROOT).as_posix(), command, expected)
        for page in PAGES
        for command, expected in page_examples(page)
    ]


def test_the_readme_and_docs_have_checked_examples() -> None:
    # a marker whose block lost its commands would check nothing
    assert len(page_examples(ROOT / "README.md")) >= 2
    assert len(examples()) > len(page_examples(ROOT / "README.md"))


def test_a_marker_before_no_block_is_an_error() -> None:
    """Every marker is followed by a fenced block (a marker left alone checks nothing silently)."""
    for page in PAGES:
        text = page.read_text()
        assert text.count(MARKER) == len(BLOCK.findall(text)), page


ELISION = "...\n"


def matches(expected: str, actual: str) -> bool:
    """``actual`` is ``expected``, where each line ``...`` stands for any run of whole lines."""
    pieces = re.split(r"^\.\.\.\n", expected, flags=re.M)
    pattern = r"(?:.*\n)?".join(re.escape(piece) for piece in pieces)
    return re.fullmatch(pattern, actual, flags=re.S) is not None


def test_an_elision_stands_for_whole_lines_only() -> None:
    actual = "first\nsecond\nthird\nlast\n"
    assert matches(actual, actual)
    assert matches("first\n...\nlast\n", actual)
    assert matches("first\nsecond\n...\n", actual)
    assert not matches("first\n...\nthird\n", actual)  # the last shown line must be the last
    assert not matches("second\n...\nlast\n", actual)  # the first shown line must be the first
    assert not matches("first\n...\nast\n", actual)  # never part of a line
    assert not matches("first\nlast\n", actual)  # without the marker, nothing is left out


# Examples of commands that compile (seconds to a minute each) run with the tests marked slow.
SLOW_COMMANDS = {"compile", "fit", "explain", "check"}
EXAMPLES = [
    pytest.param(
        page, command, expected,
        id=f"{page}: {command[:60]}",
        marks=[pytest.mark.slow] if shlex.split(command)[1] in SLOW_COMMANDS else [],
    )  # fmt: skip
    for page, command, expected in examples()
]


@pytest.mark.parametrize("page,command,expected", EXAMPLES)
def test_readme_example_output_is_current(page: str, command: str, expected: str) -> None:
    argv = shlex.split(command)
    assert argv[0] == "dctms", command
    proc = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", *argv[1:]],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert matches(expected, proc.stdout + proc.stderr), f"{page}: example is stale: {command}"
