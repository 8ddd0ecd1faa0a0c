"""Issue 35's re-stamped semantic plan mutations, for every plan kind: a plan edited where its
meaning lives (constants, op arguments, affine slopes and offsets, shapes, length points, the
index an addressing op reads) and re-stamped must be refused by the verifier, or run without a
crash.

Every plan kind is compiled once from a tiny model: text, a quantised KV cache with a float start,
a rotating cache (``--max-kv-size``), sliding-window rings (gemma3), a speculative plan with its
draft, both ranks of a pipeline and of a tensor-parallel split, and a gemma3 vision-language plan.
``DCTMS_MUTATION_CASES`` (default 4,000) mutations are judged by the verifier in two worker
processes (an exception from a rule is a failure); a sample of the refused ones goes through
``dctms validate`` (exit 2, every line naming the file), and a sample of the accepted ones through
``dctms run`` in a worker process that names the case it died in: no signal, no exit 70, no
traceback -- a refusal of the runner's own (exit 2, one line) is fine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dctms.cli.main import main

HERE = Path(__file__).parent
COUNT = int(os.environ.get("DCTMS_MUTATION_CASES", "4000"))
SEED = int(os.environ.get("DCTMS_MUTATION_SEED", "35"))
KEEP = 2  # accepted (and refused) mutants kept per plan for the runner (and for validate)

TEXT = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}
WIDE = {**TEXT, "num_key_value_heads": 2}  # shards over two ranks
TWO = {**WIDE, "num_hidden_layers": 2}  # pipelines over two ranks
RING = {**TWO, "model_type": "gemma3_text", "head_dim": 32, "query_pre_attn_scalar": 32,
        "sliding_window": 8, "sliding_window_pattern": 2}  # fmt: skip
BOUNDS = ["-N", "16", "-M", "8", "--prefill-chunk", "8", "--pack-seconds", "0", "-q"]
TOKENS = ["--tokens", "1,2,3,4,5,6,7,8,9,10,11", "--max-tokens", "4"]
TWO_TOKENS = ["--max-tokens", "2"]
QUANTISED = ["--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "8"]


def _compile(folder: Path, out: Path, *extra: str) -> Path:
    assert main(["compile", str(folder), *BOUNDS, *extra, "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def kinds(tmp_path_factory) -> dict[str, tuple[list[Path], list[str]]]:
    """kind -> (its plan files, the ``dctms run`` arguments after the plan)."""
    from PIL import Image

    from dctms.toolkit.tiny_model import write_tiny_model
    from dctms.toolkit.vision.tiny import write_tiny_vlm

    root = tmp_path_factory.mktemp("mutations")
    one, wide, two, ring = root / "one", root / "wide", root / "two", root / "ring"
    write_tiny_model(one, TEXT)
    write_tiny_model(wide, WIDE, seed=4)
    write_tiny_model(two, TWO, seed=2)
    write_tiny_model(ring, RING, seed=3)
    vlm = write_tiny_vlm(root / "vlm" / "model", "gemma3")
    image = root / "image.png"
    Image.new("RGB", (32, 32), (200, 40, 90)).save(image)
    model = lambda folder: ["--model", str(folder), *TOKENS]  # noqa: E731
    out = {
        "text": ([_compile(one, root / "text.plan")], model(one)),
        "kv-quantised": ([_compile(one, root / "q.plan", *QUANTISED)], model(one)),
        "kv-rotating": ([_compile(one, root / "rot.plan", "--max-kv-size", "12")], model(one)),
        "ring": ([_compile(ring, root / "ring.plan")], model(ring)),
        "speculative": (
            [_compile(one, root / "spec.plan", "--draft", str(one), "--num-draft", "2")],
            [*model(one), "--draft-model", str(one)],
        ),
    }
    for mode, folder in (("pipeline", two), ("tensor", wide)):
        plans = _compile(folder, root / mode, "--ranks", "2", "--parallel", mode)
        out[mode] = (
            sorted(plans.glob("rank*.plan")),
            ["--ranks", "2", "--rank-timeout", "30", *model(folder)],
        )
    vision = root / "vision.plan"
    assert main(["compile", str(vlm), "-N", "40", "-M", "4", "--prefill-chunk", "16", "--images",
                 "1", "--image-size", "32x32", "--pack-seconds", "0", "-q", "-o", str(vision)]) == 0  # fmt: skip
    out["vision"] = (
        [vision],
        [
            "--model",
            str(vlm),
            "--prompt",
            "<start_of_image>what",
            "--image",
            str(image),
            *TWO_TOKENS,
        ],
    )
    return out


def _validate_all(kinds, work: Path) -> list[tuple[str, Path, Path, dict]]:
    """Every plan's mutations judged by two workers (the machine's cores are shared): (kind,
    plan, its mutants' folder, result), in plan order."""
    plans = [(kind, p) for kind, (paths, _) in kinds.items() for p in paths]
    each = -(-COUNT // len(plans))
    jobs = []
    for k, (kind, plan) in enumerate(plans):
        out = work / f"{kind}-{plan.stem}"
        out.mkdir(parents=True)
        jobs.append({"plan": str(plan), "seed": SEED + k, "count": each, "out": str(out),
                     "keep": KEEP})  # fmt: skip
    procs = []
    for w in range(2):
        listing = work / f"jobs{w}.json"
        listing.write_text(json.dumps(jobs[w::2]))
        argv = [sys.executable, str(HERE / "plan_mutation_worker.py"), "validate", str(listing)]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))  # fmt: skip
    lines: list[list[str]] = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"a validating worker died: {stderr[-2000:]}"
        lines.append(stdout.strip().splitlines())
    results = []
    for k, ((kind, plan), job) in enumerate(zip(plans, jobs, strict=True)):
        results.append((kind, plan, Path(job["out"]), json.loads(lines[k % 2][k // 2])))
    return results


@pytest.mark.slow  # ~17 s: the quick loop leaves it to `make test`
def test_mutated_plans_are_refused_or_run(kinds, tmp_path) -> None:
    started = time.monotonic()
    results = _validate_all(kinds, tmp_path / "mutants")
    judged = time.monotonic() - started
    ran = sum(r["ran"] for *_, r in results)
    accepted = sum(r["accepted"] for *_, r in results)
    errors = [e for *_, r in results for e in r["errors"]]
    print(f"{ran} mutated plans: {ran - accepted} refused, {accepted} accepted ({judged:.0f} s)")
    assert ran >= COUNT and not errors, errors[:5]

    # Refused ones: dctms validate says so, exit 2, every line naming the file.
    for _, _, out, _ in results:
        for plan in sorted(out.glob("refused-*.plan"))[:1]:
            proc = subprocess.run([sys.executable, "-m", "dctms.cli.main", "validate", str(plan)],
                                  capture_output=True, text=True, timeout=120)  # fmt: skip
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and lines, proc.stderr
            assert all(line.startswith(str(plan)) for line in lines), proc.stderr
            assert "Traceback" not in proc.stderr

    # Accepted ones: the runner runs them or refuses them in one line; never a crash.
    cases = []
    for kind, source, out, _ in results:
        paths, argv = kinds[kind]
        for plan in sorted(out.glob("accepted-*.plan")):
            what = (out / f"{plan.name}.what").read_text()
            target = plan
            if len(paths) > 1:  # a rank plan: run from a folder with the other rank's plan
                if any(c["kind"] == kind for c in cases):
                    continue  # two processes per run: one case of each split
                target = out / plan.stem
                target.mkdir()
                for other in paths:
                    shutil.copy(other, target / other.name)
                shutil.copy(plan, target / source.name)
                what = f"{source.name}: {what}"
            cases.append({"id": len(cases), "kind": kind, "what": what,
                          "argv": ["run", str(target), *argv]})  # fmt: skip
    assert cases, "no accepted mutant to run"
    started = time.monotonic()
    problems = _run_cases(cases, tmp_path / "cases.json")
    print(f"{len(cases)} accepted mutants run ({time.monotonic() - started:.0f} s)")
    assert not problems, problems


def _run_cases(cases: list[dict], listing: Path) -> list[str]:
    problems, todo = [], list(cases)
    while todo:
        listing.write_text(json.dumps(todo))
        proc = subprocess.run(
            [sys.executable, str(HERE / "plan_mutation_worker.py"), "run", str(listing)],
            capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        started, ended = None, set()
        for line in proc.stdout.splitlines():
            if line.startswith("start "):
                started = int(line.split()[1])
            elif line.startswith("end "):
                _, case_id, code, tail = line.split(" ", 3)
                ended.add(int(case_id))
                case = cases[int(case_id)]
                lines = json.loads(tail)
                if int(code) not in (0, 2, 3) or any("Traceback" in x for x in lines):
                    problems.append(f"{case['kind']}: {case['what']}: exit {code}: {lines}")
                elif int(code) == 2 and len(lines) != 1:
                    problems.append(f"{case['kind']}: {case['what']}: {len(lines)} lines: {lines}")
        if proc.returncode != 0:  # the worker died in the case it started last
            case = cases[started] if started is not None else None
            problems.append(f"{case and case['kind']}: {case and case['what']}: the runner died "
                            f"({proc.returncode}): {proc.stderr[-500:]}")  # fmt: skip
        todo = [c for c in todo if c["id"] not in ended and c["id"] != started]
    return problems
