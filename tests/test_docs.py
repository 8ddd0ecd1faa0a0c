"""The documentation site: its generated reference pages are what the code says today, and it builds
with ``mkdocs build --strict`` (a broken link, a page outside the nav or a docstring mkdocstrings
cannot render fails the build)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_generated_reference_pages_are_current() -> None:
    proc = subprocess.run(
        [sys.executable, "scripts/gen_reference.py", "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_a_changed_generated_page_is_reported_stale(tmp_path: Path, monkeypatch) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_reference
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    monkeypatch.setattr(gen_reference, "REFERENCE", tmp_path)
    expected = gen_reference.pages()
    for rel, text in expected.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert gen_reference.stale(expected) == []
    (tmp_path / "cli" / "show.md").write_text(expected["cli/show.md"].replace("--json", "--jsn"))
    (tmp_path / "cli" / "gone.md").write_text(expected["cli/show.md"])
    assert gen_reference.stale(expected) == [
        "docs/reference/cli/show.md",
        "docs/reference/cli/gone.md (no longer generated)",
    ]


def test_every_subcommand_and_rule_has_its_reference_entry() -> None:
    from dctms.cli.main import COMMANDS
    from dctms.schema.verify import RULES

    for name in COMMANDS:
        page = (ROOT / "docs" / "reference" / "cli" / f"{name}.md").read_text()
        assert f"# `dctms {name}`" in page
    rules = (ROOT / "docs" / "reference" / "verifier-rules.md").read_text()
    for name in RULES:
        assert f"## `{name}`\n" in rules
    assert "*Broken by:* none." not in rules  # every rule has a breaking case in the tests


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    api = (tmp_path / "site" / "reference" / "python-api" / "index.html").read_text()
    names = ("read_plan", "write_plan", "compile_plan", "fit", "check_plan", "FitResult",
             "CheckResult", "DctmsError", "PlanError", "OverBudgetError")  # fmt: skip
    for name in names:
        assert f'id="dctms.{name}"' in api, f"the Python API page lost {name}'s docstring"


# Words a reader outside the project cannot follow: the project's issue numbers, its private notes.
INSIDER = re.compile(r"(?i:\bissues? #?\d+\b)|shared/|DESIGN\.md")


def test_docs_use_no_insider_references() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [
        f"{page.relative_to(ROOT)}:{n}: {m.group(0)}"
        for page in pages
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for m in INSIDER.finditer(line)
    ]
    assert found == []


def test_the_readme_is_a_five_minute_read_that_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move reference material to docs/"
    block = lines[lines.index("```") + 1 : lines.index("```") + 3]
    assert [line.split()[:2] for line in block] == [["make", "demo"], ["make", "test"]]


def test_every_docs_page_the_readme_links_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert links and all((ROOT / link).is_file() for link in links), links
