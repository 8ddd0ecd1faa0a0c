"""Pass 3 plans MLX's buffer donation only where MLX's reference counts make it certain.

A chain ``scores = x @ w; scaled = scores * c; probs = softmax(scaled); y = probs @ x`` is the
attention pattern the demo model's envelope hinged on: MLX writes the scaled scores and the softmax
into the scores' buffer. Each test below removes one condition MLX needs and checks the plan then
gives the output a buffer of its own; the last ones run the graph in MLX and compare its peak.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from dctms.toolkit.lifetimes import MemoryRules, analyse
from dctms.toolkit.schedule import Schedule, Segment
from dctms.toolkit.trace import TracedBinding, TracedConstant, TracedOp, TracedPhase, TracedTensor

N = 64  # the scores are N x N float32: 16 KiB


def _phase(ops: list[TracedOp], dtypes: dict[str, str] | None = None) -> TracedPhase:
    dtypes = dtypes or {}
    tensors = {"x": TracedTensor("x", (N, N), "float32"), "w": TracedTensor("w", (N, N), "float32")}
    tensors["c"] = TracedTensor("c", (), "float32")
    for op in ops:
        for t in op.outputs:
            tensors[t] = TracedTensor(t, (N, N), dtypes.get(t, "float32"))
    return TracedPhase(
        name="prefill",
        tokens=N,
        inputs=[
            TracedBinding("x", "input", "hidden", (N, N), "float32"),
            TracedBinding("w", "weight", "w", (N, N), "float32"),
        ],
        outputs=[TracedBinding("y", "output", "y", (N, N), "float32")],
        constants=[TracedConstant("c", (), "float32", [0.125])],
        ops=ops,
        tensors=tensors,
    )


CHAIN = [
    TracedOp("Matmul", [], ("x", "w"), ("scores",)),
    TracedOp("Multiply", [], ("scores", "c"), ("scaled",)),
    TracedOp("Softmax", [True], ("scaled",), ("probs",)),
    TracedOp("Matmul", [], ("probs", "x"), ("y",)),
]


def _schedule(n: int, cuts: tuple[int, ...] = (), evaluate: dict[int, list[str]] | None = None):
    """One op per slot; a sync point after each position in ``cuts`` and at the end."""
    evaluate = evaluate or {}
    ends = [*cuts, n - 1]
    segments, start = [], 0
    for end in ends:
        segments.append(Segment(list(range(start, end + 1)), evaluate.get(end, []), "test"))
        start = end + 1
    segments[-1].evaluate.append("y")
    return Schedule(
        order=list(range(n)),
        slots=[[p] for p in range(n)],
        segments=segments,
        sync_slots=ends,
        layers=[None] * n,
        memory_bound=[False] * n,
    )


def _roots(ops, sched=None, donation=True, dtypes=None) -> dict[str, str | None]:
    phase = _phase(ops, dtypes)
    lives = analyse(phase, sched or _schedule(len(ops)), MemoryRules(donation=donation))
    return {t: lives.lives[t].root for op in ops for t in op.outputs}


def test_the_scores_chain_shares_one_buffer() -> None:
    phase = _phase(CHAIN)
    lives = analyse(phase, _schedule(len(CHAIN)))
    assert {t: lives.lives[t].root for t in ("scores", "scaled", "probs")} == {
        "scores": None,
        "scaled": "scores",
        "probs": "scores",
    }
    # The one buffer lives until the softmax's last reader (the second matmul, position 3).
    assert lives.lives["scores"].end == 3
    assert lives.lives["y"].root is None  # a matmul never takes a buffer


def test_without_donation_every_output_has_its_buffer() -> None:
    assert set(_roots(CHAIN, donation=False).values()) == {None}


def test_a_second_reader_keeps_the_input() -> None:
    ops = [*CHAIN[:3], TracedOp("Add", [], ("probs", "scores"), ("sum",))]
    ops.append(TracedOp("Matmul", [], ("sum", "x"), ("y",)))
    roots = _roots(ops)
    assert roots["scaled"] is None  # scores is read twice
    assert roots["probs"] == "scaled"  # scaled is still read once
    assert roots["sum"] == "scaled"  # probs (in scaled's buffer) is read once


def test_reading_the_input_twice_in_one_op_keeps_it() -> None:
    ops = [CHAIN[0], TracedOp("Multiply", [], ("scores", "scores"), ("scaled",)), *CHAIN[2:]]
    assert _roots(ops)["scaled"] is None


def test_an_evaluated_input_keeps_its_buffer() -> None:
    sched = _schedule(len(CHAIN), evaluate={3: ["scaled"]})
    roots = _roots(CHAIN, sched)
    # an output mx.eval receives is planned in a buffer of its own, as the verifier's rule
    # donation requires (MLX may still donate into it: real memory only lower than the plan)
    assert roots["scaled"] is None
    assert roots["probs"] is None  # mx.eval holds scaled
    assert _roots(CHAIN)["probs"] == "scores"  # unevaluated, both are donated


def test_no_donation_across_a_sync_point() -> None:
    sched = _schedule(len(CHAIN), cuts=(1,), evaluate={1: ["scaled"]})
    roots = _roots(CHAIN, sched)
    assert roots["scaled"] is None  # evaluated at the sync point (above)
    assert roots["probs"] is None  # made in the next segment


def test_a_phase_input_or_constant_is_never_donated() -> None:
    ops = [TracedOp("Multiply", [], ("x", "c"), ("scaled",)), *CHAIN[2:]]
    assert _roots(ops)["scaled"] is None


def test_an_output_of_another_itemsize_gets_its_own_buffer() -> None:
    ops = [CHAIN[0], TracedOp("AsType", ["float16"], ("scores",), ("half",))]
    ops.append(TracedOp("AsType", ["float32"], ("half",), ("y",)))
    assert _roots(ops, dtypes={"half": "float16"})["half"] is None
    # int32 has float32's itemsize: MLX converts in place
    same = [CHAIN[0], TracedOp("AsType", ["int32"], ("scores",), ("ints",))]
    same.append(TracedOp("AsType", ["float32"], ("ints",), ("y",)))
    assert _roots(same, dtypes={"ints": "int32"})["ints"] == "scores"


def test_a_general_binary_op_donates_its_row_contiguous_input() -> None:
    # Multiply of a transposed (column-major) and a row-major input is MLX's General case: only
    # a row-contiguous input of the output's size may be donated (and a view never owns a buffer).
    ops = [
        CHAIN[0],
        TracedOp("Transpose", [[1, 0]], ("scores",), ("scoresT",)),
        TracedOp("Matmul", [], ("x", "w"), ("other",)),
        TracedOp("Multiply", [], ("scoresT", "other"), ("prod",)),
        TracedOp("Matmul", [], ("prod", "x"), ("y",)),
    ]
    assert _roots(ops)["prod"] == "other"


def _mlx_peak(build, *inputs) -> int:
    """MLX's peak above what ``inputs`` hold when ``build``'s graph is evaluated with nothing but
    the graph holding its intermediates (as the runner does)."""
    mx.eval(inputs)
    old = mx.set_cache_limit(0)
    try:
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        out = build(*inputs)
        mx.eval(out)
        peak = mx.get_peak_memory() - before
        del out
    finally:
        mx.set_cache_limit(old)
    return peak


@pytest.mark.parametrize("donation", [True, False])
def test_the_plan_matches_mlx_on_the_chain(donation: bool) -> None:
    """MLX's peak for the chain is the plan's peak live bytes when donation is modelled (two
    N x N buffers: the scores' and the result's), and below the plan's without it."""
    phase = _phase(CHAIN)
    lives = analyse(phase, _schedule(len(CHAIN)), MemoryRules(donation=donation))
    owners = [t for t, life in lives.lives.items() if life.root is None]
    planned = max(
        sum(
            lives.lives[t].bytes
            for t in owners
            if lives.slot_interval[t][0] <= s <= lives.slot_interval[t][1]
        )
        for s in range(len(CHAIN))
    )
    x, w, c = mx.random.normal((N, N)), mx.random.normal((N, N)), mx.array(0.125)

    def chain(x, w, c):
        return mx.softmax((x @ w) * c, axis=-1, precise=True) @ x

    real = _mlx_peak(chain, x, w, c)
    if donation:
        # MLX's host may run ahead, so without donation all three would be live at once.
        assert planned == 2 * N * N * 4
        assert real == planned
    else:
        assert planned == 4 * N * N * 4 > real  # MLX donates what the plan did not count on
