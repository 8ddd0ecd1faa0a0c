"""Runs fuzz cases in one process: ``python fuzz_worker.py FIXTURES SEED START COUNT WORK``.

For each case: writes its files into a fresh folder under WORK, snapshots that folder and the
shared fixtures, calls ``dctms.cli.main.main`` with stdout/stderr captured, and checks the outcome.
Prints ``start ID`` (flushed) before each case, so that a crash names the case, and one JSON line
per case that broke a rule (``{"id": .., "problem": ..}``); ``done N`` at the end.

Rules: an allowed exit status; no traceback; exit 2 -> exactly one stderr line (``validate``: one
line per problem, each naming the file); no file created, changed or removed except the case's own
outputs, and those only when the command succeeded (0, or 1/3, which still write), complete.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fuzz_cases import ALLOWED, cases  # noqa: E402


def snapshot(*roots: Path) -> dict[str, tuple[int, ...]]:
    """Every entry under the roots by (mode, size, mtime, inode): a write, a replacement or a
    removal changes one of them."""
    seen = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                path = Path(dirpath) / name
                info = path.lstat()
                seen[str(path)] = (info.st_mode, info.st_size, info.st_mtime_ns, info.st_ino)
    return seen


class _Capture(io.TextIOWrapper):
    def __init__(self) -> None:
        super().__init__(io.BytesIO(), encoding="utf-8", errors="surrogateescape")

    def text(self) -> str:
        self.flush()
        return self.buffer.getvalue().decode("utf-8", "replace")


def complete(path: Path) -> str | None:
    """Why an output file is not a complete output, or None."""
    if path.is_dir():
        return None  # a folder of outputs (convert-gguf): its files are the command's
    data = path.read_bytes()
    if path.suffix == ".plan":
        from dctms.schema.errors import DctmsError
        from dctms.schema.io import read_plan

        try:
            read_plan(path)
        except DctmsError as err:
            return f"written plan does not read back: {err}"
    elif path.suffix == ".json":
        try:
            json.loads(data)
        except ValueError:
            return "written JSON does not parse"
    elif path.suffix in (".dot", ".gv"):
        if not data.rstrip().endswith(b"}"):
            return "written dot file is incomplete"
    return None


def run_case(case: dict, fixtures: Path, work: Path, main) -> str | None:
    folder = work / "case"  # reused: creating and removing a folder per case costs ~4 ms here
    folder.mkdir(exist_ok=True)
    for name, content in case["files"].items():
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(base64.b64decode(content))

    def fill(arg: str) -> str:
        return arg.replace("{d}", str(folder)).replace("{f}", str(fixtures))

    argv = [fill(a) for a in case["argv"]]
    before = snapshot(folder, fixtures)
    out, err = _Capture(), _Capture()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 2
        except BaseException as exc:  # noqa: BLE001 - that is the finding
            code = f"raised {type(exc).__name__}: {exc}"
    stderr = err.text()
    after = snapshot(folder, fixtures)
    try:
        return judge(case, code, stderr, before, after, folder)
    finally:
        _empty(folder)


def _empty(folder: Path) -> None:
    for entry in os.scandir(folder):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            os.unlink(entry.path)


def judge(case, code, stderr, before, after, folder: Path) -> str | None:
    command = case["command"]
    if not isinstance(code, int):
        return code
    if "Traceback" in stderr:
        return f"traceback (exit {code}): {stderr[-300:]}"
    if code not in ALLOWED[command]:
        return f"exit {code}: {stderr.strip()[-300:]}"
    lines = stderr.splitlines()
    if code == 2:
        if command == "validate":
            if not lines or any(": " not in line for line in lines):
                return f"validate refusal not one line per problem: {stderr[-300:]!r}"
        elif len(lines) != 1 or not lines[0].startswith(f"dctms {command}: "):
            return f"refusal is not one line: {stderr[-400:]!r}"
    outputs = {str(folder / name) for name in case["outputs"]} if code != 2 else set()
    changed = sorted(
        p for p in set(before) | set(after) if before.get(p) != after.get(p) and p not in outputs
    )
    if changed:
        return f"exit {code} changed files it must not: {changed[:3]}"
    for name in outputs:
        path = Path(name)
        if path.exists() and before.get(name) != after.get(name):
            why = complete(path)
            if why:
                return why
    return None


def main_loop() -> None:
    fixtures, seed, start, count, work = (
        Path(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        Path(sys.argv[5]),
    )
    import functools

    from dctms.cli import main as cli

    # The parser is the same for every call: built once (23 ms a call otherwise).
    cli.build_parser = functools.cache(cli.build_parser)
    main = cli.main

    data = {
        name: (fixtures / name).read_bytes()
        for name in ("small.plan", "tiny.plan")
    }
    data["config.json"] = (fixtures / "model" / "config.json").read_bytes()
    data["model.safetensors"] = (fixtures / "model" / "model.safetensors").read_bytes()
    ran = 0
    for case in cases(seed, start + count, data):
        if case.id < start:
            continue
        record = json.loads(case.to_json())
        print(f"start {case.id}", flush=True)
        problem = run_case(record, fixtures, work, main)
        ran += 1
        if problem is not None:
            print(json.dumps({"id": case.id, "family": case.family, "argv": case.argv,
                              "problem": problem}), flush=True)  # fmt: skip
    print(f"done {ran}", flush=True)


if __name__ == "__main__":
    main_loop()


def check_in_subprocess(case, root: Path, fixtures: Path, allowed: dict, one_line=lambda c: True):
    """Run one fuzz ``case`` as a real ``dctms`` subprocess in a folder of its own under ``root``:
    no signal, an allowed exit status, no traceback, a one-line refusal (where ``one_line(case)``)
    and the shared fixtures untouched."""
    import subprocess

    folder = root / f"case{case.id}"
    folder.mkdir()
    for name, content in case.files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(base64.b64decode(content))
    argv = [a.replace("{d}", str(folder)).replace("{f}", str(fixtures)) for a in case.argv]
    before = snapshot(fixtures)
    proc = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", *argv],
        capture_output=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    stderr = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode >= 0, (case.argv, "signal", -proc.returncode)
    assert proc.returncode in allowed[case.command], (case.argv, proc.returncode, stderr)
    assert "Traceback" not in stderr, (case.argv, stderr)
    if proc.returncode == 2 and one_line(case):
        assert len(stderr.splitlines()) == 1, (case.argv, stderr)
    assert snapshot(fixtures) == before
