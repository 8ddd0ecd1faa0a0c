"""The rank plans of one distributed model: ``FOLDER/rank<r>.plan`` as ``dctms compile --ranks``
writes them, read and checked to belong together."""

from __future__ import annotations

import os
from pathlib import Path

from dctms.schema.errors import DctmsError
from dctms.schema.io import read_plan
from dctms.schema.types import Plan

PLAN_NAME = "rank{}.plan"


def read_rank_plans(folder: str | os.PathLike[str]) -> list[Plan]:
    """Every rank's plan, in rank order: rank0.plan says how many there are; each must be its own
    rank's of the same split of the same model."""
    folder = Path(folder)
    first = folder / PLAN_NAME.format(0)
    if not first.is_file():
        raise DctmsError(f"{folder}: no {first.name} (a folder of rank plans from compile --ranks)")
    plans = [read_plan(first)]
    d0 = plans[0].distributed
    if d0 is None:
        raise DctmsError(f"{first}: not a rank's plan")
    for r in range(1, d0.ranks):
        path = folder / PLAN_NAME.format(r)
        if not path.is_file():
            raise DctmsError(f"{path}: missing ({first.name} is rank 0 of {d0.ranks})")
        plans.append(read_plan(path))
    for r, p in enumerate(plans):
        d = p.distributed
        if d is None or d.rank != r or d.ranks != d0.ranks or d.mode != d0.mode:
            raise DctmsError(
                f"{folder / PLAN_NAME.format(r)}: not rank {r} of the {d0.ranks}-rank {d0.mode} split"
            )
        if p.model.config_sha256 != plans[0].model.config_sha256 or d.split != d0.split:
            raise DctmsError(
                f"{folder / PLAN_NAME.format(r)}: a different model or split than rank 0's"
            )
    return plans
