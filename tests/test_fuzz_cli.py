"""Issue 11's fuzz suite: >= 10,000 generated bad inputs across every command per run.

Cases (``fuzz_cases``: plan files damaged byte-wise and field-wise, odd options and paths, configs
and safetensors headers that lie) run in worker processes (``fuzz_worker``), in-process calls of
``dctms.cli.main.main``; a worker that dies names the case it died in (a signal is a failure), and
a sample also runs as real ``dctms`` subprocesses. Asserted for every case: no signal, no traceback,
an allowed exit status, exit 2 with exactly one stderr line, and no file created or changed except
the command's own complete output. ``DCTMS_FUZZ_CASES`` / ``DCTMS_FUZZ_SEED`` change the count and
the seed; the count of the run is printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_tiny_plan
from fuzz_cases import ALLOWED, cases
from fuzz_worker import check_in_subprocess

HERE = Path(__file__).parent
COUNT = int(os.environ.get("DCTMS_FUZZ_CASES", "10000"))
SEED = int(os.environ.get("DCTMS_FUZZ_SEED", "11"))
WORKERS = 2
SUBPROCESS_SAMPLE = 12

FUZZ_CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,  # bounds fit's search
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Path:
    from dctms.cli.main import main
    from dctms.schema.io import write_plan
    from dctms.toolkit.tiny_model import write_tiny_model

    root = tmp_path_factory.mktemp("fuzz-fixtures")
    write_tiny_model(root / "model", FUZZ_CONFIG)
    write_plan(make_tiny_plan(), root / "small.plan")
    argv = ["compile", str(root / "model"), "-N", "8", "-M", "4", "-q", "-o", str(root / "tiny.plan")]
    assert main(argv) == 0
    return root


def _worker(fixtures: Path, work: Path, start: int, count: int) -> subprocess.Popen:
    work.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, str(HERE / "fuzz_worker.py"), str(fixtures), str(SEED), str(start),
         str(count), str(work)],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )


def _collect(proc: subprocess.Popen) -> tuple[int, list[dict], int | None, str]:
    """(cases run, problems, id of the case it died in or None, stderr)."""
    out, err = proc.communicate(timeout=900)
    ran, problems, last = 0, [], None
    for line in out.splitlines():
        if line.startswith("start "):
            last = int(line.split()[1])
        elif line.startswith("done "):
            ran = int(line.split()[1])
            last = None
        elif line.startswith("{"):
            problems.append(json.loads(line))
    if proc.returncode != 0 and last is None:
        last = -1
    return ran, problems, last if proc.returncode != 0 else None, err


@pytest.mark.slow
def test_fuzz_every_command(fixtures, tmp_path, capsys):
    share = -(-COUNT // WORKERS)
    pending = [(k * share, min(share, COUNT - k * share)) for k in range(WORKERS)]
    total, problems = 0, []
    while pending:
        running = [(s, c, _worker(fixtures, tmp_path / f"w{s}", s, c)) for s, c in pending if c > 0]
        pending = []
        for start, count, proc in running:
            ran, found, died_in, err = _collect(proc)
            total += ran
            problems += found
            if died_in is not None:
                if died_in < 0:
                    pytest.fail(f"fuzz worker failed to start: {err[-2000:]}")
                # the case it died in is a failure (a signal); the rest of its range continues
                seen = died_in - start + 1
                total += seen
                problems.append({"id": died_in, "problem": f"worker died: exit {proc.returncode}",
                                 "stderr": err[-500:]})  # fmt: skip
                if count - seen > 0:
                    pending.append((died_in + 1, count - seen))
    with capsys.disabled():  # the count of the run, shown also when output is captured
        print(f"\nfuzz: {total} cases (seed {SEED}), {len(problems)} problems")
    assert total >= COUNT
    assert not problems, "\n".join(json.dumps(p)[:600] for p in problems[:15])


@pytest.mark.slow
def test_fuzz_sample_as_subprocesses(fixtures, tmp_path):
    """A sample through a real ``dctms`` process: what a signal or the interpreter's own exit
    would hide in-process."""
    data = {n: (fixtures / n).read_bytes() for n in ("small.plan", "tiny.plan")}
    data["config.json"] = (fixtures / "model" / "config.json").read_bytes()
    data["model.safetensors"] = (fixtures / "model" / "model.safetensors").read_bytes()

    sample = [c for c in cases(SEED + 1, 400, data) if c.command != "bench"][::33][:SUBPROCESS_SAMPLE]
    assert len(sample) == SUBPROCESS_SAMPLE
    for case in sample:
        check_in_subprocess(case, tmp_path, fixtures, ALLOWED, lambda c: c.command != "validate")
