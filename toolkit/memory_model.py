"""What each primitive does to memory on MLX's CPU backend: view, new allocation, or in-place.

The envelope is only as sound as this model, so it follows MLX's own code (mlx/backend/common and
mlx/backend/cpu at the pinned version) and, where it cannot be sure, errs towards *more* memory:

* Views (Broadcast, Transpose, Slice, ExpandDims, Squeeze, ...) share their input's buffer.
* Reshape / Flatten / Unflatten share the buffer when MLX's ``prepare_reshape`` can express the new
  shape with strides, else copy. To decide, array strides are tracked through every op the way MLX
  sets them (elementwise outputs inherit a contiguous input's strides, general ops write row-major).
  When the model predicts a copy it also keeps the source alive for the copy's lifetime, so a
  wrong "copy" guess can only over-estimate.
* Scratch: temporaries MLX allocates inside an op (matmul's contiguous copies, QuantizedMatmul's
  ``ensure_row_contiguous``, the 8-byte dynamic offset of DynamicSlice(Update)).
* In-place: a DynamicSliceUpdate or Scatter of a state input writes into the state (the runner
  drops its own reference first, so MLX donates the buffer).
* Donation: an elementwise op (``schema.aliasing.DONATING``) lists the inputs MLX would try to write
  its output into (``Effect.donors``, in MLX's order, those whose layout allows it). Whether MLX
  *can* donate depends on who else holds the input; ``toolkit.lifetimes`` decides that from the
  graph and the schedule, and plans the output as an alias only where MLX's reference counts are
  certain to allow it. Any donation it leaves out only ever lowers real memory below the plan.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from dctms.schema import rules_derived as schema_derived
from dctms.schema.aliasing import BINARY, DONATING, RESHAPES, UNARY, VIEW_ALWAYS
from dctms.schema.sizes import nbytes

# Ops that copy a non-contiguous last axis into a temporary which then becomes the output.
LAST_AXIS_CONTIGUOUS = frozenset({"Softmax"})
_SIZE_CAP = 2**31 - 1  # collapse_contiguous_dims default size cap
# int64 offset MLX computes for DynamicSlice / DynamicSliceUpdate (the verifier re-derives it)
DYNAMIC_OFFSET_BYTES = schema_derived.DYNAMIC_OFFSET_BYTES


@dataclass(frozen=True)
class Layout:
    """Strides and flags of an array as MLX would hold them (element strides)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    data_size: int
    row: bool
    col: bool
    contiguous: bool


@functools.lru_cache(maxsize=4096)
def row_major(shape: tuple[int, ...]) -> Layout:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    size = math.prod(shape)
    return Layout(
        tuple(shape),
        tuple(reversed(strides)),
        size,
        True,
        True if len([n for n in shape if n != 1]) <= 1 else False,
        True,
    )


def _contiguity(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, bool, bool]:
    # MLX's check_contiguity: (size ignoring broadcast axes, row contiguous, col contiguous).
    no_bsx, f, b, row, col = 1, 1, 1, True, True
    n = len(shape)
    for i in range(n):
        ri = n - 1 - i
        col &= strides[i] == f or shape[i] == 1
        row &= strides[ri] == b or shape[ri] == 1
        f *= shape[i]
        b *= shape[ri]
        if strides[i] > 0:
            no_bsx *= shape[i]
    return no_bsx, row, col


def strided(shape: tuple[int, ...], strides: tuple[int, ...], data_size: int) -> Layout:
    no_bsx, row, col = _contiguity(shape, strides)
    return Layout(tuple(shape), tuple(strides), data_size, row, col, no_bsx == data_size)


def _like(src: Layout, shape: tuple[int, ...]) -> Layout:
    # An elementwise output allocated with its input's strides and flags.
    return Layout(tuple(shape), src.strides, src.data_size, src.row, src.col, src.contiguous)


@dataclass(frozen=True)
class Effect:
    """What one op output costs: ``view_of`` an input index, a fresh allocation, or in-place."""

    kind: str  # "view" | "alloc" | "inplace"
    source: int | None  # input index whose buffer a view or in-place update uses
    layout: Layout
    keep_source: bool = False  # a predicted copy that also keeps its source alive (see module doc)
    # inputs MLX would write this output into if it may donate them, in the order it tries them
    donors: tuple[int, ...] = ()


