"""Issue 35's fuzzers for the importers and inputs: >= 4,000 generated GGUF files, pack CSVs and
image files per run (``fuzz_inputs``), in two worker processes (in-process calls; a worker that
dies names the case it died in, a signal is a failure), and a sample as real ``dctms``
subprocesses. Asserted for every case: no signal, no traceback, an allowed exit status, a refusal
of exactly one line, no file created or changed by a refusal, complete outputs, no case over
``fuzz_inputs.SLOW`` seconds; and that each family both accepts and refuses some of its inputs (a
fuzzer whose every case is refused at the first byte tests nothing). ``DCTMS_FUZZ_INPUT_CASES`` /
``DCTMS_FUZZ_SEED`` change the count and the seed; the count of the run is printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from fuzz_cases import ALLOWED
from fuzz_inputs import LLAMA, VLM_FAMILIES, cases
from fuzz_worker import check_in_subprocess

HERE = Path(__file__).parent
COUNT = int(os.environ.get("DCTMS_FUZZ_INPUT_CASES", "4200"))
SEED = int(os.environ.get("DCTMS_FUZZ_SEED", "35"))
WORKERS = 2
# family: (N, image bound): tiny vision-language plans for one image (as test_vision's)
VISION = {"gemma3": (40, (32, 32)), "qwen2_vl": (64, (56, 84))}


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Path:
    from dctms.schema.io import write_plan
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions
    from dctms.toolkit.tiny_model import write_tiny_model
    from dctms.toolkit.vision.compiler import VisionOptions, compile_vlm_plan
    from dctms.toolkit.vision.tiny import write_tiny_vlm

    root = tmp_path_factory.mktemp("fuzz-inputs")
    write_tiny_model(root / "llama", LLAMA, tokenizer=False)
    for family in VLM_FAMILIES:
        n, (h, w) = VISION[family]
        folder = write_tiny_vlm(root / family, family)
        plan = compile_vlm_plan(
            open_model(folder),
            CompileOptions(n, 2, prefill_chunk=16, pack_seconds=0.05),
            VisionOptions(1, h, w),
        )
        write_plan(plan, root / f"{family}.plan")
    return root


def test_the_gguf_fuzzers_starting_file_converts(fixtures, tmp_path) -> None:
    """Every GGUF case mutates this file: it must be one the converter accepts."""
    from fuzz_inputs import base_gguf

    from dctms.cli.main import main

    (tmp_path / "m.gguf").write_bytes(base_gguf(fixtures / "llama").encode())
    assert main(["convert-gguf", str(tmp_path / "m.gguf"), str(tmp_path / "out"), "-q"]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()


def _worker(fixtures: Path, work: Path, start: int, count: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(HERE / "fuzz_inputs.py"), str(fixtures), str(SEED), str(start),
         str(count), str(work)],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )


def _collect(proc: subprocess.Popen) -> tuple[int, list[dict], Counter, int | None, str]:
    """(cases run, problems, outcomes, id of the case it died in or None, stderr)."""
    out, err = proc.communicate(timeout=900)
    ran, problems, outcomes, last = 0, [], Counter(), None
    for line in out.splitlines():
        if line.startswith("start "):
            last = int(line.split()[1])
        elif line.startswith("done "):
            ran, last = int(line.split()[1]), None
        elif line.startswith("outcomes "):
            outcomes.update(json.loads(line[len("outcomes ") :]))
        elif line.startswith("{"):
            problems.append(json.loads(line))
    died = (last if last is not None else -1) if proc.returncode != 0 else None
    return ran, problems, outcomes, died, err


@pytest.mark.slow
def test_fuzz_importers_and_inputs(fixtures, tmp_path, capsys) -> None:
    share = -(-COUNT // WORKERS)
    pending = [(k * share, min(share, COUNT - k * share)) for k in range(WORKERS)]
    total, problems, outcomes = 0, [], Counter()
    while pending:
        running = [(s, c, _worker(fixtures, tmp_path / f"w{s}", s, c)) for s, c in pending if c > 0]
        pending = []
        for start, count, proc in running:
            ran, found, seen, died_in, err = _collect(proc)
            total += ran
            problems += found
            outcomes.update(seen)
            if died_in is not None:
                if died_in < 0:
                    pytest.fail(f"fuzz worker failed to start: {err[-2000:]}")
                done = died_in - start + 1
                total += done
                problems.append({"id": died_in, "problem": f"worker died: exit {proc.returncode}",
                                 "stderr": err[-500:]})  # fmt: skip
                if count - done > 0:
                    pending.append((died_in + 1, count - done))
    with capsys.disabled():
        print(f"\nfuzz inputs: {total} cases (seed {SEED}), {len(problems)} problems; "
              f"outcomes {dict(sorted(outcomes.items()))}")  # fmt: skip
    assert total >= COUNT
    assert not problems, "\n".join(json.dumps(p)[:600] for p in problems[:15])
    for family in ("gguf", "pack", "image"):  # each both accepts and refuses
        assert outcomes[f"{family} accepted"] > 0 and outcomes[f"{family} refused"] > 0, outcomes


@pytest.mark.slow
def test_fuzz_inputs_sample_as_subprocesses(fixtures, tmp_path) -> None:
    """A few cases of each command through a real ``dctms`` process (what a signal would hide)."""
    sample: dict[str, list] = {"convert-gguf": [], "pack": [], "run": []}
    for case in cases(SEED + 1, 3000, fixtures):
        if case.command in sample and not sample[case.command]:
            sample[case.command].append(case)
    for case in [c for group in sample.values() for c in group]:
        check_in_subprocess(case, tmp_path, fixtures, ALLOWED)
