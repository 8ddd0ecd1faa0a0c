"""The compiler's passes on small inputs whose right answers are worked out by hand."""

from __future__ import annotations

import math
import random

import pytest

from dctms.schema.sizes import FREE_RUN_AHEAD
from dctms.toolkit import assign
from dctms.toolkit.memory_model import op_memory, row_major, strided
from dctms.toolkit.order import mlx_eval_order

# ------------------------------------------------------------------------------------ eval order


def test_diamond_runs_in_mlx_tape_order() -> None:
    # a = f(x); b = g(a); c = h(a); d = k(b, c). MLX's tape (BFS from d) is d, b, c, a;
    # run backwards that is a, c, b, d: the second branch first.
    ins = [["x"], ["a"], ["a"], ["b", "c"]]
    outs = [["a"], ["b"], ["c"], ["d"]]
    assert mlx_eval_order(ins, outs, ["d"]) == [0, 2, 1, 3]


def _two_chains():
    # p0 -> p1 -> p and q0 -> q1 -> q (ops 0..2 and 3..5)
    ins = [["x"], ["p0"], ["p1"], ["x"], ["q0"], ["q1"]]
    outs = [["p0"], ["p1"], ["p"], ["q0"], ["q1"], ["q"]]
    return ins, outs


def test_breadth_first_without_width_limit() -> None:
    ins, outs = _two_chains()
    # tape: sync, p, q, p1, q1, p0, q0 -> run q0, p0, q1, p1, q, p
    assert mlx_eval_order(ins, outs, ["p", "q"]) == [3, 0, 4, 1, 5, 2]


def test_width_limit_dives_depth_first() -> None:
    ins, outs = _two_chains()
    # width 1: p's chain is taped completely before q is: tape sync, p, p1, p0, q, q1, q0
    assert mlx_eval_order(ins, outs, ["p", "q"], max_width=1) == [3, 4, 5, 0, 1, 2]


def test_done_ops_are_leaves() -> None:
    ins, outs = _two_chains()
    assert mlx_eval_order(ins, outs, ["p"], done={0, 1}) == [2]


def test_multi_output_ops_count_once_per_reader() -> None:
    # op 0 makes two outputs (siblings) read by ops 1 and 2; op 3 reads both results.
    ins = [["x"], ["s0"], ["s1"], ["y", "z"]]
    outs = [["s0", "s1"], ["y"], ["z"], ["w"]]
    order = mlx_eval_order(ins, outs, ["w"])
    assert order[0] == 0 and order[-1] == 3 and sorted(order) == [0, 1, 2, 3]


# ------------------------------------------------------------------------------------ assignment


def _random_intervals(seed: int, n: int, slots: int) -> tuple[list[tuple[int, int]], list[int]]:
    rng = random.Random(seed)
    intervals, sizes = [], []
    for _ in range(n):
        s = rng.randrange(slots)
        intervals.append((s, min(slots - 1, s + rng.randrange(12))))
        sizes.append(rng.choice([64, 100, 256, 1000, 4096, 10_000]))
    return intervals, sizes


def _max_overlap(intervals: list[tuple[int, int]], slots: int) -> int:
    return max(sum(1 for s, e in intervals if s <= t <= e) for t in range(slots))


@pytest.mark.parametrize("seed", range(5))
def test_colouring_uses_the_minimum_number_of_buffers(seed: int) -> None:
    intervals, sizes = _random_intervals(seed, 300, 80)
    buffer_of, buffer_size = assign.colour(intervals, sizes)
    assert len(buffer_size) == _max_overlap(intervals, 80)  # optimal for interval graphs
    for i in range(len(intervals)):
        assert sizes[i] <= buffer_size[buffer_of[i]]
        for j in range(i):
            if buffer_of[i] == buffer_of[j]:
                (a0, a1), (b0, b1) = intervals[i], intervals[j]
                assert a1 < b0 or b1 < a0, "tenants of one buffer overlap in time"
    for b, size in enumerate(buffer_size):
        assert size == max(sizes[i] for i in range(len(sizes)) if buffer_of[i] == b)


