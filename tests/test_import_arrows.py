"""The rooms of the source tree and the import arrows allowed between them (README, Architecture).

Each room is a folder that installs as one ``dctms.<room>`` package. A room may import only the rooms
its row of ``ALLOWED`` names (``cli`` and the top-level ``dctms`` package may import anything), and
none of the third-party packages its row of ``FORBIDDEN_EXTERNAL`` names. Two checks: a static one
over every import statement of every module (``ast``: imports inside functions, relative imports and
``importlib.import_module("...")`` with a literal name included), and a dynamic one (a fresh
interpreter imports every module of a room and must not have loaded a forbidden module, which also
catches an arrow taken through a third room). Inside the compiler (``toolkit``) its sub-packages
have arrows of their own (``TOOLKIT_ALLOWED``): the packer imports none of the passes, the passes
import no vision module and a plan kind only by the arrows ``TOOLKIT_EXCEPTIONS`` names. The
runner's own, stricter check, with a whole generation run, is ``test_runner_isolation.py``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# room -> the other rooms it may import. "dctms" (the version) is importable from everywhere.
ALLOWED: dict[str, set[str]] = {
    "schema": set(),  # the plan contract: imports nothing of ours
    "figures": {"schema"},  # numbers every renderer draws
    "toolkit": {"schema", "figures"},  # the compiler: no runner, tui, cli, benchmark, views, serve
    "runner": {"schema", "figures"},  # executes plans: no compiler, tui, cli
    "views": {"schema", "figures"},  # plan -> text / markdown / JSON / dot / trace
    "tui": {"schema", "figures"},  # the inspector: no compiler module
    "benchmark": {"schema", "figures", "toolkit", "runner"},  # compiles and runs for A/B runs
    "serve": {"schema", "figures", "runner"},  # HTTP around the runner: no compiler
    "convert": {"schema"},  # imports other formats' models (GGUF): an import tool, no compiler
}
ANYTHING = ("cli",)  # the command line is the one room above all others
ROOMS = sorted([*ALLOWED, *ANYTHING])

# Third-party packages a room must not import (matched as the name or a dotted prefix).
FORBIDDEN_EXTERNAL: dict[str, tuple[str, ...]] = {
    "schema": ("mlx", "mlx_lm", "mlx_vlm", "textual", "rich", "numpy"),
    "figures": ("mlx", "mlx_lm", "mlx_vlm", "textual", "rich"),
    "views": ("mlx", "mlx_lm", "mlx_vlm", "textual"),
    "tui": ("mlx", "mlx_lm", "mlx_vlm"),
    "runner": ("mlx_lm", "mlx_vlm"),  # model code; the runner prepares images with transformers
    "serve": ("mlx_lm", "mlx_vlm"),
}


def room_of(module: str) -> str | None:
    """``dctms.schema.io`` -> ``schema``; None for modules that are not ours or the bare package."""
    parts = module.split(".")
    return parts[1] if parts[0] == "dctms" and len(parts) > 1 else None


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source`` (a module of ``package``)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call):
            func = node.func
            name = getattr(func, "attr", None) or getattr(func, "id", "")
            args = node.args
            if (
                name in ("import_module", "__import__")
                and args
                and isinstance(args[0], ast.Constant)
            ):
                if isinstance(args[0].value, str):
                    found.append((node.lineno, args[0].value))
    return found


def violations(room: str, module: str, line: int, where: str) -> list[str]:
    """The arrows ``room`` takes by importing ``module`` that it may not take."""
    out = []
    target = room_of(module)
    if room not in ANYTHING and target is not None and target != room:
        if target not in ALLOWED[room]:
            out.append(f"{where}:{line}: {room} imports {module}")
    for name in FORBIDDEN_EXTERNAL.get(room, ()):
        if module == name or module.startswith(name + "."):
            out.append(f"{where}:{line}: {room} imports {module}")
    return out


def room_modules(room: str) -> list[tuple[str, Path]]:
    """(module name, file) of every module of ``room``, subpackages included."""
    folder = ROOT / room
    out = []
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(["dctms", room, *parts]), path))
    return out


@pytest.mark.parametrize("room", ROOMS)
def test_static_imports_follow_the_arrows(room: str) -> None:
    found = []
    for module, path in room_modules(room):
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for line, name in imported_modules(path.read_text(encoding="utf-8"), package):
            found += violations(room, name, line, str(path.relative_to(ROOT)))
    assert found == []


def test_every_room_is_listed() -> None:
    """A new package folder gets a row here (and in pyproject's packages) before it lands."""
    mapped = {
        p.parent.name
        for p in ROOT.glob("*/__init__.py")
        if p.parent.name not in ("tests", "dctms_pkg")
    }
    assert mapped == set(ROOMS)


# The scanner itself must be able to fail.
@pytest.mark.parametrize(
    ("room", "source", "package"),
    [
        ("schema", "from dctms.toolkit.compiler import compile_plan", "dctms.schema"),
        ("toolkit", "def f():\n    from dctms.runner import session", "dctms.toolkit"),
        ("toolkit", "from dctms import views", "dctms.toolkit"),
        ("tui", "from ..toolkit import sizes", "dctms.tui"),
        ("tui", "import importlib\nimportlib.import_module('dctms.toolkit.trace')", "dctms.tui"),
        ("runner", "import mlx_lm.models.qwen2", "dctms.runner"),
        ("figures", "from textual.widget import Widget", "dctms.figures"),
        ("convert", "from dctms.toolkit.compiler import compile_plan", "dctms.convert"),
        ("runner", "from dctms.convert.gguf import convert_gguf", "dctms.runner"),
    ],
)
def test_a_forbidden_import_is_caught(room: str, source: str, package: str) -> None:
    found = [
        v for line, m in imported_modules(source, package) for v in violations(room, m, line, "x")
    ]
    assert found, source


def test_allowed_imports_pass() -> None:
    source = "import dctms\nfrom dctms.schema.types import Plan\nfrom . import units\n"
    found = [
        v
        for line, m in imported_modules(source, "dctms.figures")
        for v in violations("figures", m, line, "x")
    ]
    assert found == []


_PROBE = textwrap.dedent(
    """
    import importlib, json, sys
    for name in sys.argv[1:]:
        importlib.import_module(name)
    print(json.dumps(sorted(sys.modules)))
    """
)


# Cheap rooms only: toolkit needs mlx and mlx-lm (seconds); the runner has its own dynamic test.
@pytest.mark.parametrize("room", ["schema", "figures", "views", "tui", "convert"])
def test_a_fresh_interpreter_loads_nothing_forbidden(room: str) -> None:
    modules = [m for m, path in room_modules(room) if path.name != "__main__.py"]
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *modules], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    found = [v for m in loaded for v in violations(room, m, 0, "sys.modules")]
    assert found == []
    assert {m for m in loaded if m.startswith("dctms.")} >= set(modules)


