"""Reading a plan's module paths: the full path of every tree node, the module of every op and
tensor, and the decoder layer a path names. Views and the verifier share these; nothing here
trusts the tables to be well formed beyond what ``rules_modules`` checks (bad indices give None).
"""

from __future__ import annotations

from dctms.schema.types import ModuleTree, Phase, Plan


def node_paths(tree: ModuleTree | None) -> list[str]:
    """The dotted path of every node of ``tree``, by node index (a node whose parent is not an
    earlier node is named on its own)."""
    if tree is None:
        return []
    paths: list[str] = []
    for i, (parent, name) in enumerate(zip(tree.parents, tree.names, strict=False)):
        paths.append(f"{paths[parent]}.{name}" if 0 <= parent < i else name)
    return paths


def op_modules(plan: Plan, phase: Phase) -> list[str | None]:
    """The module path of each op of ``phase`` (by position); None where the plan does not say."""
    out: list[str | None] = [None] * len(phase.ops)
    runs = phase.modules
    if runs is None:
        return out
    paths = node_paths(plan.modules)
    at = 0
    for length, node in zip(runs.lengths, runs.modules, strict=False):
        path = paths[node] if 0 <= node < len(paths) else None
        for k in range(at, min(at + length, len(out))):
            out[k] = path
        at += length
    return out


def tensor_modules(plan: Plan, phase: Phase) -> dict[str, str]:
    """Tensor id -> the module path of the op that produces it (phase inputs have none)."""
    by_op = op_modules(plan, phase)
    found: dict[str, str] = {}
    for op, path in zip(phase.ops, by_op, strict=True):
        if path is not None:
            for t in op.outputs:
                found.setdefault(t, path)
    return found


def path_layer(path: str | None) -> int | None:
    """The decoder layer a module path is in: its first all-digit name (``model.layers.3.mlp``
    -> 3), as mlx-lm's models keep their blocks in a list; None outside the blocks."""
    if not path:
        return None
    for name in path.split("."):
        if name.isdigit():
            return int(name)
    return None


def op_layers(plan: Plan, phase: Phase) -> list[int | None]:
    """The decoder layer of each op, from its module path."""
    return [path_layer(p) for p in op_modules(plan, phase)]


def module_group(path: str | None, depth: int) -> str:
    """``path`` cut to ``depth`` names after its layer (``model.layers.3.self_attn.q_proj`` at
    depth 1 -> ``model.layers.3.self_attn``); paths outside the layers keep ``depth`` names."""
    if not path:
        return "(unknown)"
    names = path.split(".")
    cut = next((i + 1 for i, n in enumerate(names) if n.isdigit()), 0)
    return ".".join(names[: cut + depth])