@pytest.mark.parametrize("seed", range(5))
def test_packing_is_valid_and_near_the_bound(seed: int) -> None:
    intervals, sizes = _random_intervals(seed, 400, 100)
    aligned = [assign.align_up(s, 64) for s in sizes]
    lower = assign.lower_bound(intervals, aligned, 100)
    packing = assign.pack(intervals, sizes, 64)
    offsets, arena = packing.offsets, packing.arena
    assert packing.lower_bound == lower
    assert all(o % 64 == 0 for o in offsets)
    for i in range(len(intervals)):
        assert offsets[i] + aligned[i] <= arena
        for j in range(i):
            (a0, a1), (b0, b1) = intervals[i], intervals[j]
            if a0 <= b1 and b0 <= a1:
                assert (
                    offsets[i] + aligned[i] <= offsets[j] or offsets[j] + aligned[j] <= offsets[i]
                ), "live tensors share bytes"
    assert lower <= arena <= 1.25 * lower


def test_lower_bound_by_hand() -> None:
    # slot:   0    1    2
    # a 64   [----------]
    # b 128       [-]
    # c 64             [-]
    assert assign.lower_bound([(0, 2), (1, 1), (2, 2)], [64, 128, 64], 3) == 192


def test_a_broken_packer_would_be_caught() -> None:
    # The checks above can fail: two live tensors at one offset overlap.
    intervals, sizes = [(0, 3), (2, 5)], [64, 64]
    offsets = [0, 0]
    (a0, a1), (b0, b1) = intervals
    live_together = a0 <= b1 and b0 <= a1
    disjoint_bytes = offsets[0] + sizes[0] <= offsets[1] or offsets[1] + sizes[1] <= offsets[0]
    assert live_together and not disjoint_bytes


# ------------------------------------------------------------------------------------ memory model


def _one(primitive, args, layouts, shapes, dtypes=None, state=None):
    dtypes = dtypes or ["float32"] * len(layouts)
    return op_memory(
        primitive,
        args,
        layouts,
        dtypes,
        shapes,
        ["float32"] * len(shapes),
        state or [False] * len(layouts),
    )


def test_reshape_of_contiguous_is_a_view() -> None:
    mem = _one("Reshape", [[4, 6]], [row_major((2, 3, 4))], [(4, 6)])
    assert mem.effects[0].kind == "view"


def test_reshape_of_a_transpose_copies_and_keeps_the_source() -> None:
    t = _one("Transpose", [[1, 0]], [row_major((8, 6))], [(6, 8)]).effects[0].layout
    assert not t.row
    mem = _one("Reshape", [[48]], [t], [(48,)])
    assert mem.effects[0].kind == "alloc" and mem.effects[0].keep_source


def test_reshape_splitting_a_transposed_axis_stays_a_view() -> None:
    # (4, 6) transposed to (6, 4) then reshaped to (2, 3, 4): MLX's prepare_reshape needs no copy.
    t = _one("Transpose", [[1, 0]], [row_major((4, 6))], [(6, 4)]).effects[0].layout
    assert _one("Reshape", [[2, 3, 4]], [t], [(2, 3, 4)]).effects[0].kind == "view"


def test_matmul_scratch_only_for_unfriendly_layouts() -> None:
    a = row_major((1, 4, 8))
    b_t = _one("Transpose", [[0, 2, 1]], [row_major((1, 16, 8))], [(1, 8, 16)]).effects[0].layout
    assert _one("Matmul", [], [a, b_t], [(1, 4, 16)]).scratch == 0  # BLAS takes the transpose
    every_other = strided((1, 8, 16), (256, 32, 2), 256)  # a strided slice: must be copied
    mem = _one("Matmul", [], [a, every_other], [(1, 4, 16)])
    assert mem.scratch == 8 * 16 * 4