@dataclass(frozen=True)
class OpMemory:
    effects: tuple[Effect, ...]
    scratch: int  # bytes of temporaries live while the op runs
    dispatches: int  # CPU encoder dispatches the op makes (1 holder + kernels), a lower bound


def op_memory(
    primitive: str,
    args: list,
    inputs: list[Layout],
    input_dtypes: list[str],
    out_shapes: list[tuple[int, ...]],
    out_dtypes: list[str],
    input_is_state: list[bool],
) -> OpMemory:
    """The memory effect of one primitive given its inputs' layouts."""
    shape = tuple(out_shapes[0])
    if primitive in VIEW_ALWAYS:
        return OpMemory(
            tuple(_view(primitive, args, inputs[0], tuple(s)) for s in out_shapes), 0, 1
        )
    if primitive in RESHAPES:
        view = _reshape_view(inputs[0], shape)
        if view is not None:
            return OpMemory((Effect("view", 0, view),), 0, 1)
        return OpMemory((Effect("alloc", 0, row_major(shape), keep_source=True),), 0, 2)
    if primitive in UNARY:
        src = inputs[0]
        out = _like(src, shape) if src.contiguous else row_major(shape)
        # AsType to its own dtype returns early when donated (no kernel dispatch): not donating.
        same_type = primitive == "AsType" and input_dtypes[0] == out_dtypes[0]
        donors = (0,) if src.contiguous and not same_type else ()
        return OpMemory((Effect("alloc", None, out, donors=donors),), 0, 2)
    if primitive in BINARY:
        a, b = inputs[0], inputs[1]
        kind = _binary_op_type(a, b)
        out = _binary_layout(kind, a, b, shape)
        donors = _binary_donors(kind, a, b, shape) if primitive in DONATING else ()
        return OpMemory(tuple(Effect("alloc", None, out, donors=donors) for _ in out_shapes), 0, 2)
    if primitive == "Select":
        if all(i.data_size == 1 for i in inputs):
            out = Layout(shape, inputs[0].strides, 1, True, True, True)
        elif all(i.row for i in inputs):
            out = _like(inputs[0], shape)
        else:
            out = row_major(shape)
        return OpMemory((Effect("alloc", None, out, donors=_select_donors(inputs)),), 0, 2)
    if primitive in LAST_AXIS_CONTIGUOUS:
        src = inputs[0]
        ok = src.contiguous and (len(src.strides) == 0 or src.strides[-1] == 1)
        out = _like(src, shape) if ok else row_major(shape)
        return OpMemory((Effect("alloc", None, out, donors=(0,) if ok else ()),), 0, 2)
    if primitive in ("DynamicSliceUpdate", "SliceUpdate"):
        scratch = DYNAMIC_OFFSET_BYTES if primitive == "DynamicSliceUpdate" else 0
        src = inputs[0]
        if input_is_state[0]:
            return OpMemory((Effect("inplace", 0, src),), scratch, 3)
        out = (
            _like(src, shape)
            if src.contiguous and src.data_size == math.prod(src.shape)
            else (row_major(shape))
        )
        return OpMemory((Effect("alloc", None, out),), scratch, 3)
    if primitive == "Scatter" and input_is_state[0]:
        # A batched decode's per-row KV write (toolkit.slots): MLX's Scatter::eval_cpu copies
        # its source into the output with copy_cpu, which takes the donated buffer without a
        # kernel (backend/cpu/copy.cpp set_copy_output_data), then runs one scatter dispatch.
        return OpMemory((Effect("inplace", 0, inputs[0]),), 0, 1)
    if primitive == "DynamicSlice":
        return OpMemory((Effect("alloc", None, row_major(shape)),), DYNAMIC_OFFSET_BYTES, 2)
    if primitive in ("Matmul", "AddMM"):
        scratch = sum(
            nbytes(lay.shape, dt)
            for lay, dt in zip(inputs[:2], input_dtypes[:2], strict=True)
            if not _matmul_friendly(lay)
        )
        out = row_major(shape)
        if primitive == "AddMM" and inputs[2].data_size != 1 and inputs[2].row:
            # MLX fills the output with C by a vector copy first (copy_cpu), which gives it C's
            # strides: a bias broadcast to [1, n] makes a [1, n] output of strides (0, 1), which a
            # later matmul has to copy.
            out = _like(inputs[2], shape)
        return OpMemory((Effect("alloc", None, out),), scratch, 2)
    if primitive == "Send":
        # mlx.distributed's Send: the output shares the input's buffer; a non-row-contiguous input
        # is sent from a contiguous temporary (backend/cpu/distributed.cpp).
        src = inputs[0]
        scratch = 0 if src.row else nbytes(src.shape, input_dtypes[0])
        # One dispatch as for every view (fewer dispatches can only widen the run-ahead).
        return OpMemory((Effect("view", 0, src),), scratch, 1)
    if primitive in (
        "AllGather",  # gathers from a row-contiguous copy of its input
        "QuantizedMatmul",
        "Quantize",  # fast::Quantize (a quantised KV cache's writes): ensure_row_contiguous
        "GatherQMM",
        "GatherMM",
        "LogSumExp",
        "Scan",
        "Sort",
        "ArgSort",
        "Partition",
        "ArgPartition",
    ):
        # These make row-contiguous copies of inputs that are not (ensure_row_contiguous et al.).
        scratch = sum(
            nbytes(lay.shape, dt)
            for lay, dt in zip(inputs, input_dtypes, strict=True)
            if not lay.row
        )
        return OpMemory(
            tuple(Effect("alloc", None, row_major(tuple(s))) for s in out_shapes), scratch, 2
        )
    if primitive == "Convolution":
        return OpMemory(
            (Effect("alloc", None, row_major(shape)),),
            conv_scratch(args, inputs, input_dtypes, shape, out_dtypes[0]),
            3,
        )
    # Every other primitive writes fresh row-major outputs (Matmul-like, Gather, Concatenate,
    # Reduce, ArgReduce, Arange, Full, ...).
    return OpMemory(tuple(Effect("alloc", None, row_major(tuple(s))) for s in out_shapes), 0, 2)


