"""The runner never imports the compiler, the converter, the TUI or mlx-lm model code (README,
Architecture).

Two checks: a static one (every import statement in ``runner/*.py``, parsed with ``ast``, including
imports inside functions, relative imports and ``importlib.import_module("...")`` with a literal
name) and a dynamic one (a fresh interpreter imports every ``dctms.runner`` module, runs a whole
generation on a tiny plan, and must not have loaded any forbidden module).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import TINY_QWEN2

import dctms.runner

RUNNER_DIR = Path(dctms.runner.__file__).parent
PACKAGE = "dctms.runner"
# Forbidden import names, matched as the name itself or a dotted prefix of it.
FORBIDDEN = ("dctms.toolkit", "dctms.convert", "dctms.tui", "toolkit", "convert", "tui", "mlx_lm")


def _is_forbidden(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN)


def _resolve(node: ast.ImportFrom, package: str) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved against package)."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def forbidden_imports(source: str, filename: str = "<src>", package: str = PACKAGE) -> list[str]:
    """``file:line: import X`` for every forbidden import in ``source`` (empty when clean)."""
    tree = ast.parse(source, filename=filename)
    found: list[str] = []

    def flag(node: ast.AST, name: str) -> None:
        if _is_forbidden(name):
            found.append(f"{filename}:{node.lineno}: import {name}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                flag(node, alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(node, package)
            flag(node, module)
            for alias in node.names:  # `from dctms import toolkit`
                flag(node, f"{module}.{alias.name}" if module else alias.name)
        elif isinstance(node, ast.Call):
            func = node.func
            name = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            if (
                name in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                flag(node, node.args[0].value)
    return found


def runner_files() -> list[Path]:
    return sorted(RUNNER_DIR.glob("*.py"))


def test_runner_has_the_expected_modules():
    names = {p.stem for p in runner_files()}
    assert {"load", "execute", "session", "report", "measure", "tokenize", "primitives"} <= names


@pytest.mark.parametrize("path", runner_files(), ids=lambda p: p.name)
def test_runner_module_imports_nothing_forbidden(path: Path):
    assert forbidden_imports(path.read_text(encoding="utf-8"), path.name) == []


BAD_SOURCES = {
    "plain": "import dctms.toolkit\n",
    "submodule": "import dctms.toolkit.compiler as c\n",
    "from": "from dctms.toolkit.trace import build_model\n",
    "from-package": "from dctms import toolkit\n",
    "tui": "from dctms.tui import app\n",
    "convert": "from dctms.convert.gguf import convert_gguf\n",
    "relative-convert": "from ..convert import gguf\n",
    "relative": "from ..toolkit import compiler\n",
    "relative-tui": "from .. import tui\n",
    "mlx_lm": "import mlx_lm\n",
    "mlx_lm-models": "from mlx_lm.models import llama\n",
    "mlx_lm-tokenizer": "from mlx_lm.tokenizer_utils import load\n",
    "bare-toolkit": "import toolkit.trace\n",
    "lazy": "def f():\n    from mlx_lm.utils import load_model\n    return load_model\n",
    "importlib": "import importlib\nm = importlib.import_module('dctms.toolkit.trace')\n",
    "dunder": "m = __import__('mlx_lm.models.qwen2')\n",
}


@pytest.mark.parametrize("case", sorted(BAD_SOURCES))
def test_checker_catches_a_deliberately_bad_module(case: str, tmp_path: Path):
    bad = tmp_path / "bad_module.py"
    bad.write_text(BAD_SOURCES[case])
    problems = forbidden_imports(bad.read_text(), bad.name)
    assert len(problems) >= 1, case
    assert problems[0].startswith("bad_module.py:")


def test_checker_allows_what_the_runner_may_use():
    ok = textwrap.dedent(
        """
        import mlx.core as mx
        import mlx.nn
        from dctms.schema.io import read_plan
        from dctms.runner.primitives import apply_op
        from . import primitives
        from .load import open_model_folder
        from tokenizers import Tokenizer
        import transformers
        import mlx_lmx  # a different name that merely starts alike
        import tuilib
        """
    )
    assert forbidden_imports(ok) == []


# ---------------------------------------------------------------------------------- dynamic


_PROBE = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    import dctms.runner
    names = sorted(m.name for m in pkgutil.iter_modules(dctms.runner.__path__, "dctms.runner."))
    for name in names:
        importlib.import_module(name)
    after_import = sorted(sys.modules)
    ran = False
    if len(sys.argv) > 2:
        from dctms.runner.load import load_checked_plan
        from dctms.schema.model_folder import open_model_folder
        from dctms.runner.measure import RssSampler
        from dctms.runner.report import build_report
        from dctms.runner.request import validate_request
        from dctms.runner.session import Session
        from dctms.runner.tokenize import Tokenizer
        import mlx.core as mx
        plan = load_checked_plan(sys.argv[1])
        model = open_model_folder(sys.argv[2])
        tok = Tokenizer(model.path)
        with RssSampler() as rss:
            gen = Session(plan, model).generate(validate_request(plan, tok.encode("isolation"), 6))
        build_report(plan, gen, mx.get_peak_memory(), rss.peak, rss.series, tok.decode(gen.tokens))
        ran = len(gen.tokens) == 6
    print(json.dumps({"names": names, "after_import": after_import,
                      "after_run": sorted(sys.modules), "ran": ran}))
    """
)


