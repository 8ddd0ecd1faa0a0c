"""The collective ops of a rank's plan, executed with mlx.distributed on the launched group.

A rank's plan (``Plan.distributed``) holds mlx.distributed's own primitives where mlx-lm's sharded
or pipelined model calls them: ``AllReduce ["sum"]`` (tensor parallel: after each sharded-to-all
projection), ``Send [dst]``, ``Recv [src]`` and ``AllGather`` (pipeline stages). Each handler makes
exactly that one primitive on the process's global group (``mx.distributed.init`` made it), so the
rebuilt graph has the plan's structure like every other op. MLX's exporter cannot record these
primitives, so a phase that has them runs op by op (``execute.PhaseProgram`` does not replay it).

This module must not import mlx-lm or ``dctms.toolkit``.
"""

from __future__ import annotations

import mlx.core as mx

from dctms.schema.errors import DctmsError

COLLECTIVE_PRIMITIVES = frozenset({"AllReduce", "AllGather", "Send", "Recv"})


def _all_reduce(args: list, x: list[mx.array]) -> mx.array:
    if args != ["sum"]:
        raise DctmsError(f"unsupported primitive AllReduce {args} (only sum is planned)")
    return mx.distributed.all_sum(x[0])


HANDLERS = {
    "AllReduce": _all_reduce,
    "AllGather": lambda a, x: mx.distributed.all_gather(x[0]),
    "Send": lambda a, x: mx.distributed.send(x[0], int(a[0])),  # [dst]
}

# [src]: nothing is read; the received array has the plan's shape and dtype.
CREATION = {
    "Recv": lambda a, x, shape, dtype: mx.distributed.recv(shape, dtype, int(a[0])),
}


def has_collectives(primitives) -> bool:
    return any(p in COLLECTIVE_PRIMITIVES for p in primitives)
