"""Re-create a traced MLX primitive with one ``mlx.core`` call.

The compiler stores every primitive of the traced graph as an ``Op`` (name, JSON-encoded arguments,
input ids, output ids). The runner rebuilds the graph lazily by calling :func:`apply_op` once per op,
in plan order. The rebuilt graph must have the *same structure* as the traced one (one MLX primitive
per plan op, same primitive type, same input order, same output shapes and dtypes) because the plan's
memory model was computed on that structure. So every handler below picks the ``mlx.core`` call that
creates exactly that primitive and nothing else: ``keepdims=True`` for reductions (no trailing
``Squeeze``), ``rsqrt`` for ``Sqrt [True]``, indexing with explicit slices for ``Slice``, and so on.

The argument layouts are those of the installed MLX (``Primitive::state()`` as the exporter reports
it); they are version-specific, which is why the plan records the MLX version.

MLX's fused kernels (``RMSNorm``, ``RoPE``, ``ScaledDotProductAttention``; ``schema.fast_ops``) are one
``mx.fast`` call each: one primitive on a GPU, MLX's composite on the CPU (the plan charges that
composite's intermediates to the op's scratch and checked its order at compile time).

One primitive has no single Python call: ``Gather`` is only reachable through ``mx.take``, which
always appends a ``Squeeze`` of the gathered axis. See :func:`_gather` for how the pair still comes out
1:1 when the plan's next op is that very ``Squeeze`` (the embedding lookup in every model).

This module must not import mlx-lm or ``dctms.toolkit``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from dctms.runner import collectives
from dctms.schema.errors import DctmsError
from dctms.schema.values import args_to_plain, dtype_name

Handler = Callable[[list, list[mx.array]], "mx.array | list[mx.array]"]

# --------------------------------------------------------------------------------------------------
# JSON argument encoding
# --------------------------------------------------------------------------------------------------

# Argument positions that hold a float (C++ float/double in the primitive's state): a string there
# is refused (the plan codec already turned "inf"/"-inf"/"nan" back into floats).
_FLOAT_ARGS: dict[str, tuple[int, ...]] = {
    "Arange": (0, 1, 2),  # start, stop, step
    "AddMM": (0, 1),  # alpha, beta
}


def dtype_from_name(name: str) -> mx.Dtype:
    """Inverse of :func:`dtype_name`; raises :class:`DctmsError` for an unknown name."""
    value = getattr(mx, name, None)
    if not isinstance(value, mx.Dtype):
        value = getattr(mx, name + "_", None)  # "bool" is spelled mx.bool_
    if not isinstance(value, mx.Dtype):
        raise DctmsError(f"unknown dtype {name!r} (mlx {mx.__version__})")
    return value


def args_from_json(args: list, primitive: str | None = None) -> list:
    """Inverse of :func:`args_to_plain`: ``{"dtype": name}`` becomes an ``mx.Dtype`` anywhere.

    The float positions of ``primitive`` must hold numbers (a string argument elsewhere may
    legitimately be a string, e.g. a quantisation mode). Decoding decoded arguments is a no-op.
    """

    def dec(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [dec(v) for v in value]
        if isinstance(value, dict) and set(value) == {"dtype"}:
            return dtype_from_name(value["dtype"])
        return value

    out = [dec(a) for a in args]
    for i in _FLOAT_ARGS.get(primitive or "", ()):
        if i < len(out) and isinstance(out[i], str):
            raise DctmsError(f"{primitive}: argument {i} is {out[i]!r}, expected a number")
    return out


# --------------------------------------------------------------------------------------------------
# Handlers: handler(args, inputs) -> output array (or list of arrays for multi-output primitives).
# Binary handlers receive inputs that the tracer already broadcast and promoted, so the mlx.core
# call adds no Broadcast/AsType of its own.
# --------------------------------------------------------------------------------------------------


def _unary(fn: Callable[[mx.array], mx.array]) -> Handler:
    return lambda args, x: fn(x[0])


def _binary(fn: Callable[[mx.array, mx.array], mx.array]) -> Handler:
    return lambda args, x: fn(x[0], x[1])


_ELEMENTWISE: dict[str, Handler] = {
    # unary
    "Abs": _unary(mx.abs),
    "ArcCos": _unary(mx.arccos),
    "ArcCosh": _unary(mx.arccosh),
    "ArcSin": _unary(mx.arcsin),
    "ArcSinh": _unary(mx.arcsinh),
    "ArcTan": _unary(mx.arctan),
    "ArcTanh": _unary(mx.arctanh),
    "Ceil": _unary(mx.ceil),
    "Conjugate": _unary(mx.conjugate),
    "Cos": _unary(mx.cos),
    "Cosh": _unary(mx.cosh),
    "Erf": _unary(mx.erf),
    "ErfInv": _unary(mx.erfinv),
    "Exp": _unary(mx.exp),
    "Expm1": _unary(mx.expm1),
    "Floor": _unary(mx.floor),
    "Imag": _unary(mx.imag),
    "Log1p": _unary(mx.log1p),
    "LogicalNot": _unary(mx.logical_not),
    "Negative": _unary(mx.negative),
    "Real": _unary(mx.real),
    "Round": _unary(mx.round),  # decimals=0: a single Round
    "Sigmoid": _unary(mx.sigmoid),
    "Sign": _unary(mx.sign),
    "Sin": _unary(mx.sin),
    "Sinh": _unary(mx.sinh),
    "Square": _unary(mx.square),
    "StopGradient": _unary(mx.stop_gradient),
    # the first input, evaluated after the others (a batched plan's slot move orders its rows so)
    "Depends": lambda a, x: mx.depends(x[0], x[1:]),
    "Tan": _unary(mx.tan),
    "Tanh": _unary(mx.tanh),
    # [base]: Log::Base {two, ten, e}
    "Log": lambda a, x: (mx.log2, mx.log10, mx.log)[a[0]](x[0]),
    # [recip]: True is rsqrt
    "Sqrt": lambda a, x: (mx.rsqrt if a[0] else mx.sqrt)(x[0]),
    # binary
    "Add": _binary(mx.add),
    "ArcTan2": _binary(mx.arctan2),
    "Divide": _binary(mx.divide),
    "FloorDivide": _binary(mx.floor_divide),
    "Greater": _binary(mx.greater),
    "GreaterEqual": _binary(mx.greater_equal),
    "Less": _binary(mx.less),
    "LessEqual": _binary(mx.less_equal),
    "LogAddExp": _binary(mx.logaddexp),
    "LogicalAnd": _binary(mx.logical_and),
    "LogicalOr": _binary(mx.logical_or),
    "Maximum": _binary(mx.maximum),
    "Minimum": _binary(mx.minimum),
    "Multiply": _binary(mx.multiply),
    "NotEqual": _binary(mx.not_equal),
    "Power": _binary(mx.power),
    "Remainder": _binary(mx.remainder),
    "Subtract": _binary(mx.subtract),
    # [op]: BitwiseBinary::Op {And, Or, Xor, LeftShift, RightShift}
    "BitwiseBinary": lambda a, x: (
        mx.bitwise_and,
        mx.bitwise_or,
        mx.bitwise_xor,
        mx.left_shift,
        mx.right_shift,
    )[a[0]](x[0], x[1]),
    "DivMod": lambda a, x: list(mx.divmod(x[0], x[1])),  # two outputs: quotient, remainder
    "Select": lambda a, x: mx.where(x[0], x[1], x[2]),  # inputs: condition, x, y
}


def _equal(args: list, x: list[mx.array]) -> mx.array:
    # [equal_nan]; only array_equal(equal_nan=True) makes the True form, and it appends a Reduce.
    if args and args[0]:
        raise DctmsError(f"unsupported primitive Equal [equal_nan=True] (mlx {mx.__version__})")
    return mx.equal(x[0], x[1])


# --- reductions, scans, sorting -------------------------------------------------------------------

# Reduce::ReduceType {And, Or, Sum, Prod, Min, Max}
_REDUCE = (mx.all, mx.any, mx.sum, mx.prod, mx.min, mx.max)
# Scan::ReduceType {Max, Min, Sum, Prod, LogAddExp}
_SCAN = (mx.cummax, mx.cummin, mx.cumsum, mx.cumprod, mx.logcumsumexp)

_REDUCTIONS: dict[str, Handler] = {
    # [type, axes]; keepdims=True because the trace's Reduce keeps them (a Squeeze is its own op)
    "Reduce": lambda a, x: _REDUCE[a[0]](x[0], axis=list(a[1]), keepdims=True),
    # [type, axis]: ArgReduce::ReduceType {ArgMin, ArgMax}
    "ArgReduce": lambda a, x: (mx.argmin, mx.argmax)[a[0]](x[0], axis=a[1], keepdims=True),
    "LogSumExp": lambda a, x: mx.logsumexp(x[0], axis=-1, keepdims=True),  # always the last axis
    "Softmax": lambda a, x: mx.softmax(x[0], axis=-1, precise=bool(a[0])),  # [precise], last axis
    # [type, axis, reverse, inclusive]
    "Scan": lambda a, x: _SCAN[a[0]](x[0], axis=a[1], reverse=bool(a[2]), inclusive=bool(a[3])),
    "Sort": lambda a, x: mx.sort(x[0], axis=a[0]),  # [axis]
    "ArgSort": lambda a, x: mx.argsort(x[0], axis=a[0]),  # [axis]
    "Partition": lambda a, x: mx.partition(x[0], a[0], axis=a[1]),  # [kth, axis]
    "ArgPartition": lambda a, x: mx.argpartition(x[0], a[0], axis=a[1]),  # [kth, axis]
}

# --- shape and layout -----------------------------------------------------------------------------


def _slices(start: Sequence[int], stop: Sequence[int], strides: Sequence[int]) -> tuple:
    # Python indexing with explicit slices passes (start, stop, step) to mx::slice unchanged; the
    # state's start/stop/strides are already normalised, and normalising them again is a no-op.
    return tuple(slice(b, e, s) for b, e, s in zip(start, stop, strides, strict=True))


def _slice(args: list, x: list[mx.array]) -> mx.array:
    return x[0][_slices(*args)]  # [start, stop, strides]


# SliceUpdate::ReduceType {Max, Min, Sum, Prod, None}; the reducing forms go through ``.at[]``.
_SLICE_UPDATE_AT = ("maximum", "minimum", "add", "multiply")
_SLICE_UPDATE_NONE = 4


def _slice_update(args: list, x: list[mx.array]) -> mx.array:
    mode, start, stop, strides = args  # inputs: src, update (already of the slice's shape)
    index = _slices(start, stop, strides)
    if mode == _SLICE_UPDATE_NONE:  # plain assignment
        # __setitem__ rebinds the Python object it is called on, so call it on a fresh handle:
        # broadcast_to to the array's own shape returns the same array without adding a primitive.
        out = mx.broadcast_to(x[0], x[0].shape)
        out[index] = x[1]
        return out
    return getattr(x[0].at[index], _SLICE_UPDATE_AT[mode])(x[1])


def _as_type(args: list, x: list[mx.array]) -> mx.array:
    (dtype,) = args
    if x[0].dtype == dtype:
        # AsType to the same dtype is a copy; astype() would return the input without a primitive.
        return mx.array(x[0], dtype=dtype)
    return x[0].astype(dtype)


def _pad(args: list, x: list[mx.array]) -> mx.array:
    axes, low, high = args  # inputs: array, pad value (0-d)
    width = [(0, 0)] * x[0].ndim
    for ax, lo, hi in zip(axes, low, high, strict=True):
        width[ax] = (lo, hi)
    return mx.pad(x[0], width, mode="constant", constant_values=x[1])


_SHAPE: dict[str, Handler] = {
    "Broadcast": lambda a, x: mx.broadcast_to(x[0], tuple(a[0])),  # [shape]
    "Reshape": lambda a, x: mx.reshape(x[0], tuple(a[0])),  # [shape], may hold -1
    "Transpose": lambda a, x: mx.transpose(x[0], list(a[0])),  # [axes]
    "Squeeze": lambda a, x: _squeeze(list(a[0]), x[0]),  # [axes]
    "ExpandDims": lambda a, x: mx.expand_dims(x[0], list(a[0])),  # [axes]
    "Flatten": lambda a, x: mx.flatten(x[0], a[0], a[1]),  # [start_axis, end_axis]
    "Unflatten": lambda a, x: mx.unflatten(x[0], a[0], tuple(a[1])),  # [axis, shape]
    "Concatenate": lambda a, x: mx.concatenate(x, axis=a[0]),  # [axis]
    "Split": lambda a, x: list(mx.split(x[0], list(a[0]), axis=a[1])),  # [indices, axis]
    "Slice": _slice,
    "SliceUpdate": _slice_update,
    # [axes, slice_size]; inputs: array, start (1-d integer array, one entry per axis)
    "DynamicSlice": lambda a, x: mx.slice(x[0], x[1], list(a[0]), list(a[1])),
    # [axes]; inputs: array, update, start
    "DynamicSliceUpdate": lambda a, x: mx.slice_update(x[0], x[1], x[2], list(a[0])),
    "AsType": _as_type,
    "View": lambda a, x: x[0].view(a[0]),  # [dtype]
    "Pad": _pad,
}


# --- gather ---------------------------------------------------------------------------------------

# Gather outputs handed out by _gather, by id(): the mx.take result that already holds the Squeeze the
# plan's next op asks for, and that Squeeze's axis. An entry lives exactly as long as its Gather
# output (weakref.finalize), so it never extends a tensor's lifetime.
_GATHER_SQUEEZE: dict[int, tuple[mx.array, int]] = {}


def _gather(args: list, x: list[mx.array]) -> mx.array:
    """``Gather [axes, slice_sizes]`` for the one form Python can create: ``mx.take(a, i, axis=0)``.

    ``mx.take`` builds ``Squeeze(Gather(a, i))`` and Python cannot reach the inner array. We return an
    ``ExpandDims`` view of the take result as the Gather output and remember the take result: when the
    plan's next op is the matching ``Squeeze`` (it always is for ``take``), :func:`_squeeze` returns the
    remembered array, so the graph that is evaluated is exactly Gather -> Squeeze, and the ExpandDims
    view stays dangling. Any other consumer of the Gather output reads the (correct) view.
    """
    axes, slice_sizes = list(args[0]), list(args[1])
    src, indices = x[0], x[1:]
    if len(indices) != 1 or axes != [0] or slice_sizes != [1, *src.shape[1:]]:
        raise DctmsError(
            f"unsupported primitive Gather [axes={axes}, slice_sizes={slice_sizes}] with "
            f"{len(indices)} index array(s): only mx.take(a, i, axis=0) maps 1:1 (mlx {mx.__version__})"
        )
    axis = indices[0].ndim  # where the gathered singleton dimension sits in Gather's output
    taken = mx.take(src, indices[0], axis=0)
    out = mx.expand_dims(taken, axis)
    key = id(out)
    _GATHER_SQUEEZE[key] = (taken, axis)
    weakref.finalize(out, _GATHER_SQUEEZE.pop, key, None)
    return out


def _squeeze(axes: list[int], x: mx.array) -> mx.array:
    pending = _GATHER_SQUEEZE.get(id(x))
    if pending is not None:
        taken, axis = pending
        if [a % x.ndim for a in axes] == [axis]:
            return taken
    return mx.squeeze(x, axes)


def _scatter_axis(args: list, x: list[mx.array]) -> mx.array:
    # [reduce, axis]: ScatterAxis::ReduceType {Sum, None}; inputs: array, indices, values.
    # Only put_along_axis (None) has a Python call.
    if args[0] != 1:
        raise DctmsError(f"unsupported primitive ScatterAxis [Sum] (mlx {mx.__version__})")
    return mx.put_along_axis(x[0], x[1], x[2], axis=args[1])


def _scatter(args: list, x: list[mx.array]) -> mx.array:
    """``Scatter [reduce, axes]`` for the form Python's item assignment creates: indices on the
    leading axes, reduce None (a batched decode's KV write, ``toolkit.slots``). ``a[i0, i1, ..] =
    u`` builds Squeeze / Reshape views of the updates and one Scatter; ``mx.array(src)`` is a new
    handle on the source without a primitive, so the caller's array is not rewritten."""
    reduce, axes = args[0], list(args[1])
    src, indices, updates = x[0], x[1:-1], x[-1]
    k = len(indices)
    if reduce != 4 or axes != list(range(k)) or k == 0:
        raise DctmsError(
            f"unsupported primitive Scatter [reduce={reduce}, axes={axes}]: only item assignment "
            f"on leading axes maps 1:1 (mlx {mx.__version__})"
        )
    out = mx.array(src)
    slice_axes = tuple(range(updates.ndim - src.ndim, updates.ndim - src.ndim + k))
    out[tuple(indices)] = mx.squeeze(updates, slice_axes)
    return out


_GATHERS: dict[str, Handler] = {
    "Gather": _gather,
    "GatherAxis": lambda a, x: mx.take_along_axis(x[0], x[1], axis=a[0]),  # [axis]
    "ScatterAxis": _scatter_axis,
    "Scatter": _scatter,
}


# --- creation and linear algebra ------------------------------------------------------------------

# QuantizedMatmul's mode as the exporter gives it: QuantizationMode {Affine, Mxfp4, Mxfp8, Nvfp4}
_QUANT_MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")


def _quantized_matmul(args: list, x: list[mx.array]) -> mx.array:
    group_size, bits, mode, transpose = args  # inputs: x, w, scales[, biases (affine only)]
    mode = mode if isinstance(mode, str) else _QUANT_MODES[mode]
    biases = x[3] if len(x) > 3 else None
    return mx.quantized_matmul(
        x[0],
        x[1],
        x[2],
        biases,
        transpose=bool(transpose),
        group_size=group_size,
        bits=bits,
        mode=mode,
    )


def _quantize(args: list, x: list[mx.array]) -> list[mx.array]:
    # fast::Quantize [group_size, bits, mode, dequantize]: a quantised KV cache's writes
    # (mx.quantize: packed words, scales, biases).
    group_size, bits, mode, dequantize = args
    mode = mode if isinstance(mode, str) else _QUANT_MODES[mode]
    if dequantize or mode != "affine":
        raise DctmsError(f"unsupported primitive Quantize {args_to_plain(args)} (mlx {mx.__version__})")
    return list(mx.quantize(x[0], group_size=group_size, bits=bits, mode=mode))


def _random_bits(args: list, x: list[mx.array]) -> mx.array:
    # [shape, width]; input: one key. Only mx.random.split makes it from Python: shape (n, 2),
    # 4-byte words (a sampling plan's key split; its draw's bits are elementwise ops).
    shape, width = list(args[0]), args[1]
    if len(shape) != 2 or shape[1] != 2 or width != 4 or tuple(x[0].shape) != (2,):
        raise DctmsError(
            f"unsupported primitive RandomBits [{shape}, {width}]: only mx.random.split's "
            f"(n, 2) keys map 1:1 (mlx {mx.__version__})"
        )
    return mx.random.split(x[0], shape[0])


_RANDOM: dict[str, Handler] = {
    "RandomBits": _random_bits,
    # [right]; inputs: a sorted 1-d array, the values (a sampling plan's categorical draw)
    "SearchSorted": lambda a, x: mx.searchsorted(x[0], x[1], side="right" if a[0] else "left"),
}


_CREATION: dict[str, Callable[[list, list[mx.array], tuple, mx.Dtype], mx.array]] = {
    # [start, stop, step]; the dtype is the output's
    "Arange": lambda a, x, shape, dtype: mx.arange(a[0], a[1], a[2], dtype=dtype),
    # no arguments; the input is already broadcast to the output shape and cast to its dtype
    "Full": lambda a, x, shape, dtype: mx.full(shape, x[0], dtype=dtype),
}


def _gather_indices(
    left_sorted: bool, right_sorted: bool, lhs: mx.array, rhs: mx.array
) -> tuple[mx.array | None, mx.array | None, bool]:
    """Map GatherMM/GatherQMM's sorted flags back to the Python call that sets them.

    ``sorted_indices=True`` sets ``right_sorted`` only when ``lhs_indices`` is omitted (and
    ``left_sorted`` only when ``rhs_indices`` is). The omitted side is then the default index array
    (an ``Arange`` op, already in the plan) that mlx.core re-creates itself: the plan's copy is left
    unread, so the evaluated graph is the traced one.
    """
    if left_sorted and right_sorted:
        raise DctmsError(f"unsupported gather matmul with both sides sorted (mlx {mx.__version__})")
    if right_sorted:
        return None, rhs, True
    if left_sorted:
        return lhs, None, True
    return lhs, rhs, False


def _gather_mm(args: list, x: list[mx.array]) -> mx.array:
    # [left_sorted, right_sorted]; inputs: a, b, lhs_indices, rhs_indices (already broadcast)
    lhs, rhs, sort = _gather_indices(*args, x[2], x[3])
    return mx.gather_mm(x[0], x[1], lhs, rhs, sorted_indices=sort)


def _gather_qmm(args: list, x: list[mx.array]) -> mx.array:
    # [group_size, bits, mode, transpose, left_sorted, right_sorted];
    # inputs: x, w, scales[, biases (affine only)], lhs_indices, rhs_indices
    group_size, bits, mode, transpose, left_sorted, right_sorted = args
    mode = mode if isinstance(mode, str) else _QUANT_MODES[mode]
    biases = x[3] if len(x) == 6 else None
    lhs, rhs, sort = _gather_indices(left_sorted, right_sorted, x[-2], x[-1])
    return mx.gather_qmm(
        x[0],
        x[1],
        x[2],
        biases,
        lhs,
        rhs,
        transpose=bool(transpose),
        group_size=group_size,
        bits=bits,
        mode=mode,
        sorted_indices=sort,
    )


def _convolution(args: list, x: list[mx.array]) -> mx.array:
    # [strides, padding_lo, padding_hi, kernel_dilation, input_dilation, groups, flip];
    # inputs: input (N, ..., C), weight (O, ..., C)
    strides, lo, hi, kernel_dilation, input_dilation, groups, flip = args
    return mx.conv_general(
        x[0],
        x[1],
        stride=list(strides),
        padding=(list(lo), list(hi)),
        kernel_dilation=list(kernel_dilation),
        input_dilation=list(input_dilation),
        groups=groups,
        flip=bool(flip),
    )


_LINALG: dict[str, Handler] = {
    "Convolution": _convolution,
    "Matmul": _binary(mx.matmul),
    # [alpha, beta]; inputs: a, b, c (the addend last) -> alpha * a @ b + beta * c
    "AddMM": lambda a, x: mx.addmm(x[2], x[0], x[1], alpha=a[0], beta=a[1]),
    "QuantizedMatmul": _quantized_matmul,
    "Quantize": _quantize,
    "GatherMM": _gather_mm,  # mixture-of-experts matmuls
    "GatherQMM": _gather_qmm,
}

def _rms_norm(args: list, x: list[mx.array]) -> mx.array:
    # fast::RMSNorm [eps]; inputs: x, weight. On the CPU MLX runs its composite (the plan charges it).
    return mx.fast.rms_norm(x[0], x[1], float(args[0]))


def _rope(args: list, x: list[mx.array]) -> mx.array:
    # fast::RoPE [dims, traditional, base, scale, forward]; inputs: x, offset (int32)[, freqs
    # (float32, dims / 2; then MLX ignores base)]
    dims, traditional, base, scale, forward = args
    if not forward:
        raise DctmsError(f"unsupported primitive RoPE {args_to_plain(args)}: the inverse rotation")
    freqs = x[2] if len(x) > 2 else None
    return mx.fast.rope(
        x[0], int(dims), traditional=bool(traditional),
        base=None if freqs is not None else float(base), scale=float(scale), offset=x[1],
        freqs=freqs,
    )  # fmt: skip


def _sdpa(args: list, x: list[mx.array]) -> mx.array:
    # fast::ScaledDotProductAttention [scale, do_causal, has_sinks, output_logsumexp];
    # inputs: q, k, v[, the mask broadcast to (B, n_q_heads, L, S)]
    scale, causal, sinks, logsumexp = args
    if sinks or logsumexp:
        raise DctmsError(f"unsupported primitive ScaledDotProductAttention {args_to_plain(args)}")
    mask = x[3] if len(x) > 3 else ("causal" if causal else None)
    return mx.fast.scaled_dot_product_attention(x[0], x[1], x[2], scale=float(scale), mask=mask)


# MLX's fused kernels (schema.fast_ops): one mx.fast call each.
_FAST: dict[str, Handler] = {
    "RMSNorm": _rms_norm,
    "RoPE": _rope,
    "ScaledDotProductAttention": _sdpa,
}

_CREATION.update(collectives.CREATION)

_HANDLERS: dict[str, Handler] = {
    **_ELEMENTWISE,
    "Equal": _equal,
    **_REDUCTIONS,
    **_SHAPE,
    **_GATHERS,
    **_LINALG,
    **_RANDOM,
    **_FAST,
    **collectives.HANDLERS,  # a rank's plan (mlx.distributed)
}

SUPPORTED: frozenset[str] = frozenset(_HANDLERS) | frozenset(_CREATION)


def apply_op(
    primitive: str,
    args: list,
    inputs: list[mx.array],
    out_shapes: Sequence[Sequence[int]],
    out_dtypes: Sequence[mx.Dtype | str],
) -> list[mx.array]:
    """Create the outputs of one traced primitive from its inputs, lazily, with one mlx.core call.

    ``args`` may be JSON-encoded (see :func:`args_from_json`) or as the export callback gives them.
    ``out_shapes``/``out_dtypes`` are the traced outputs'; some primitives need them (``Arange``,
    ``Full``) and every result is checked against them.
    """
    if primitive not in SUPPORTED:
        raise DctmsError(f"unsupported primitive {primitive} (mlx {mx.__version__})")
    args = args_from_json(args, primitive)
    dtypes = [d if isinstance(d, mx.Dtype) else dtype_from_name(d) for d in out_dtypes]
    shapes = [tuple(s) for s in out_shapes]
    try:
        if primitive in _CREATION:  # needs the output's shape/dtype
            outs = [_CREATION[primitive](args, list(inputs), shapes[0], dtypes[0])]
        else:
            out = _HANDLERS[primitive](args, list(inputs))
            outs = out if isinstance(out, list) else [out]
    except (IndexError, KeyError, TypeError, ValueError, RuntimeError, OverflowError) as err:
        # wrong input count, an enum value out of range, arguments MLX rejects, ...
        raise DctmsError(f"{primitive} {args_to_plain(args)}: {err}") from err
    got = [(tuple(o.shape), o.dtype) for o in outs]
    want = list(zip(shapes, dtypes, strict=False))  # a length mismatch is caught below
    if got != want or len(shapes) != len(dtypes):
        raise DctmsError(
            f"{primitive} {args_to_plain(args)} produced "
            f"{[(s, dtype_name(d)) for s, d in got]}, the plan says {[(s, dtype_name(d)) for s, d in want]}"
        )
    return outs
