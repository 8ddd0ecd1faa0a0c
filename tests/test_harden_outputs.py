"""Issue 11, findings 4-6: outputs are checked before any work, written atomically, only to a
regular file or a new path, and never onto an input of the same command."""

from __future__ import annotations

import os
import resource
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hardening import assert_one_line_refusal, build_tiny, cli


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("harden-outputs")
    return build_tiny(root / "tiny"), root / "tiny"


def snapshot(*folders: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every entry under the folders: mode, size and content (so a change of any is seen)."""
    seen = {}
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            info = path.lstat()
            data = path.read_bytes() if stat.S_ISREG(info.st_mode) else b""
            seen[str(path)] = (info.st_mode, info.st_size, data)
    return seen


def _a_file(tmp_path: Path) -> Path:
    f = tmp_path / "a-file"
    f.write_text("x")
    return f


# ------------------------------------------------------------ 4. report/output paths fail early


@pytest.mark.parametrize(
    ("where", "needle"),
    [
        (lambda t: t / "missing" / "r.json", "does not exist"),
        (lambda t: t, "is a directory"),
        (lambda t: _a_file(t) / "r.json", "is a file, not a folder"),
        (lambda t: "", "empty path"),
    ],
    ids=["missing folder", "directory", "under a file", "empty"],
)
def test_run_report_path_is_refused_before_generating(tiny, tmp_path, where, needle):
    plan, folder = tiny
    report = str(where(tmp_path))
    before = snapshot(tmp_path)
    result = cli("run", str(plan), "--model", str(folder), "--tokens", "1,2", "--report", report)
    assert_one_line_refusal(result, "run", needle)
    assert result.out == ""  # nothing was generated
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    ("where", "needle"),
    [
        (lambda t: _a_file(t) / "out", "is a file, not a folder"),
        (lambda t: Path("/proc/dctms-bench-out"), "cannot write"),
        (lambda t: _a_file(t), "is not a folder"),
        (lambda t: "", "empty path"),
    ],
    ids=["under a file", "under /proc", "onto a file", "empty"],
)
def test_bench_out_is_refused_before_loading(tiny, tmp_path, where, needle):
    plan, folder = tiny
    out = str(where(tmp_path))
    before = snapshot(tmp_path)
    result = cli("bench", str(plan), "--model", str(folder), "--reps", "1", "-q", "--out", out)
    assert_one_line_refusal(result, "bench", needle)
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------ 5. outputs never destroy inputs


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_compile_never_overwrites_its_model(tiny, name):
    _, folder = tiny
    before = snapshot(folder)
    result = cli("compile", str(folder), "-N", "8", "-M", "4", "-o", str(folder / name))
    assert_one_line_refusal(result, "compile", "is an input of this command")
    assert snapshot(folder) == before


def test_an_input_reached_through_a_link_is_refused_too(tiny, tmp_path):
    _, folder = tiny
    link = tmp_path / "link.plan"
    link.symlink_to(folder / "config.json")
    before = snapshot(folder)
    result = cli("compile", str(folder), "-N", "8", "-M", "4", "-o", str(link))
    assert_one_line_refusal(result, "compile", "is an input of this command")
    assert snapshot(folder) == before and link.is_symlink()


@pytest.mark.parametrize(
    "argv",
    [
        lambda plan, folder: ["dot", str(plan), "-o", str(plan.with_suffix(".dot")), "--view",
                              "buffers"],  # fmt: skip
        lambda plan, folder: ["trace", str(plan), "-o", str(plan)],
        lambda plan, folder: ["run", str(plan), "--model", str(folder), "--tokens", "1",
                              "--report", str(plan)],  # fmt: skip
        lambda plan, folder: ["fit", str(folder), "--memory", "1GiB", "-M", "4", "-o",
                              str(folder / "config.json")],  # fmt: skip
    ],
    ids=["dot onto its plan", "trace onto its plan", "run --report onto its plan", "fit -o config"],
)
def test_no_command_writes_onto_its_input(tiny, tmp_path, argv):
    plan, folder = tiny
    copy = tmp_path / "p.dot"  # dot wants a .dot output: the plan is read from a file of that name
    copy.write_bytes(plan.read_bytes())
    args = argv(copy, folder)
    before = snapshot(tmp_path, folder)
    result = cli(*args)
    assert_one_line_refusal(result, args[0], "is an input of this command")
    assert snapshot(tmp_path, folder) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a device node needs root")
@pytest.mark.parametrize("command", ["compile", "dot", "trace", "run"])
def test_a_device_node_is_never_replaced(tiny, tmp_path, command):
    plan, folder = tiny
    node = tmp_path / "null.dot"
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a second /dev/null
    argv = {
        "compile": ["compile", str(folder), "-N", "8", "-M", "4", "-o", str(node)],
        "dot": ["dot", str(plan), "-o", str(node)],
        "trace": ["trace", str(plan), "-o", str(node)],
        "run": ["run", str(plan), "--model", str(folder), "--tokens", "1", "--report", str(node)],
    }[command]
    result = cli(*argv)
    assert_one_line_refusal(result, command, "not a regular file")
    assert stat.S_ISCHR(node.lstat().st_mode)


# ------------------------------------------------------------ 6. never a half-written file


def _limited(limit: int):
    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return set_limit


@pytest.mark.parametrize("command", ["dot", "trace", "compile"])
def test_a_file_size_limit_keeps_the_earlier_good_file(tiny, tmp_path, command):
    plan, folder = tiny
    out = tmp_path / ("out.dot" if command == "dot" else "out.json")
    good = b"an earlier good output\n"
    out.write_bytes(good)
    argv = {
        "dot": ["dot", str(plan), "--view", "graph", "--flat", "-o", str(out)],
        "trace": ["trace", str(plan), "-o", str(out)],
        "compile": ["compile", str(folder), "-N", "8", "-M", "4", "-o", str(out)],
    }[command]
    proc = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limited(4096),
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(proc.stderr.splitlines()) == 1 and "cannot write" in proc.stderr, proc.stderr
    assert out.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no temporary left