def test_quantized_matmul_copies_non_row_contiguous_input() -> None:
    x = _one("Transpose", [[1, 0]], [row_major((64, 2))], [(2, 64)]).effects[0].layout
    w, s = row_major((32, 8)), row_major((32, 2))
    mem = op_memory(
        "QuantizedMatmul",
        [32, 4, 0, True],
        [x, w, s, s],
        ["float32", "uint32", "float32", "float32"],
        [(2, 32)],
        ["float32"],
        [False] * 4,
    )
    assert mem.scratch == 2 * 64 * 4


def test_cache_update_is_in_place_only_for_state() -> None:
    cache, upd, pos = row_major((1, 2, 16, 8)), row_major((1, 2, 1, 8)), row_major((1,))
    state, other = (
        op_memory(
            "DynamicSliceUpdate",
            [[2]],
            [cache, upd, pos],
            ["float32", "float32", "int32"],
            [(1, 2, 16, 8)],
            ["float32"],
            [is_state, False, False],
        )
        for is_state in (True, False)
    )
    assert state.effects[0].kind == "inplace" and other.effects[0].kind == "alloc"
    assert state.scratch == other.scratch == 8  # MLX's int64 dynamic offset


def test_mlx_runs_ahead_but_within_the_free_budget() -> None:
    """A chain of matmuls, each output read once by the next: MLX's host schedules (allocates)
    outputs ahead of its worker, but never more than FREE_RUN_AHEAD dispatches (two per matmul).
    Measured here: 55-57 outputs alive at once (MLX's 10 full tasks of 10 and a partial one, about
    110 dispatches); the budget of 120 leaves a margin."""
    import mlx.core as mx

    n, links = 512, 160
    x, w = mx.random.normal((n, n)), mx.random.normal((n, n)) / n**0.5
    mx.eval(x, w)
    old_limit, old_cache = mx.set_memory_limit(1 << 40), mx.set_cache_limit(0)
    try:
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        y = x
        for _ in range(links):
            y = y @ w
        mx.eval(y)
        alive = (mx.get_peak_memory() - before) // (n * n * 4)
    finally:
        mx.set_memory_limit(old_limit)
        mx.set_cache_limit(old_cache)
    assert 2 < alive <= FREE_RUN_AHEAD // 2 + 1


def test_a_free_run_ahead_plan_needs_no_throttle() -> None:
    from conftest import make_tiny_plan
    from msgspec.structs import replace

    from dctms.runner.session import throttle_limit

    plan = make_tiny_plan()
    free = replace(plan, target=replace(plan.target, run_ahead_dispatches=FREE_RUN_AHEAD))
    assert throttle_limit(free) == plan.envelope.provable > throttle_limit(plan)


def test_throttle_limit_leaves_room_for_the_largest_op() -> None:
    from conftest import make_tiny_plan

    from dctms.runner.session import throttle_limit

    plan = make_tiny_plan()
    # ops make 16 (t0), 16 (t2), 8 (scratch.3; k_out is the KV state), 16 (t3), 4 (out) bytes
    assert plan.envelope.provable == 640
    assert throttle_limit(plan) == 640 - 16


# ------------------------------------------------------------------------ the model against MLX


def _allocated(fn, *inputs) -> int:
    """Bytes MLX really keeps allocated for ``fn(*inputs)`` (inputs already evaluated)."""
    import gc

    import mlx.core as mx

    mx.eval(*inputs)
    # Arrays left by earlier tests may be freed at any time: collect them before measuring.
    gc.collect()
    mx.synchronize()
    before = mx.get_active_memory()
    out = fn(*inputs)
    mx.eval(out)
    mx.synchronize()
    used = mx.get_active_memory() - before
    del out
    return used


RESHAPE_CASES = [
    # (input shape, permutation applied first, reshape target)
    ((4, 6), None, (24,)),
    ((4, 6), (1, 0), (24,)),
    ((4, 6), (1, 0), (2, 3, 4)),
    ((2, 3, 8), (0, 2, 1), (2, 24)),
    ((2, 3, 8), (1, 0, 2), (3, 16)),
    ((2, 3, 8), (1, 0, 2), (6, 8)),
    ((5, 1, 7), (1, 0, 2), (35,)),
]


