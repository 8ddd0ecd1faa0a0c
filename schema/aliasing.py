"""Which primitives alias an input's buffer on MLX's CPU backend: the names the compiler's memory
model (``dctms.toolkit.memory_model``) and the verifier share.

* Views (``VIEW_ALWAYS``, and ``RESHAPES`` when strides allow) always share their input's buffer.
* Donation: an elementwise op (``DONATING``) writes its output into an input's buffer when MLX may
  *donate* it. MLX decides this on the host, in the op's ``eval_cpu``, from reference counts alone
  (``array::is_donatable``: the input array and its data are each held once -- by this op), the
  input's layout and its buffer size (``is_donatable`` in mlx/backend/common/utils.h: the same
  itemsize and a buffer at most ``out.nbytes() + 16384``). Paths: common/unary.h
  ``set_unary_output_data``, common/binary.h ``set_binary_op_output_data``, common/ternary.h
  ``set_ternary_op_output_data`` (Select), common/copy.h ``set_copy_output_data`` (AsType),
  cpu/softmax.cpp.
"""

from __future__ import annotations

VIEW_ALWAYS = frozenset(
    {
        "Broadcast",
        "BroadcastAxes",
        "ExpandDims",
        "Squeeze",
        "Transpose",
        "Slice",
        "StopGradient",
        "Copy",
        "Depends",
        "AsStrided",
        "Split",
    }
)
RESHAPES = frozenset({"Reshape", "Flatten", "Unflatten"})
# Ops that write into their first input, in place when MLX may donate its buffer (a state array's
# update: toolkit.schedule.donation_cuts, rule state_in_place).
IN_PLACE = frozenset({"DynamicSliceUpdate", "SliceUpdate", "Scatter", "ScatterAxis"})
UNARY = frozenset(
    {
        "Abs",
        "ArcCos",
        "ArcCosh",
        "ArcSin",
        "ArcSinh",
        "ArcTan",
        "ArcTanh",
        "AsType",
        "Ceil",
        "Conjugate",
        "Cos",
        "Cosh",
        "Erf",
        "ErfInv",
        "Exp",
        "Expm1",
        "Floor",
        "Imag",
        "Log",
        "Log1p",
        "LogicalNot",
        "Negative",
        "Real",
        "Round",
        "Sigmoid",
        "Sign",
        "Sin",
        "Sinh",
        "Sqrt",
        "Square",
        "Tan",
        "Tanh",
    }
)
BINARY = frozenset(
    {
        "Add",
        "ArcTan2",
        "BitwiseBinary",
        "Divide",
        "DivMod",
        "Equal",
        "FloorDivide",
        "Greater",
        "GreaterEqual",
        "Less",
        "LessEqual",
        "LogAddExp",
        "LogicalAnd",
        "LogicalOr",
        "Maximum",
        "Minimum",
        "Multiply",
        "NotEqual",
        "Power",
        "Remainder",
        "Subtract",
    }
)

# Two outputs: each is set from the inputs, so an input held by the sibling is never donatable.
MULTI_OUTPUT_BINARY = frozenset({"DivMod"})
# Elementwise primitives whose CPU kernel may write into a donated input (see the module doc).
DONATING = (UNARY | BINARY | {"Select", "Softmax"}) - MULTI_OUTPUT_BINARY
# A cached buffer handed to a request of S bytes is smaller than S + 2 pages (4096-byte pages on
# the CPU allocator, common/buffer_cache.h), so a donor planned at most this much larger than the
# output is within MLX's 16384-byte donation slack even when it came from the cache.
DONATION_SLACK_BYTES = 16384 - 2 * 4096