def kernel_copies(primitive: str, inputs: list[Layout]) -> list[bool]:
    """Which inputs Metal's attention kernel copies to a contiguous layout first (its predicates,
    mlx/backend/metal/scaled_dot_product_attention.cpp:666-749); rms_norm and rope copy a strided
    x into their output itself (normalization.cpp:24-45, rope.cpp:44-50). Metal plans use these."""
    if primitive != "ScaledDotProductAttention" or any(len(x.shape) != 4 for x in inputs):
        return [False] * len(inputs)
    q = inputs[0]
    if q.shape[2] > 8:  # full attention: copy unless the head axis has stride 1 (681-684, 764-766)
        return [x.strides[-1] != 1 for x in inputs]

    def q_ok(x: Layout) -> bool:  # 693-705
        if x.row:
            return True
        if x.shape[0] != 1 and x.shape[1] != 1:
            return False
        b = 1 if x.shape[0] == 1 else 0
        return (
            x.strides[3] == 1
            and x.strides[2] == x.shape[3] * x.shape[b]
            and x.strides[b] == x.shape[3]
        )

    def kv_ok(x: Layout) -> bool:  # 707-720
        if x.strides[-1] != 1:
            return False
        return x.shape[0] == 1 or x.shape[1] == 1 or x.strides[0] == x.strides[1] * x.shape[1]

    def mask_ok(x: Layout) -> bool:  # 737-742
        return (
            x.row or q.shape[0] == 1 or q.shape[1] == 1 or x.strides[0] == x.strides[1] * x.shape[1]
        )

    flags = [not q_ok(q), not kv_ok(inputs[1]), not kv_ok(inputs[2])]
    return flags + [not mask_ok(m) for m in inputs[3:]]


