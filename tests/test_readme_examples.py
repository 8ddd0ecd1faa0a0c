"""The command examples of the README and of the documentation site (every page under ``docs/``)
are what the tool prints today.

A fenced block that shows a command (a line starting ``$ ``) follows one of two markers:

- ``<!-- output checked by tests/test_readme_examples.py -->``: this test runs the block's commands
  in order, each through ``bash`` in one scratch folder (the repository's top-level entries linked
  into it, so ``plans/qwen7b.plan`` is there and ``-o my.plan`` writes nothing into the checkout;
  ``dctms`` and ``dctms-tui`` on ``PATH`` are this checkout's), and compares each command's output
  (standard output and standard error, as a terminal shows them) with the lines below it. A command
  line ending in ``\\`` goes on to the next line. A line ``...`` alone in an expected output stands
  for lines left out (a long output shown by its first and last lines): the lines around it must
  match, in order, with the first ones first and the last ones last. Files a block names that the
  repository does not hold (``tiny.plan``, ``broken.plan``, ``tiles500.csv``, ...) are made for it by
  ``tests/docs_fixtures.py``, and the page says what they are.
- The checked marker with measured figures, ``<!-- output checked by tests/test_readme_examples.py;
  measured: LABEL,... -->``: as above, but on every line whose first word is one of the labels
  (``all``: on every line) each number, with its unit of time, size or speed, is masked and runs of
  spaces are folded before comparing. A time or a speed differs from run to run (and its unit with
  its size: 310 ms, 1.2 s); its line's other words and its place in the output must not.
- ``<!-- output measured once, not re-run by tests -->``: an output that depends on this machine,
  a model outside the repository or a running server; the text above the block names when it was
  measured (a date) and where.

A page's generated reference (docs/reference) is checked by tests/test_docs.py instead."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from docs_fixtures import FIXTURES

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- output checked by tests/test_readme_examples.py"
CHECKED = re.compile(
    re.escape(MARKER) + r"(?:; measured: (?P<measured>[\w,:-]+))? -->\s*```[a-z]*\n(?P<body>.*?)```",
    re.S,
)
MEASURED = "<!-- output measured once, not re-run by tests -->"
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def commands(body: str) -> list[tuple[str, str]]:
    """(command, expected output) for every ``$ `` line of a block, continuation lines included."""
    out = []
    for chunk in re.split(r"^\$ ", body, flags=re.M)[1:]:
        lines = chunk.split("\n")
        n = 1
        while lines[n - 1].endswith("\\") and n < len(lines):
            n += 1
        out.append(("\n".join(lines[:n]), "\n".join(lines[n:])))
    return out


def blocks(page: Path) -> list[tuple[int, str, list[tuple[str, str]]]]:
    """(line, measured labels, commands) of every checked block of ``page``."""
    text = page.read_text()
    return [
        (text[: m.start()].count("\n") + 1, m["measured"] or "", commands(m["body"]))
        for m in CHECKED.finditer(text)
    ]


def test_the_readme_and_docs_have_checked_examples() -> None:
    # a marker whose block lost its commands would check nothing
    readme = [c for _, _, cs in blocks(ROOT / "README.md") for c in cs]
    assert len(readme) >= 3
    assert all(cs for page in PAGES for _, _, cs in blocks(page))


def test_a_marker_before_no_block_is_an_error() -> None:
    """Every marker is followed by a fenced block (a marker left alone checks nothing silently)."""
    for page in PAGES:
        text = page.read_text()
        assert text.count(MARKER) == len(CHECKED.findall(text)), page
        assert text.count(MEASURED) == len(re.findall(re.escape(MEASURED) + r"\s*```", text)), page


def unmarked_outputs(text: str) -> list[int]:
    """The lines of the blocks of ``text`` that show a command (``$ ``) under neither marker."""
    found = []
    for m in FENCE.finditer(text):
        if not re.search(r"^\$ ", m[1], re.M):
            continue
        before = text[: m.start()].rstrip()
        if not (before.endswith(MEASURED) or re.search(re.escape(MARKER) + r"[^>]*-->$", before)):
            found.append(text[: m.start()].count("\n") + 1)
    return found


def test_every_shown_command_output_is_checked_or_marked_measured() -> None:
    found = [
        f"{page.relative_to(ROOT)}:{line}"
        for page in PAGES
        if "reference" not in page.parts
        for line in unmarked_outputs(page.read_text())
    ]
    assert found == [], "a command's output shown neither checked nor marked measured"


def test_a_measured_output_says_when_it_was_measured() -> None:
    """The paragraph above a block marked measured names a date (YYYY-MM-DD)."""
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(re.escape(MEASURED), text):
            paragraph = text[: m.start()].rstrip().rsplit("\n\n", 1)[-1]
            assert DATE.search(paragraph), f"{page.relative_to(ROOT)}: a measured output undated"


def test_the_rules_reject_what_they_should() -> None:
    unmarked = "text\n\n```\n$ dctms show x.plan\nplan: ...\n```\n"
    assert unmarked_outputs(unmarked) == [3]
    assert unmarked_outputs(unmarked.replace("text\n", MEASURED)) == []
    assert unmarked_outputs(unmarked.replace("text\n", MARKER + " -->")) == []
    assert unmarked_outputs("```\ndctms show x.plan\n```\n") == []  # a command without output
    assert commands("$ a \\\n    b\nout\n$ c\n") == [("a \\\n    b", "out\n"), ("c", "")]


ELISION = "...\n"
# a number, with its unit where it has one of those a measured figure changes with its size
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?: ?(?:[mµu]?s|[KMG]iB|GB/s|GFLOP/s|tok/s)\b)?")


def masked(text: str, labels: str) -> str:
    """``text`` with every number masked (``#``) and spaces folded on the lines the labels name."""
    names = set(labels.split(",")) if labels else set()
    out = []
    for line in text.splitlines(keepends=True):
        words = line.split()
        if words and ("all" in names or words[0] in names):
            line = " ".join(NUMBER.sub("#", line).split()) + "\n"
        out.append(line)
    return "".join(out)


def matches(expected: str, actual: str, measured: str = "") -> bool:
    """``actual`` is ``expected``, where each line ``...`` stands for any run of whole lines (and
    the numbers of measured lines are masked in both)."""
    expected, actual = masked(expected, measured), masked(actual, measured)
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


def test_measured_lines_keep_their_words_and_units() -> None:
    actual = "arena   1,024 bytes\ntime    0.03 s (0.02 s CPU)\n"
    assert matches("arena   1,024 bytes\ntime    0.41 s (0.40 s CPU)\n", actual, "time")
    assert not matches("arena   2,048 bytes\ntime    0.03 s (0.02 s CPU)\n", actual, "time")
    assert matches("arena   1,024 bytes\ntime    310 ms (0.02 s CPU)\n", actual, "time")
    assert not matches("arena   1,024 bytes\ntime    0.03 s (0.02 s GPU)\n", actual, "time")
    assert matches("arena 9 bytes\ntime 1 s (2 s CPU)\n", actual, "all")
    assert not matches("arena 9 bytes\n", actual, "all")


# Blocks with a command that compiles (seconds to a minute each) run with the tests marked slow.
SLOW_COMMANDS = {"compile", "fit", "explain", "check"}


def _slow(cs: list[tuple[str, str]]) -> bool:
    return any(len(c.split()) > 1 and c.split()[1] in SLOW_COMMANDS for c, _ in cs)


EXAMPLES = [
    pytest.param(
        page, line, measured, cs,
        id=f"{page.relative_to(ROOT)}:{line}: {cs[0][0][:60]}",
        marks=[pytest.mark.slow] if _slow(cs) else [],
    )  # fmt: skip
    for page in PAGES
    for line, measured, cs in blocks(page)
]


def scratch(folder: Path, cs: list[tuple[str, str]]) -> dict[str, str]:
    """The folder the block runs in, and its environment (this checkout's dctms on PATH)."""
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv", "site") and not entry.name.startswith("."):
            (folder / entry.name).symlink_to(entry)
    text = "\n".join(c for c, _ in cs)
    for name, make in FIXTURES.items():
        if re.search(rf"(?<![\w./-]){re.escape(name)}(?![\w-])", text):
            make(folder)
    bin_dir = folder / ".bin"
    bin_dir.mkdir()
    for name, module in (("dctms", "dctms.cli.main"), ("dctms-tui", "dctms.tui.app")):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m {module} "$@"\n')
        script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "COLUMNS": "100"}


@pytest.mark.parametrize("page,line,measured,cs", EXAMPLES)
def test_example_output_is_current(tmp_path: Path, page: Path, line: int, measured: str, cs) -> None:
    env = scratch(tmp_path, cs)
    for command, expected in cs:
        proc = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        actual = proc.stdout + proc.stderr
        assert matches(expected, actual, measured), (
            f"{page.relative_to(ROOT)}:{line}: the example is stale: {command}\n"
            f"--- the page shows:\n{expected}--- the command printed:\n{actual}"
        )
