"""The order in which MLX will really execute a graph, so the plan's schedule *is* the run's order.

``mx.eval(outputs)`` (mlx/transforms.cpp ``eval_impl``) first counts, by depth-first search from
the outputs, how many times each array is used; then builds a tape breadth-first from the outputs,
pushing an input once its last user is on the tape, with a width limit (``MLX_BFS_MAX_WIDTH``,
default 20) that makes it dive depth-first; then runs the tape backwards. We replay exactly that on
the traced graph. The runner rebuilds the same graph (one MLX primitive per plan op, same input
order) and evaluates the same outputs in the same order, so MLX follows the plan.
"""

from __future__ import annotations

from collections.abc import Sequence

BFS_MAX_WIDTH = 20


def mlx_eval_order(
    op_inputs: Sequence[Sequence[str]],
    op_outputs: Sequence[Sequence[str]],
    targets: Sequence[str],
    done: set[int] | None = None,
    max_width: int = BFS_MAX_WIDTH,
    producer: dict[str, int] | None = None,
) -> list[int]:
    """Op indices in the order ``mx.eval(*targets)`` executes them.

    ``op_inputs[i]`` / ``op_outputs[i]``: tensor ids of op ``i`` (multi-output ops are MLX siblings).
    ``done``: ops already evaluated by an earlier ``mx.eval`` (their outputs are leaves now).
    ``producer``: tensor id -> op index, when the caller already has it (see ``producers``).
    """
    done = done or set()
    if producer is None:
        producer = producers(op_outputs)

    def pending(t: str) -> bool:
        p = producer.get(t)
        return p is not None and p not in done

    # Node -1 is MLX's synchronizer, whose inputs are the targets. Degrees are per op: all siblings
    # share one count, as MLX keeps them equal.
    def inputs_of(node: int) -> Sequence[str]:
        return targets if node == -1 else op_inputs[node]

    degree: dict[int, int] = {}
    stack: list[list[int]] = [[-1, 0]]
    while stack:
        top = stack[-1]
        node, idx = top
        ins = inputs_of(node)
        if idx < len(ins):
            top[1] += 1
            t = ins[idx]
            if not pending(t):
                continue  # leaves are counted by MLX too, but never reach the tape
            p = producer[t]
            if p in degree:
                degree[p] += 1
            else:
                degree[p] = 1
                stack.append([p, 0])
            continue
        stack.pop()

    tape: list[int] = [-1]
    dfs: list[tuple[int, int]] = []
    i = 0
    while degree and (i < len(tape) or dfs):
        if i >= len(tape):
            node, j = dfs.pop()
        else:
            node, j = tape[i], 0
            i += 1
        ins = inputs_of(node)
        while j < len(ins):
            t = ins[j]
            if not pending(t):
                j += 1
                continue
            if len(tape) - i >= max_width:
                dfs.append((node, j))
                break
            p = producer[t]
            degree[p] -= 1
            if degree[p] == 0:
                del degree[p]
                tape.append(p)
            j += 1
    return list(reversed(tape[1:]))


def producers(op_outputs: Sequence[Sequence[str]]) -> dict[str, int]:
    return {t: i for i, outs in enumerate(op_outputs) for t in outs}