def conv_scratch(
    args: list, inputs: list[Layout], input_dtypes: list[str], out: tuple[int, ...], out_dtype: str
) -> int:
    """Temporaries of MLX's CPU convolution (``explicit_gemm_conv_1D_cpu`` and
    ``explicit_gemm_conv_ND_cpu`` in mlx/backend/cpu/conv.cpp, all in float32): the zero-padded
    input, the unfolded input [N * prod(out spatial), prod(kernel) * C], a float32 row-contiguous
    copy of the weight when it is not one -- and always, transposed, for a grouped 1-D convolution
    (a Mamba conv1d) -- another copy when flipped, a float32 output when the output is not, and the
    4-byte zero scalar. Counted for every convolution: the slow path (dilation, groups > 1 beyond
    1-D) allocates less."""
    strides, pad_lo, pad_hi, kdil, idil, groups, flip = args
    x, w = inputs[0], inputs[1]
    n, channels = x.shape[0], x.shape[-1]
    padded = (
        n
        * channels
        * math.prod(d + lo + hi for d, lo, hi in zip(x.shape[1:-1], pad_lo, pad_hi, strict=True))
    )
    unfolded = n * math.prod(out[1:-1]) * math.prod(w.shape[1:-1]) * channels
    weight = math.prod(w.shape)
    total = 4 + 4 * padded + 4 * unfolded
    one_d_gemm = len(out) == 3 and list(kdil) == [1] and list(idil) == [1] and not flip
    if (one_d_gemm and groups > 1) or input_dtypes[1] != "float32" or not w.row:
        total += 4 * weight
    if flip:
        total += 4 * weight
    if out_dtype != "float32":
        total += 4 * math.prod(out)
    del strides
    return total


def _matmul_friendly(lay: Layout) -> bool:
    # MLX's check_transpose: the last two axes must be row- or column-major (BLAS lda).
    if len(lay.shape) < 2:
        return True
    stx, sty = lay.strides[-2], lay.strides[-1]
    return (stx == lay.shape[-1] and sty == 1) or (stx == 1 and sty == lay.shape[-2])


def _binary_op_type(a: Layout, b: Layout) -> str:
    # MLX's get_binary_op_type
    if a.data_size == 1 and b.data_size == 1:
        return "ScalarScalar"
    if a.data_size == 1 and b.contiguous:
        return "ScalarVector"
    if b.data_size == 1 and a.contiguous:
        return "VectorScalar"
    if (a.row and b.row) or (a.col and b.col):
        return "VectorVector"
    return "General"


def _binary_layout(kind: str, a: Layout, b: Layout, shape: tuple[int, ...]) -> Layout:
    # MLX's set_binary_op_output_data without donation: the output's strides and flags.
    if kind == "ScalarScalar":
        return Layout(shape, a.strides, 1, a.row, a.col, a.contiguous)
    if kind == "ScalarVector":
        return _like(b, shape)
    if kind in ("VectorScalar", "VectorVector"):
        return _like(a, shape)
    return row_major(shape)


