"""The installable distribution: every package and data file is in the wheel, and the wheel works.

pyproject.toml maps each room (schema/, toolkit/, cli/, ...) to a ``dctms.*`` package and lists the
packages by hand; a folder with an ``__init__.py`` missing from that list is silently left out of a
regular install (an editable one still finds it). The quick test compares the list with the folders;
the slow one builds the wheel, installs it into a new virtual environment outside the source tree
(dependencies from the package index) and runs the commands there.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from conftest import TINY_QWEN2

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def discovered_packages() -> dict[str, Path]:
    """Every package the source tree holds: each folder with an __init__.py under a mapped root."""
    found: dict[str, Path] = {}
    for name, folder in SETUPTOOLS["package-dir"].items():
        root = ROOT / folder
        for init in sorted(root.rglob("__init__.py")):
            rel = init.parent.relative_to(root)
            if "__pycache__" in rel.parts:
                continue
            found[".".join([name, *rel.parts])] = init.parent
    return found


def data_files() -> dict[str, list[str]]:
    """Non-Python files inside the package folders, by package (what package-data must carry)."""
    out: dict[str, list[str]] = {}
    for package, folder in discovered_packages().items():
        names = sorted(
            p.name
            for p in folder.iterdir()
            if p.is_file() and p.suffix not in (".py", ".pyc") and not p.name.startswith(".")
        )
        if names:
            out[package] = names
    return out


def test_pyproject_lists_every_package() -> None:
    listed = set(SETUPTOOLS["packages"])
    found = set(discovered_packages())
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - found == set(), "pyproject.toml lists packages that have no __init__.py"


def test_package_data_covers_every_data_file() -> None:
    globs = SETUPTOOLS.get("package-data", {})
    assert data_files(), "the schema JSON and the stylesheet at least"
    for package, names in data_files().items():
        for name in names:
            assert any(fnmatch.fnmatch(name, g) for g in globs.get(package, [])), (
                f"{package}: {name} is not in [tool.setuptools.package-data]"
            )


def test_extras_are_named_for_what_they_add() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {"plot", "serve", "test", "cpu", "cuda"} <= set(extras)
    # the MLX backend is an extra (cpu and cuda clash), the tests install the CPU one
    deps = PYPROJECT["project"]["dependencies"]
    assert not any("mlx[" in d for d in deps)
    assert extras["cpu"][0].startswith("mlx[cpu]") and extras["cuda"][0].startswith("mlx[cuda]")
    assert "dctms[cpu]" in extras["test"]
    assert "matplotlib>=3.8" in extras["plot"]
    assert any(req.startswith("starlette") for req in extras["serve"])


# ------------------------------------------------------------------------------------ slow: wheel


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: int = 600):
    proc = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    return proc


def _source_copy(dest: Path) -> Path:
    """The source tree without build outputs (a stale build/ folder would leak into the wheel)."""
    skip = shutil.ignore_patterns(
        ".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
        ".ruff_cache", ".hypothesis", "bench-out", "out", ".coverage*",
    )  # fmt: skip
    shutil.copytree(ROOT, dest, ignore=skip)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("wheel")
    src = _source_copy(base / "src")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(base / "dist"), "."],
        src,
        env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (built,) = (base / "dist").glob("dctms-*.whl")
    return built


@pytest.mark.slow
def test_wheel_holds_every_package_and_data_file(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    in_wheel = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("__init__.py")}
    assert in_wheel == set(discovered_packages())
    for package, files in data_files().items():
        for name in files:
            assert f"{package.replace('.', '/')}/{name}" in names
    print(f"wheel {wheel.name}: {wheel.stat().st_size:,} bytes, {len(names)} files")


@pytest.mark.slow
def test_wheel_installs_and_runs_in_a_fresh_venv(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    assert _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env).returncode == 0
    bin_ = venv / "bin"
    proc = _run([str(bin_ / "pip"), "install", "-q", f"{wheel}[serve,cpu]"], tmp_path, env)
    if proc.returncode != 0 and "No matching distribution" in proc.stderr:
        pytest.skip(f"the package index is not reachable: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]

    work = tmp_path / "work"  # outside the source tree: nothing can be imported from it
    work.mkdir()
    shutil.copy(ROOT / "plans/qwen1.5b.plan", work / "checked-in.plan")
    (work / "base").mkdir()
    (work / "head").mkdir()
    (work / "base/config.json").write_text(json.dumps(TINY_QWEN2))
    (work / "head/config.json").write_text(json.dumps({**TINY_QWEN2, "num_hidden_layers": 4}))
    dctms = str(bin_ / "dctms")

    def ok(*argv: str) -> str:
        proc = _run(list(argv), work, env)
        assert proc.returncode == 0, f"{argv}: {proc.stderr[-2000:]}"
        return proc.stdout

    where = ok(str(bin_ / "python"), "-c", "import dctms; print(dctms.__file__)")
    assert where.startswith(str(venv)), where
    assert "ok (" in ok(dctms, "validate", "checked-in.plan")
    assert "memory envelope" in ok(dctms, "show", "checked-in.plan").lower()
    ok(dctms, "compile", "base/config.json", "-N", "32", "-M", "8", "-q", "-o", "base.plan")
    ok(dctms, "compile", "head/config.json", "-N", "32", "-M", "8", "-q", "-o", "head.plan")
    diff = _run([dctms, "diff", "--fail-above", "64KiB", "base.plan", "head.plan"], work, env)
    assert diff.returncode == 1 and "above --fail-above 64KiB" in diff.stdout, diff.stderr
    assert "re-compiles to the same bytes" in ok(dctms, "check", "base.plan")
    stale = _run([dctms, "check", "base.plan", "--config", "head/config.json"], work, env)
    assert stale.returncode == 1 and "stale: M_max" in stale.stderr
    # The API reads a plan without importing MLX; the inspector finds its stylesheet.
    api = ok(
        str(bin_ / "python"),
        "-c",
        "import sys, dctms; p = dctms.read_plan('base.plan'); "
        "print(p.envelope.total, 'mlx' in sys.modules)",
    )
    assert api.split()[1] == "False" and int(api.split()[0]) > 0
    assert "painted" in ok(str(bin_ / "dctms-tui"), "--exit-after-paint", "base.plan")
    # The serve extra brings what `dctms serve` imports.
    ok(str(bin_ / "python"), "-c", "import dctms.serve.app")
