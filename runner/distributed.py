"""A rank of a distributed run: is this plan mine, and did every rank pass its checks?

This module must not import mlx-lm or ``dctms.toolkit``.
"""

from __future__ import annotations

import mlx.core as mx

from dctms.schema.errors import DctmsError
from dctms.schema.types import Plan


def check_rank(plan: Plan, rank: int, size: int) -> None:
    """The plan must be rank ``rank``'s of a group of ``size`` (one line naming the difference)."""
    d = plan.distributed
    if d is None:
        raise DctmsError(
            f"rank {rank}: the plan is not a rank's plan (compile with --ranks {size})"
        )
    if d.ranks != size:
        raise DctmsError(f"rank {rank}: the plan is for {d.ranks} ranks, this group has {size}")
    if d.rank != rank:
        raise DctmsError(f"rank {rank}: the plan is rank {d.rank}'s, not this rank's")


def exchange_flags(failed: bool) -> list[bool]:
    """Every rank's flag (True: it refused), by one all_gather on the launched group. Nothing of
    the plan is allocated yet, so a refusing rank costs the others nothing but this exchange."""
    flags = mx.distributed.all_gather(mx.array([1 if failed else 0], dtype=mx.int32))
    mx.eval(flags)
    return [bool(f) for f in flags.tolist()]