def _binary_donors(kind: str, a: Layout, b: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
    # set_binary_op_output_data: which inputs each binary op type may donate, in MLX's order.
    if kind == "ScalarScalar":
        return ()
    if kind == "ScalarVector":
        return (1,)
    if kind == "VectorScalar":
        return (0,)
    if kind == "VectorVector":
        return (0, 1)
    size = math.prod(shape)  # General: a row-contiguous input of the output's size
    return tuple(k for k, x in enumerate((a, b)) if x.row and math.prod(x.shape) == size)


def _select_donors(inputs: list[Layout]) -> tuple[int, ...]:
    # set_ternary_op_output_data: condition, x, y in that order; outside VectorVectorVector only
    # row-contiguous ones. (The condition is bool, so the itemsize check rules it out for a float
    # output.)
    if all(i.data_size == 1 for i in inputs):
        return ()  # ScalarScalarScalar
    if all(i.row for i in inputs) or all(i.col for i in inputs):
        return (0, 1, 2)
    return tuple(k for k, x in enumerate(inputs) if x.row)


def donated_layout(donor: Layout, shape: tuple[int, ...]) -> Layout:
    """An output that took ``donor``'s buffer: MLX's ``copy_shared_buffer`` gives it the donor's
    strides, data size and flags."""
    return _like(donor, shape)


def _view(primitive: str, args: list, src: Layout, shape: tuple[int, ...]) -> Effect:
    if primitive == "Transpose":
        perm = args[0]
        strides = tuple(src.strides[p] for p in perm)
        if src.contiguous and src.data_size == math.prod(src.shape):
            lay = strided(shape, strides, src.data_size)
        else:
            lay = Layout(shape, strides, src.data_size, False, False, src.contiguous)
        return Effect("view", 0, lay)
    if primitive in ("Broadcast", "BroadcastAxes"):
        lead = len(shape) - len(src.shape)
        strides = [0] * lead
        # MLX's broadcast gives every size-1 input axis stride 0, also one that stays size 1 (a
        # trailing [K, 1] axis so broadcast is no longer BLAS-friendly: a matmul copies it).
        for i, n in enumerate(src.shape):
            strides.append(0 if n == 1 else src.strides[i])
        if math.prod(shape) == math.prod(src.shape):
            lay = Layout(shape, tuple(strides), src.data_size, src.row, src.col, src.contiguous)
        else:
            lay = Layout(shape, tuple(strides), src.data_size, False, False, False)
        return Effect("view", 0, lay)
    if primitive == "ExpandDims":
        strides = list(src.strides)
        for ax in sorted(args[0]):
            strides.insert(ax, 1)
        return Effect(
            "view",
            0,
            Layout(shape, tuple(strides), src.data_size, src.row, src.col, src.contiguous),
        )
    if primitive == "Squeeze":
        axes = set(args[0])
        strides = tuple(s for i, s in enumerate(src.strides) if i not in axes)
        return Effect(
            "view", 0, Layout(shape, strides, src.data_size, src.row, src.col, src.contiguous)
        )
    if primitive == "Slice":
        _start, _stop, steps = args
        strides = tuple(s * k for s, k in zip(src.strides, steps, strict=True))
        hi = sum(s * (n - 1) for s, n in zip(strides, shape, strict=True) if s > 0)
        lo = sum(s * (n - 1) for s, n in zip(strides, shape, strict=True) if s < 0)
        return Effect("view", 0, strided(shape, strides, hi - lo + 1))
    # StopGradient / Copy / Depends / Split / AsStrided: treat as sharing with unknown strides
    # (not row-contiguous), so any later reshape is predicted as a copy.
    return Effect(
        "view",
        0,
        Layout(
            shape,
            src.strides if len(src.strides) == len(shape) else tuple(0 for _ in shape),
            src.data_size,
            False,
            False,
            False,
        ),
    )


def _reshape_view(src: Layout, shape: tuple[int, ...]) -> Layout | None:
    """MLX's prepare_reshape: the reshaped strides when no copy is needed, else None."""
    if math.prod(src.shape) == 0 or src.row:
        return Layout(
            shape,
            row_major(shape).strides,
            src.data_size,
            src.row,
            len([n for n in shape if n != 1]) <= 1,
            src.contiguous,
        )
    if len(src.shape) == 0:
        return Layout(shape, tuple(0 for _ in shape), src.data_size, False, False, src.contiguous)
    # MLX's collapse_contiguous_dims (array overload): keep axis 0, skip later size-1 axes, merge
    # an axis into the previous one when its stride times its size equals the previous stride.
    merged = [[src.shape[0], src.strides[0]]]
    for n, s in zip(src.shape[1:], src.strides[1:], strict=True):
        if n == 1:
            continue
        if s * n != merged[-1][1] or merged[-1][0] * n > _SIZE_CAP:
            merged.append([n, s])
        else:
            merged[-1] = [merged[-1][0] * n, s]
    cshape = [m[0] for m in merged]
    cstrides = [m[1] for m in merged]
    out_strides: list[int] = []
    j = 0
    for n in shape:
        if j < len(cshape) and cshape[j] % n == 0:
            cshape[j] //= n
            out_strides.append(cshape[j] * cstrides[j])
            if cshape[j] == 1:
                j += 1
        elif n == 1:
            out_strides.append(out_strides[-1] if out_strides else 1)
        else:
            return None
    no_bsx, row, col = _contiguity(shape, tuple(out_strides))
    return Layout(shape, tuple(out_strides), src.data_size, row, col, src.contiguous)
