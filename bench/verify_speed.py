"""How long the verifier takes on a 7B-sized synthetic phase (~6,000 tensors), how long decoding
its plan takes, and the arena-overlap sweep's worst case (every tenant live to the end). These were
timed unit tests; speed goals live here (run it on a quiet machine).

    python bench/verify_speed.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_verifier_synthetic import build_plan, transformer_like  # noqa: E402

from dctms.schema.io import decode_plan, encode_plan  # noqa: E402
from dctms.schema.phase_index import build_plan_index  # noqa: E402
from dctms.schema.sizes import align_up  # noqa: E402
from dctms.schema.verify import RULES, verify_plan  # noqa: E402


def main() -> int:
    from msgspec.structs import replace

    specs = transformer_like(layers=28, ops_per_layer=214)
    plan = build_plan(specs, outputs={len(specs) - 1})
    start = time.perf_counter()
    problems = verify_plan(plan)
    verify_s = time.perf_counter() - start
    data = encode_plan(plan)
    start = time.perf_counter()
    decode_plan(data)
    decode_s = time.perf_counter() - start
    phase = plan.phases[0]
    last, offset, tensors = len(phase.slots) - 1, 0, []
    for t in phase.tensors:
        if t.offset is not None:
            t = replace(t, interval=[t.interval[0], last], offset=offset)
            offset += align_up(t.bytes, 64)
        tensors.append(t)
    index = build_plan_index(replace(plan, phases=[replace(phase, tensors=tensors)]))
    start = time.perf_counter()
    overlap = list(RULES["arena_overlap"](index))
    sweep_s = time.perf_counter() - start
    print(f"{len(phase.tensors)} tensors, {len(data) / 1e6:.2f} MB: verify {verify_s:.2f} s "
          f"({len(problems)} problems), decode {decode_s:.2f} s, all-live overlap sweep "
          f"{sweep_s:.2f} s ({len(overlap)} findings)")  # fmt: skip
    return 0 if not problems and not overlap else 1


if __name__ == "__main__":
    raise SystemExit(main())
