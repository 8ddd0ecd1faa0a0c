"""Verifier rules about module paths (``Plan.modules``, ``Phase.modules``).

The tree is well formed (one name per parent entry, parents before children, names free of dots,
no path twice), every phase's runs cover its ops exactly, each naming a node of the tree, and a
decoder layer a path names (its first all-digit name) is one the model has (a rank's: one it runs).
"""

from __future__ import annotations

from collections.abc import Iterator

from dctms.schema.modules import node_paths, path_layer
from dctms.schema.phase_index import PlanIndex

Finding = tuple[str, str]


def module_tree(ix: PlanIndex) -> Iterator[Finding]:
    """Plan.modules: as many parents as names, each parent an earlier node, dot-free names,
    every path once."""
    tree = ix.plan.modules
    if tree is None:
        return
    if len(tree.parents) != len(tree.names):
        yield "$.modules", f"{len(tree.parents)} parents for {len(tree.names)} names"
        return
    for i, (parent, name) in enumerate(zip(tree.parents, tree.names, strict=True)):
        if parent >= i:
            yield f"$.modules.parents[{i}]", f"parent {parent} is not an earlier node than {i}"
        if "." in name:
            yield f"$.modules.names[{i}]", f"name {name!r} holds a dot (paths join names)"
    seen: dict[str, int] = {}
    for i, path in enumerate(node_paths(tree)):
        if path in seen:
            yield f"$.modules.names[{i}]", f"path {path} is already node {seen[path]}"
        seen.setdefault(path, i)


def module_runs(ix: PlanIndex) -> Iterator[Finding]:
    """Phase.modules: one module per run, the runs' lengths add up to the phase's ops, every
    module a node of Plan.modules."""
    tree = ix.plan.modules
    nodes = 0 if tree is None else len(tree.names)
    for px in ix.phases:
        runs = px.phase.modules
        if runs is None:
            continue
        where = f"{px.path}.modules"
        if tree is None:
            yield where, "module runs, but the plan has no module tree"
            continue
        if len(runs.lengths) != len(runs.modules):
            yield where, f"{len(runs.lengths)} lengths for {len(runs.modules)} modules"
            continue
        covered, ops = sum(runs.lengths), len(px.phase.ops)
        if covered != ops:
            yield f"{where}.lengths", f"runs cover {covered} ops, the phase has {ops}"
        for k, node in enumerate(runs.modules):
            if node >= nodes:
                yield f"{where}.modules[{k}]", f"module {node}, but the tree has {nodes} nodes"


def module_layer(ix: PlanIndex) -> Iterator[Finding]:
    """A module path's decoder layer, when it names one, is a layer the model has. In a
    vision-language plan only the text phases' modules are decoder modules: the vision tower's
    numbered blocks (``encoder.layers.5``, ``merger.mlp.2``) are not the language model's. A rank
plan's paths name only the layers that rank runs."""
    layers = ix.plan.model.num_layers
    checked = _text_nodes(ix)
    # A rank runs layers [start, end) only (pipeline); its paths keep the model's numbering.
    dist = ix.plan.distributed
    rank = tuple(dist.layers) if dist is not None and len(dist.layers) == 2 else None
    for i, path in enumerate(node_paths(ix.plan.modules)):
        if checked is not None and i not in checked:
            continue
        layer = path_layer(path)
        if layer is not None and layer >= layers:
            yield (
                f"$.modules.names[{i}]",
                f"{path}: layer {layer}, but the model has {layers} layers",
            )
        elif layer is not None and rank is not None and not rank[0] <= layer < rank[1]:
            yield (
                f"$.modules.names[{i}]",
                f"{path}: layer {layer}, but this rank runs layers {rank[0]}..{rank[1] - 1}",
            )


def _text_nodes(ix: PlanIndex) -> set[int] | None:
    """The tree nodes the text phases' runs name, in a vision-language plan; None otherwise."""
    vision = ix.plan.vision
    if vision is None:
        return None
    encoders = {v.phase for v in vision.variants}
    return {
        node
        for px in ix.phases
        if px.phase.name not in encoders and px.phase.modules is not None
        for node in px.phase.modules.modules
    }