def test_the_probe_sees_an_arrow_taken_through_a_third_room() -> None:
    """views may import figures; if figures pulled in the compiler, the views probe would see it."""
    loaded = ["dctms.views.show", "dctms.figures.units", "dctms.toolkit.trace", "mlx.core"]
    found = [v for m in loaded for v in violations("views", m, 0, "sys.modules")]
    assert found == [
        "sys.modules:0: views imports dctms.toolkit.trace",
        "sys.modules:0: views imports mlx.core",
    ]


# Inside the compiler: its sub-packages and the arrows between them. "passes" are the modules
# directly under toolkit/ (trace, lengths, lifetimes, schedule, assign, envelope, compiler, ...).
TOOLKIT_ALLOWED: dict[str, set[str]] = {
    "pack": set(),  # the packer: buffers and time ranges in, offsets out; knows no model or trace
    "passes": {"pack"},  # the text compiler's passes
    "vision": {"passes"},  # the vision-language compiler: the passes over three traced phases
    "kinds": {"passes", "vision"},  # plan kinds built on the compilers: ranks, speculative, dispatch
}
# The only arrows from the passes up into a plan kind, each a single module the pass needs.
TOOLKIT_EXCEPTIONS: set[tuple[str, str]] = {
    # a compile with --ranks traces one rank's model (the whole distributed plan is kinds.distributed)
    ("dctms.toolkit.compiler", "dctms.toolkit.kinds.rank"),
    # `dctms check` and `dctms explain` re-compile a recorded request of whichever kind it was
    ("dctms.toolkit.check", "dctms.toolkit.kinds.dispatch"),
    ("dctms.toolkit.knobs", "dctms.toolkit.kinds.dispatch"),
}


def toolkit_part(module: str) -> str | None:
    """``dctms.toolkit.pack.solve`` -> ``pack``; ``dctms.toolkit.trace`` -> ``passes``."""
    parts = module.split(".")
    if parts[:2] != ["dctms", "toolkit"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in TOOLKIT_ALLOWED else "passes"


def toolkit_violations(importer: str, module: str, line: int, where: str) -> list[str]:
    """The arrows between the compiler's sub-packages that ``importer`` may not take."""
    source, target = toolkit_part(importer), toolkit_part(module)
    if source is None or target is None or source == target:
        return []
    if target in TOOLKIT_ALLOWED[source]:
        return []
    named = (module == b or module.startswith(b + ".") for a, b in TOOLKIT_EXCEPTIONS if a == importer)
    if any(named):
        return []
    return [f"{where}:{line}: toolkit {source} ({importer}) imports {module}"]


def test_the_compilers_sub_packages_follow_their_arrows() -> None:
    found = []
    for module, path in room_modules("toolkit"):
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for line, name in imported_modules(path.read_text(encoding="utf-8"), package):
            found += toolkit_violations(module, name, line, str(path.relative_to(ROOT)))
    assert found == []


@pytest.mark.parametrize(
    ("importer", "source"),
    [
        ("dctms.toolkit.pack.solve", "from dctms.toolkit.trace import TracedPhase"),
        ("dctms.toolkit.trace", "from dctms.toolkit.vision.trace import VisionTracer"),
        ("dctms.toolkit.lengths", "from dctms.toolkit.kinds.rank import split_model"),
        ("dctms.toolkit.compiler", "from dctms.toolkit.kinds.distributed import compile_ranks"),
        ("dctms.toolkit.vision.compiler", "from dctms.toolkit.kinds import dispatch"),
    ],
)
def test_an_arrow_up_the_compiler_is_caught(importer: str, source: str) -> None:
    package = importer.rpartition(".")[0]
    found = [
        v
        for line, m in imported_modules(source, package)
        for v in toolkit_violations(importer, m, line, "x")
    ]
    assert found, source


def test_the_named_arrows_into_a_plan_kind_pass() -> None:
    source = "from dctms.toolkit.kinds.rank import rank_spec\nfrom dctms.toolkit.pack import solve\n"
    found = [
        v
        for line, m in imported_modules(source, "dctms.toolkit")
        for v in toolkit_violations("dctms.toolkit.compiler", m, line, "x")
    ]
    assert found == []
