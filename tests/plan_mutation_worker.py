"""Workers of the plan-mutation fuzzer (``test_plan_mutation_fuzz``).

``python plan_mutation_worker.py validate JOBS``: for each job of the JSON list (``{"plan", "seed",
"count", "out", "keep"}``), ``count`` mutations of the plan (``plan_mutations``), each judged by the
verifier; prints one JSON line per job: cases run, how many were accepted, internal errors (an
exception from a rule is a bug, not a refusal), and writes up to ``keep`` accepted and ``keep``
refused mutants, re-stamped, into ``out`` (for the runner and the CLI).

``python plan_mutation_worker.py run CASES``: runs each case of the JSON list (``{"id", "argv"}``)
as ``dctms ARGV`` in this process; prints ``start ID`` (flushed) before and ``end ID CODE
STDERR-LINES`` after each, so that a crash names the case it died in.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def validate(plan: Path, seed: int, count: int, out: Path, keep: int) -> None:
    import msgspec
    from plan_mutations import mutate, rejected

    from dctms.schema.digest import stamp
    from dctms.schema.io import _restore_non_finite
    from dctms.schema.types import Plan

    doc = json.loads(plan.read_text())
    rng = random.Random(seed)
    accepted, errors, kept = 0, [], {"accepted": 0, "refused": 0}
    for k in range(count):
        m = mutate(doc, rng)
        try:
            try:
                candidate = _restore_non_finite(msgspec.convert(doc, type=Plan))
                refused = rejected(candidate)
            except msgspec.ValidationError:
                refused = True  # the schema's refusal: decode_plan reports it in one line
            except Exception as err:  # noqa: BLE001 - any other exception is a verifier bug
                errors.append(f"{m.what}: {type(err).__name__}: {err}"[:300])
                continue
            accepted += not refused
            verdict = "refused" if refused else "accepted"
            if kept[verdict] < keep and (not refused or k % 7 == 0):
                name = f"{verdict}-{kept[verdict]}.plan"
                (out / name).write_bytes(stamp(doc))
                (out / f"{name}.what").write_text(m.what)
                kept[verdict] += 1
        finally:
            m.undo()
    print(json.dumps({"ran": count, "accepted": accepted, "errors": errors}), flush=True)


def run(cases: Path) -> None:
    from dctms.cli.main import main

    for case in json.loads(cases.read_text()):
        print(f"start {case['id']}", flush=True)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(case["argv"])
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 2
            except BaseException:  # noqa: BLE001 - reported as the case's failure
                code, err = 70, io.StringIO(traceback.format_exc())
        lines = err.getvalue().strip().splitlines()
        print(f"end {case['id']} {code} {json.dumps(lines[-3:])}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "validate":
        for job in json.loads(Path(sys.argv[2]).read_text()):
            validate(Path(job["plan"]), job["seed"], job["count"], Path(job["out"]), job["keep"])
    else:
        run(Path(sys.argv[2]))
