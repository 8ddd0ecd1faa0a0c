"""Pass 1c (``toolkit.common_ops``): an op that repeats an earlier op's value is merged into it --
only where that holds at every length the runner may use, never for what is not a pure function."""

from __future__ import annotations

from pathlib import Path

from conftest import TINY_QWEN2

from dctms.toolkit.common_ops import merge_common_ops
from dctms.toolkit.lengths import Affine, LengthFit
from dctms.toolkit.trace import TracedBinding, TracedOp, TracedPhase, TracedTensor


def _phase(ops: list[TracedOp], outputs: list[str]) -> TracedPhase:
    tensors = {t: TracedTensor(t, (4,), "float32") for op in ops for t in op.outputs}
    tensors["x"] = TracedTensor("x", (4,), "float32")
    return TracedPhase(
        "decode",
        1,
        [TracedBinding("x", "input", "x", (4,), "float32")],
        [TracedBinding(t, "output", f"out{i}", (4,), "float32") for i, t in enumerate(outputs)],
        [],
        ops,
        tensors,
        [f"path{i}" for i in range(len(ops))],
    )


def _fit(args: dict) -> LengthFit:
    return LengthFit(("window",), (64,), args, {}, frozenset())


def test_repeats_merge_in_a_chain_and_readers_follow() -> None:
    ops = [
        TracedOp("Arange", [0.0, 4.0, 1.0], (), ("a",)),
        TracedOp("Arange", [0.0, 4.0, 1.0], (), ("b",)),
        TracedOp("Sin", [], ("a",), ("c",)),
        TracedOp("Sin", [], ("b",), ("d",)),  # the same once b is a
        TracedOp("Add", [], ("c", "d"), ("e",)),
    ]
    merged, fit = merge_common_ops(_phase(ops, ["e"]))
    assert [(op.primitive, op.inputs, op.outputs) for op in merged.ops] == [
        ("Arange", (), ("a",)),
        ("Sin", ("a",), ("c",)),
        ("Add", ("c", "c"), ("e",)),
    ]
    assert set(merged.tensors) == {"x", "a", "c", "e"}
    assert merged.module_paths == ["path0", "path2", "path4"]  # the kept ops' own paths
    assert fit is None


def test_different_arguments_inputs_or_exact_values_stay_apart() -> None:
    ops = [
        TracedOp("Multiply", [], ("x", "x"), ("a",)),
        TracedOp("Add", [], ("x", "x"), ("b",)),  # another primitive
        TracedOp("Full", [0.0], (), ("c",)),
        TracedOp("Full", [-0.0], (), ("d",)),  # -0.0 is not 0.0
        TracedOp("Full", [1], (), ("e",)),
        TracedOp("Full", [1.0], (), ("f",)),  # an int is not a float
        TracedOp("Sin", [], ("a",), ("g",)),
        TracedOp("Sin", [], ("b",), ("h",)),  # other inputs
    ]
    phase = _phase(ops, [])
    merged, _ = merge_common_ops(phase)
    assert merged is phase  # nothing to merge: the phase itself comes back


def test_randomness_collectives_and_bound_outputs_are_never_merged() -> None:
    ops = [
        TracedOp("RandomBits", [[4], 4], ("x",), ("r1",)),
        TracedOp("RandomBits", [[4], 4], ("x",), ("r2",)),
        TracedOp("Recv", [0], (), ("m1",)),
        TracedOp("Recv", [0], (), ("m2",)),
        TracedOp("AllReduce", ["sum"], ("x",), ("s1",)),
        TracedOp("AllReduce", ["sum"], ("x",), ("s2",)),
        TracedOp("Negative", [], ("x",), ("n1",)),
        TracedOp("Negative", [], ("x",), ("n2",)),  # a phase output: a binding names it
    ]
    phase = _phase(ops, ["n2"])
    merged, _ = merge_common_ops(phase)
    assert merged is phase


def test_a_merge_must_hold_at_every_length() -> None:
    ops = [
        TracedOp("Broadcast", [[1, 64]], ("x",), ("a",)),
        TracedOp("Broadcast", [[1, 64]], ("x",), ("b",)),  # equal at the bound only: fixed
        TracedOp("Broadcast", [[1, 64]], ("x",), ("c",)),  # equal at every window
        TracedOp("Add", [], ("a", "b"), ("d",)),
        TracedOp("Add", [], ("d", "c"), ("e",)),
    ]
    window = Affine((1,), 0)
    fit = _fit(
        {
            (0, (0, 1)): window,
            (2, (0, 1)): window,
            (4, (0,)): Affine((1,), 1),  # some argument of the last op, to follow its index
        }
    )
    merged, new_fit = merge_common_ops(_phase(ops, ["e"]), fit)
    assert [op.outputs for op in merged.ops] == [("a",), ("b",), ("d",), ("e",)]
    assert merged.ops[3].inputs == ("d", "a")
    assert new_fit.args == {(0, (0, 1)): window, (3, (0,)): Affine((1,), 1)}


def test_a_real_model_computes_its_rotary_angles_once_per_call(tmp_path: Path) -> None:
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions, compile_plan
    from dctms.toolkit.tiny_model import write_tiny_model

    folder = write_tiny_model(tmp_path, dict(TINY_QWEN2))
    plan = compile_plan(open_model(folder), CompileOptions(32, 8, prefill_chunk=16))
    layers = TINY_QWEN2["num_hidden_layers"]
    assert layers > 1
    for phase in plan.phases:
        # mlx-lm's rope on the CPU: every layer's queries and keys compute the same angles
        counts = {p: sum(op.primitive == p for op in phase.ops) for p in ("Sin", "Cos")}
        assert counts == {"Sin": 1, "Cos": 1}, phase.name
        # and the layers' own work is all still there: one SwiGLU Sigmoid per layer
        assert sum(op.primitive == "Sigmoid" for op in phase.ops) == layers


def test_outputs_of_another_dtype_stay_apart_and_do_not_block_later_merges() -> None:
    ops = [
        TracedOp("Arange", [0.0, 4.0, 1.0], (), ("i",)),  # int32 positions (a mask)
        TracedOp("Arange", [0.0, 4.0, 1.0], (), ("f",)),  # float32 positions (rotary)
        TracedOp("Arange", [0.0, 4.0, 1.0], (), ("g",)),  # float32 again: merges with f
    ]
    phase = _phase(ops, [])
    phase.tensors["i"] = TracedTensor("i", (4,), "int32")
    merged, _ = merge_common_ops(phase)
    assert [op.outputs for op in merged.ops] == [("i",), ("f",)]