@pytest.fixture(scope="module")
def tiny_plan_and_model(tmp_path_factory) -> tuple[Path, Path]:
    from dctms.schema.io import write_plan
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions, compile_plan
    from dctms.toolkit.tiny_model import write_tiny_model

    folder = tmp_path_factory.mktemp("isolation-model")
    config = dict(TINY_QWEN2)
    write_tiny_model(folder, config)
    plan = compile_plan(open_model(folder), CompileOptions(32, 8, prefill_chunk=16))
    write_plan(plan, folder / "tiny.plan")
    return folder / "tiny.plan", folder


def _leaks(modules: list[str]) -> list[str]:
    return [m for m in modules if _is_forbidden(m) and m.split(".")[0] in ("dctms", "mlx_lm")]


def test_importing_and_running_the_runner_loads_no_forbidden_module(tiny_plan_and_model):
    plan, folder = tiny_plan_and_model
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(plan), str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    # every file in runner/ was imported (pkgutil agrees with the folder listing)
    assert seen["names"] == sorted(
        f"{PACKAGE}.{p.stem}" for p in runner_files() if p.stem != "__init__"
    )
    assert seen["ran"]
    assert _leaks(seen["after_import"]) == []
    assert _leaks(seen["after_run"]) == []
    assert not any(m == "mlx_lm" or m.startswith("mlx_lm.") for m in seen["after_run"])


def test_dynamic_probe_would_see_a_leak():
    """The same probe detects a forbidden module when one is loaded (the check is not vacuous)."""
    proc = subprocess.run(
        [sys.executable, "-c", "import dctms.toolkit.tiny_model\n" + _PROBE],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    leaks = _leaks(seen["after_import"])
    assert "dctms.toolkit" in leaks and "dctms.toolkit.tiny_model" in leaks


# ------------------------------------------------------------------ the server room (dctms.serve)

# The serve folder beside runner/ (read as files: a venv installed before serve/ existed still
# collects this module; its dctms.serve tests then fail by themselves).
SERVE_DIR = RUNNER_DIR.parent / "serve"
SERVE_MAY_USE = ("dctms.runner", "dctms.schema", "dctms.serve")


def serve_forbidden_imports(source: str, filename: str = "<src>") -> list[str]:
    """The server imports the runner and the schema only: any other ``dctms`` room (the compiler,
    the views, the CLI, the TUI, the benchmark) and mlx-lm are forbidden."""
    found = forbidden_imports(source, filename, package="dctms.serve")
    tree = ast.parse(source, filename=filename)
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(node, "dctms.serve")
            names = [module] if module != "dctms" else [f"dctms.{a.name}" for a in node.names]
        for name in names:
            if (name == "dctms" or name.startswith("dctms.")) and not any(
                name == ok or name.startswith(ok + ".") for ok in SERVE_MAY_USE
            ):
                found.append(f"{filename}:{node.lineno}: import {name}")
    return found


@pytest.mark.parametrize("path", sorted(SERVE_DIR.glob("*.py")), ids=lambda p: p.name)
def test_serve_module_imports_only_runner_and_schema(path: Path):
    assert serve_forbidden_imports(path.read_text(encoding="utf-8"), path.name) == []


@pytest.mark.parametrize(
    "source",
    [
        "from dctms.views.pool import pool_of\n",
        "import dctms.cli.main\n",
        "from dctms import toolkit\n",
        "from ..views import pool\n",
        "def f():\n    import dctms.benchmark.execute\n",
        "from mlx_lm.models import qwen2\n",
    ],
)
def test_serve_checker_catches_a_deliberately_bad_module(source: str):
    assert serve_forbidden_imports(source, "bad.py") != []


def test_serve_checker_allows_the_runner_and_the_schema():
    ok = "from dctms.runner.session import Session\nfrom dctms.schema.errors import DctmsError\n"
    ok += "from dctms.serve.protocol import ApiError\nfrom . import text\nimport starlette\n"
    assert serve_forbidden_imports(ok, "ok.py") == []


def test_importing_the_server_loads_no_forbidden_module():
    probe = (
        "import importlib, json, pkgutil, sys\nimport dctms.serve\n"
        "for m in pkgutil.iter_modules(dctms.serve.__path__, 'dctms.serve.'):\n"
        "    importlib.import_module(m.name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    assert "dctms.serve.app" in loaded and "dctms.runner.session" in loaded
    ours = [m for m in loaded if m.startswith("dctms.") and m != "dctms.serve"]
    assert [m for m in ours if not m.startswith(SERVE_MAY_USE)] == []
    assert not any(m == "mlx_lm" or m.startswith("mlx_lm.") for m in loaded)
