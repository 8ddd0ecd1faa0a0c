"""Module paths: every op of a compiled plan names the mlx-lm module that created it, factored into
a module tree and per-phase runs, checked by the verifier."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import msgspec
import pytest
from conftest import TINY_QWEN2

import dctms
from dctms.schema.modules import node_paths, op_layers, op_modules, path_layer, tensor_modules
from dctms.schema.types import ModuleRuns, ModuleTree
from dctms.schema.verify import verify_plan
from dctms.toolkit.caches import check_cache_support
from dctms.toolkit.module_paths import (
    ROOT,
    STEP,
    build_tree,
    runs,
    trace_module_paths,
)
from dctms.toolkit.trace import PhaseTracer, build_model


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps(TINY_QWEN2))
    return path


@pytest.fixture(scope="module")
def plan(config_path):
    return dctms.compile_plan(config_path, 16, 8, real_lengths=False)


def _weight_ids(phase) -> dict[str, str]:
    return {b.id: b.name for b in phase.inputs if b.kind == "weight"}


def test_every_op_names_a_module_of_the_model(plan):
    model = build_model(TINY_QWEN2, "float32")
    real = {path for path, _ in model.named_modules() if path}
    for phase in plan.phases:
        modules = op_modules(plan, phase)
        assert None not in modules
        assert set(modules) <= real | {ROOT, STEP}
        # The work of every layer, its attention and its MLP is attributed somewhere.
        for i in range(TINY_QWEN2["num_hidden_layers"]):
            assert f"model.layers.{i}.self_attn" in modules
            assert (
                f"model.layers.{i}.mlp" in modules or f"model.layers.{i}.mlp.down_proj" in modules
            )


def test_an_op_reading_a_layer_weight_is_in_that_weights_module(plan):
    for phase in plan.phases:
        weights = _weight_ids(phase)
        modules = op_modules(plan, phase)
        checked = 0
        for op, module in zip(phase.ops, modules, strict=True):
            for t in op.inputs:
                name = weights.get(t)
                if name and ".layers." in name:
                    # q_proj's weight is read in model.layers.i.self_attn.q_proj, not its parent;
                    # a fused weight (a.{q_proj,k_proj,v_proj}.weight) in the parts' parent a.
                    owner = name.split(".{")[0] if ".{" in name else name.rpartition(".")[0]
                    assert module == owner, (op.primitive, name, module)
                    checked += 1
        # q, k, v, o, {gate, up}, down and two norms per layer, at least
        assert checked >= 8 * TINY_QWEN2["num_hidden_layers"]


def test_attention_softmax_sampling_and_tied_head(plan):
    prefill = next(p for p in plan.phases if p.name == "prefill")
    modules = op_modules(plan, prefill)
    prims = [op.primitive for op in prefill.ops]
    softmax = [m for p, m in zip(prims, modules, strict=True) if p == "Softmax"]
    assert sorted(softmax) == [f"model.layers.{i}.self_attn" for i in range(2)]
    argmax = [m for p, m in zip(prims, modules, strict=True) if p == "ArgReduce"]
    assert argmax == [STEP]  # dctms's greedy step, outside the model
    # Tied embeddings: the head is embed_tokens.as_linear, called from the model's own __call__.
    emb = next(i for i, n in _weight_ids(prefill).items() if n == "model.embed_tokens.weight")
    readers = {m for op, m in zip(prefill.ops, modules, strict=True) if emb in op.inputs}
    assert readers == {"model.embed_tokens", ROOT}


def test_layers_from_paths_agree_with_the_layer_weights_read(plan):
    for phase in plan.phases:
        weights = _weight_ids(phase)
        for op, layer in zip(phase.ops, op_layers(plan, phase), strict=True):
            read = {path_layer(weights[t]) for t in op.inputs if t in weights} - {None}
            if read:
                assert read == {layer}


def test_tensors_inherit_their_producer_s_module(plan):
    phase = plan.phases[0]
    by_tensor = tensor_modules(plan, phase)
    for op, module in zip(phase.ops, op_modules(plan, phase), strict=True):
        for t in op.outputs:
            assert by_tensor[t] == module


def test_runs_are_run_length_coded_and_the_tree_is_ordered(plan):
    tree = plan.modules
    paths = node_paths(tree)
    assert len(set(paths)) == len(paths)
    assert all(p < i for i, p in enumerate(tree.parents))
    assert paths.index("model.layers.0") < paths.index("model.layers.1")
    for phase in plan.phases:
        r = phase.modules
        assert sum(r.lengths) == len(phase.ops)
        assert all(a != b for a, b in zip(r.modules, r.modules[1:], strict=False))  # maximal runs


def test_build_tree_and_runs_round_trip():
    ops = ["model.layers.10.mlp", "model.layers.2.mlp", "model.layers.2.mlp", "(step)"]
    parents, names, node = build_tree(set(ops))
    tree = ModuleTree(parents=parents, names=names)
    paths = node_paths(tree)
    # natural order: layer 2 before layer 10; every ancestor present
    assert paths.index("model.layers.2") < paths.index("model.layers.10")
    assert {"model", "model.layers"} <= set(paths)
    lengths, modules = runs(ops, node)
    assert lengths == [1, 2, 1]
    assert [paths[m] for m in modules] == [ops[0], ops[1], ops[3]]


def test_classes_are_restored_after_a_recording_trace():
    model = build_model(TINY_QWEN2, "float32")
    classes = {type(m) for _, m in model.named_modules()}
    before = {c: c.__dict__.get("__call__") for c in classes}
    tracer = PhaseTracer(model, len(check_cache_support(model)), batch=1, capacity=9)
    phase = tracer.decode(8, paths=True)
    assert phase.module_paths is not None and len(phase.module_paths) == len(phase.ops)
    assert {c: c.__dict__.get("__call__") for c in classes} == before


def test_a_recording_that_does_not_pair_up_gives_no_paths():
    model = build_model(TINY_QWEN2, "float32")
    tracer = PhaseTracer(model, len(check_cache_support(model)), batch=1, capacity=9)
    phase = tracer.decode(8)
    fewer = phase.ops[:-1]

    def fn(tokens, position, **kw):
        return tracer._step(tokens[:, None], position, None, 8, kw, "decode")

    feeds = [mx.zeros((1,), mx.uint32), mx.array(0, mx.int32)]
    keywords = {**tracer.weights, **tracer.state}
    assert trace_module_paths(model, fn, feeds, keywords, phase.ops) is not None
    assert trace_module_paths(model, fn, feeds, keywords, fewer) is None
    renamed = list(phase.ops)
    renamed[0] = type(renamed[0])("Nope", renamed[0].args, renamed[0].inputs, renamed[0].outputs)
    assert trace_module_paths(model, fn, feeds, keywords, renamed) is None


# ------------------------------------------------------------------------------ verifier rules


def _rules(plan) -> set[str]:
    return {p.rule for p in verify_plan(plan)}


def _with_tree(plan, **changes):
    tree = msgspec.structs.replace(plan.modules, **changes)
    return msgspec.structs.replace(plan, modules=tree)


def _with_runs(plan, phase_no: int, runs_: ModuleRuns | None):
    phases = list(plan.phases)
    phases[phase_no] = msgspec.structs.replace(phases[phase_no], modules=runs_)
    return msgspec.structs.replace(plan, phases=phases)


def test_the_compiled_plan_passes(plan):
    assert verify_plan(plan) == []


@pytest.mark.parametrize(
    "break_it",
    [
        lambda t: {"parents": t.parents[:-1]},  # one parent short
        lambda t: {"parents": [t.parents[0], 5, *t.parents[2:]]},  # parent after its child
        lambda t: {"names": [t.names[0], "a.b", *t.names[2:]]},  # dotted name
        lambda t: {"names": [t.names[0], t.names[0], *t.names[2:]]},  # the same path twice
    ],
)
def test_module_tree_rejects(plan, break_it):
    assert "module_tree" in _rules(_with_tree(plan, **break_it(plan.modules)))


def test_module_runs_reject(plan):
    r = plan.phases[0].modules
    short = ModuleRuns([*r.lengths[:-1], r.lengths[-1] + 1], r.modules)
    assert "module_runs" in _rules(_with_runs(plan, 0, short))
    beyond = ModuleRuns(r.lengths, [*r.modules[:-1], len(plan.modules.names)])
    assert "module_runs" in _rules(_with_runs(plan, 0, beyond))
    unequal = ModuleRuns(r.lengths, r.modules[:-1])
    assert "module_runs" in _rules(_with_runs(plan, 0, unequal))
    no_tree = msgspec.structs.replace(plan, modules=None)
    assert "module_runs" in _rules(no_tree)
