"""Pass 1d (``toolkit.fuse_projections``): the projections of one input become one matmul over
their weights end to end, and the plan names the fused weight and its parts."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest

from dctms.toolkit.fuse_projections import fuse_projections, fused_name
from dctms.toolkit.lengths import Affine, LengthFit
from dctms.toolkit.trace import TracedBinding, TracedOp, TracedPhase, TracedTensor

sys.path.insert(0, str(Path(__file__).parent))
from test_compiler_families import BASE, FAMILIES  # noqa: E402

LLAMA = {**BASE, **FAMILIES["llama"], "torch_dtype": "float32"}  # three layers


def test_a_fused_weight_is_named_by_what_its_parts_share() -> None:
    qkv = [f"model.layers.3.self_attn.{p}_proj.weight" for p in "qkv"]
    assert fused_name(qkv) == "model.layers.3.self_attn.{q_proj,k_proj,v_proj}.weight"
    assert fused_name(["a.gate", "a.up"]) == "a.{gate,up}"


def _w(name: str, rows: int, cols: int = 8) -> TracedBinding:
    return TracedBinding(name[0], "weight", name, (rows, cols), "float32")


def _phase(weights: list[TracedBinding], ops: list[TracedOp], shapes: dict) -> TracedPhase:
    tensors = {b.id: TracedTensor(b.id, b.shape, b.dtype) for b in weights}
    tensors.update({t: TracedTensor(t, s, "float32") for t, s in shapes.items()})
    x = TracedBinding("x", "input", "x", shapes["x"], "float32")
    return TracedPhase("decode", 1, [x, *weights], [], [], ops, tensors, None)


def _projection(w: str, n: int, x: str = "x") -> list[TracedOp]:
    return [
        TracedOp("Transpose", [[1, 0]], (w,), (f"{w}t",)),
        TracedOp("Matmul", [], (x, f"{w}t"), (f"y{n}",)),
    ]


def test_projections_of_one_input_become_one_matmul_and_slices() -> None:
    weights = [_w("q.weight", 6), _w("k.weight", 2), _w("v.weight", 2), _w("o.weight", 8)]
    ops = [*_projection("q", 0), *_projection("k", 1), *_projection("v", 2)]
    ops += [TracedOp("Add", [], ("y0", "y0"), ("z",)), *_projection("o", 3, x="z")]
    shapes = {"x": (4, 8), "qt": (8, 6), "kt": (8, 2), "vt": (8, 2), "ot": (8, 8),
              "y0": (4, 6), "y1": (4, 2), "y2": (4, 2), "y3": (4, 8), "z": (4, 6)}  # fmt: skip
    rows = Affine((1,), 0)
    lf = LengthFit(("tokens",), (4,), {(7, (0,)): Affine((2,), 0)}, {"y0": {0: rows}}, frozenset())
    phase, fit, fused = fuse_projections(_phase(weights, ops, shapes), lf)
    assert fused == {"{q,k,v}.weight": ("q.weight", "k.weight", "v.weight")}
    assert [(op.primitive, op.inputs, op.outputs, op.args) for op in phase.ops[:5]] == [
        ("Transpose", ("fused0.w",), ("fused0.wt",), [[1, 0]]),
        ("Matmul", ("x", "fused0.wt"), ("fused0.y",), []),
        ("Slice", ("fused0.y",), ("y0",), [[0, 0], [4, 6], [1, 1]]),
        ("Slice", ("fused0.y",), ("y1",), [[0, 6], [4, 8], [1, 1]]),
        ("Slice", ("fused0.y",), ("y2",), [[0, 8], [4, 10], [1, 1]]),
    ]
    # o's projection reads another input: left as it is, its argument fit moved with it
    assert [op.primitive for op in phase.ops[5:]] == ["Add", "Transpose", "Matmul"]
    assert fit.args == {(2, (1, 0)): rows, (3, (1, 0)): rows, (4, (1, 0)): rows,
                        (6, (0,)): Affine((2,), 0)}  # fmt: skip
    assert fit.shapes["fused0.y"] == {0: rows}
    bound = {b.name: b.shape for b in phase.inputs if b.kind == "weight"}
    assert bound == {"{q,k,v}.weight": (10, 8), "o.weight": (8, 8)}
    assert phase.tensors["fused0.y"].shape == (4, 10)
    assert "qt" not in phase.tensors and "q" not in phase.tensors


def test_what_is_not_exactly_a_projection_of_one_input_is_left_alone() -> None:
    weights = [_w("a.weight", 4), _w("b.weight", 4), _w("c.weight", 4, cols=6), _w("d.weight", 4)]
    ops = [*_projection("a", 0), *_projection("b", 1, x="x2"), *_projection("c", 2, x="x6")]
    ops += [*_projection("d", 3), TracedOp("Negative", [], ("d",), ("dn",))]  # d read twice
    shapes = {"x": (1, 8), "x2": (1, 8), "x6": (1, 6), "at": (8, 4), "bt": (8, 4), "ct": (6, 4),
              "dt": (8, 4), "y0": (1, 4), "y1": (1, 4), "y2": (1, 4), "y3": (1, 4),
              "dn": (4, 8)}  # fmt: skip
    phase = _phase(weights, ops, shapes)
    same, fit, fused = fuse_projections(phase)
    assert (same, fit, fused) == (phase, None, {})


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[Path, object]:
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions, compile_plan
    from dctms.toolkit.tiny_model import write_tiny_model

    folder = write_tiny_model(tmp_path_factory.mktemp("fuse"), dict(LLAMA))
    return folder, compile_plan(open_model(folder), CompileOptions(32, 8, prefill_chunk=16))


def test_a_real_model_reads_each_layer_through_two_fused_weights(llama) -> None:
    _, plan = llama
    names = [fw.name for fw in plan.model.weights.fused]
    assert names == [
        f"model.layers.{i}.{block}.weight"
        for i in range(LLAMA["num_hidden_layers"])
        for block in ("mlp.{gate_proj,up_proj}", "self_attn.{q_proj,k_proj,v_proj}")
    ]
    parts = {p for fw in plan.model.weights.fused for p in fw.parts}
    for phase in plan.phases:
        bound = {b.name for b in phase.inputs if b.kind == "weight"}
        assert set(names) <= bound and not parts & bound, phase.name
        # per layer: o and down projections, plus the two fused; and the head
        layers = LLAMA["num_hidden_layers"]
        assert sum(op.primitive == "Matmul" and op.args == [] for op in phase.ops) >= 4 * layers + 1


def test_the_runner_with_fused_weights_gives_mlx_lms_tokens(llama) -> None:
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    from dctms.runner.request import validate_request
    from dctms.runner.session import Session
    from dctms.schema.model_folder import open_model

    folder, plan = llama
    prompt = [5, 17, 3, 44, 9, 71, 2, 30, 11, 60, 8, 1, 90, 4, 22, 6, 13, 50]
    model, _ = load_model(folder)
    want = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=8)]
    session = Session(plan, open_model(folder))
    assert session.generate(validate_request(plan, prompt, 8, set())).tokens == want
    assert session.observed_peak() <= plan.envelope.provable
