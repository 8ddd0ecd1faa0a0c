"""``--plan`` arguments: ``PLAN=MODEL_DIR`` (served as the plan file's stem) or
``NAME=PLAN=MODEL_DIR``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dctms.schema.errors import DctmsError


@dataclass(frozen=True)
class PlanSpec:
    name: str  # the OpenAI "model" name that picks this plan
    plan: Path
    model_dir: Path


def parse_plan_spec(text: str) -> PlanSpec:
    parts = text.split("=")
    if len(parts) == 2:
        plan, folder = parts
        name = Path(plan).stem
    elif len(parts) == 3:
        name, plan, folder = parts
    else:
        raise DctmsError(f"--plan {text!r}: expected PLAN=MODEL_DIR or NAME=PLAN=MODEL_DIR")
    if not name or not plan or not folder:
        raise DctmsError(f"--plan {text!r}: expected PLAN=MODEL_DIR or NAME=PLAN=MODEL_DIR")
    if any(c.isspace() for c in name):
        raise DctmsError(f"--plan {text!r}: the model name {name!r} may not hold white space")
    return PlanSpec(name, Path(plan), Path(folder))


def parse_plan_specs(texts: list[str]) -> list[PlanSpec]:
    specs = [parse_plan_spec(t) for t in texts]
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise DctmsError(
                f"two --plan arguments are served as {s.name!r}; name them with NAME=PLAN=MODEL_DIR"
            )
        seen.add(s.name)
    return specs