@pytest.mark.parametrize(("shape", "perm", "target"), RESHAPE_CASES)
def test_reshape_prediction_matches_mlx(shape, perm, target) -> None:
    import mlx.core as mx

    x = mx.arange(int(math.prod(shape)), dtype=mx.float32).reshape(shape)
    layout = row_major(shape)
    if perm is not None:
        layout = (
            _one("Transpose", [list(perm)], [layout], [tuple(shape[p] for p in perm)])
            .effects[0]
            .layout
        )
    predicted = _one("Reshape", [list(target)], [layout], [target]).effects[0].kind

    def fn(a):
        return mx.reshape(mx.transpose(a, perm) if perm is not None else a, target)

    real = _allocated(fn, x)
    nbytes = 4 * int(math.prod(shape))
    # A copy may land in a cached buffer up to min(S, 8 KiB) larger (the plan's allocator slack).
    assert real == 0 or nbytes <= real < nbytes + min(nbytes, 8192)
    assert predicted == ("view" if real == 0 else "alloc"), f"MLX allocated {real} bytes"


def test_compile_cli_lists_every_target_profile() -> None:
    from dctms.cli.compile_options import PROFILE_NAMES
    from dctms.toolkit.profiles import PROFILES

    assert sorted(PROFILE_NAMES) == sorted(PROFILES)


def test_allocator_slack_by_hand() -> None:
    from dctms.schema.sizes import slack_bytes
    from dctms.schema.types import Intermediate, StateView

    def t(tid, size, interval, variant=Intermediate, **kw):
        return variant(tid, [size], "uint8", size, interval, buffer=0, offset=0, **kw)

    tensors = [
        t("a", 100, [0, 1]),  # small: may cost up to 100 more
        t("b", 50_000, [1, 2]),  # large: up to the slack (8,192) more
        t("c", 10, [2, 2], view_of="b"),  # a view owns no buffer
        t("d", 30, [2, 2], StateView, view_of="k"),  # state: not an arena tenant
    ]
    assert slack_bytes(tensors, 3, 8192) == 100 + 8192  # slot 1: a and b live
    assert slack_bytes(tensors, 3, 0) == 0


CONV_CASES = [
    # (input shape, weight shape, groups, flip): MLX's explicit-gemm paths
    ((1, 19, 128), (128, 4, 1), 128, False),  # a Mamba conv1d: depthwise, the weight copied transposed
    ((1, 19, 64), (64, 4, 2), 32, False),  # grouped 1-D
    ((1, 19, 128), (64, 4, 128), 1, False),  # plain 1-D
    ((1, 19, 16), (8, 3, 16), 1, True),  # flipped 1-D: the N-D path, a flipped weight copy
    ((2, 10, 10, 8), (16, 3, 3, 8), 1, False),  # 2-D
]


@pytest.mark.parametrize(("x_shape", "w_shape", "groups", "flip"), CONV_CASES)
def test_convolution_scratch_is_what_mlx_allocates(x_shape, w_shape, groups, flip) -> None:
    """The memory model's convolution scratch against MLX's own allocations while the op runs
    (peak above the inputs, less the output): counting less than MLX lets a run exceed M_max."""
    import mlx.core as mx

    spatial = len(x_shape) - 2
    x = mx.random.normal(x_shape)
    w = mx.random.normal(w_shape)
    mx.eval(x, w)
    conv = mx.conv1d if spatial == 1 else mx.conv2d
    y = conv(x, w, groups=groups) if not flip else mx.conv_general(x, w, groups=groups, flip=True)
    old = mx.set_cache_limit(0)  # every temporary is a fresh allocation, as in a run
    try:
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(y)
        mx.synchronize()
        real = mx.get_peak_memory() - before - y.nbytes
    finally:
        mx.set_cache_limit(old)
    args = [[1] * spatial, [0] * spatial, [0] * spatial, [1] * spatial, [1] * spatial, groups, flip]
    mem = _one("Convolution", args, [row_major(x_shape), row_major(w_shape)], [tuple(y.shape)])
    assert mem.scratch == real, f"model {mem.scratch} B, MLX {real} B"
