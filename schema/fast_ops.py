"""MLX's fused kernels as plan ops: ``RMSNorm``, ``RoPE``, ``ScaledDotProductAttention``.

A plan op of one of these names is one ``mx.fast`` call (``toolkit.fused_kernels`` finds MLX's
composite of each in the CPU trace and substitutes it; the runner calls ``mx.fast.*``). Its
arguments are the primitive's own ``state()`` as MLX's exporter gives it (mlx/fast_primitives.h,
v0.32.1, the leading nullptr dropped), so a plan traced natively on a GPU would agree:

* ``RMSNorm [eps]``; inputs ``x, weight`` (fast_primitives.h:67-69);
* ``RoPE [dims, traditional, base, scale, forward]``; inputs ``x, offset`` (int32, a scalar or one
  per batch row) and, for a rotation of given frequencies (llama3 scaling), ``freqs`` (float32,
  ``dims / 2``; base is then recorded as 1.0 and unused, fast.cpp:538-556)
  (fast_primitives.h:194-197);
* ``ScaledDotProductAttention [scale, do_causal, has_sinks, output_logsumexp]``; inputs
  ``q, k, v`` and, for an array mask, the mask broadcast to ``[B, n_q_heads, L, S]``
  (fast_primitives.h:252-255; the broadcast is made before the primitive, fast.cpp:806-808).

What one costs besides its output (``scratch_buffers``): on the CPU ``mx.fast`` falls back to the
composite (``use_fallback`` is true for every CPU stream, fast.cpp:113, 520, 828;
metal/scaled_dot_product_attention.cpp:609), whose intermediates are buffers of their own, all
counted as live at once; on a GPU the kernel's own temporaries (contiguous copies of inputs it
needs in another layout, the two-pass attention's partial results,
mlx/backend/metal/scaled_dot_product_attention.cpp:492-509) -- or the composite, where the kernel
does not take the shapes. The verifier requires a
fused op's ``scratch`` to be at least this (``rules_fused``), so a plan cannot claim less.
"""

from __future__ import annotations

import math

from dctms.schema.sizes import ITEMSIZE
from dctms.schema.targets import counted
from dctms.schema.types import MemoryModel

RMS_NORM = "RMSNorm"
ROPE = "RoPE"
SDPA = "ScaledDotProductAttention"
FUSED = frozenset({RMS_NORM, ROPE, SDPA})

Shape = tuple[int, ...]

# Scalars each composite makes for itself (eps and 1/N; scale and log(base)/half; scale and the
# dtype's lowest value), 4 bytes at most each, counted with its intermediates.
_SCALARS = 2 * 8


def out_shape(prim: str, args: list, ins: list[Shape]) -> Shape:
    """The output shape of a fused op (its inputs' shapes as the checks below allow them)."""
    if prim in (RMS_NORM, ROPE):
        return ins[0]
    q, v = ins[0], ins[2]
    return (*q[:-1], v[-1])


def problem(prim: str, args: list, ins: list[Shape], dtypes: list[str]) -> str | None:
    """Why MLX's ``mx.fast`` call would refuse these arguments and inputs (fast.cpp's own checks),
    or None."""
    floats = dtypes and all(d in ("float16", "bfloat16", "float32") for d in dtypes[:1])
    if prim == RMS_NORM:
        if len(args) != 1 or type(args[0]) is not float or not args[0] > 0 or math.isinf(args[0]):
            return f"arguments {args!r}: RMSNorm takes [eps], eps a positive float"
        if len(ins) != 2 or not ins[0] or ins[1] != ins[0][-1:]:
            return f"inputs {[list(s) for s in ins]}: RMSNorm takes x and a weight of x's last axis"
        return None if floats else f"x is {dtypes[0] if dtypes else '?'}, not a float"
    if prim == ROPE:
        if len(args) != 5 or [type(a) for a in args] != [int, bool, float, float, bool]:
            return (
                f"arguments {args!r}: RoPE takes [dims (int), traditional (bool), base (float), "
                "scale (float), forward (bool)]"
            )
        dims = args[0]
        if len(ins) not in (2, 3) or len(ins[0]) < 3:
            return (
                f"inputs {[list(s) for s in ins]}: RoPE takes x (3 or more axes), an offset "
                "and optionally freqs"
            )
        if len(ins) == 3 and (
            tuple(ins[2]) != (dims // 2,) or (len(dtypes) > 2 and dtypes[2] != "float32")
        ):
            return f"freqs {list(ins[2])} {dtypes[2] if len(dtypes) > 2 else '?'}: float32 of dims / 2"
        if dims <= 0 or dims % 2 or dims > ins[0][-1]:
            return f"dims {dims}: positive, even and at most x's last axis {ins[0][-1]}"
        if len(ins[1]) > 1 or math.prod(ins[1]) not in (1, ins[0][0]):
            return f"offset {list(ins[1])}: a scalar or one per batch row"
        if len(dtypes) > 1 and dtypes[1] != "int32":
            return f"offset is {dtypes[1]}, not int32"
        return None if floats else f"x is {dtypes[0] if dtypes else '?'}, not a float"
    if prim == SDPA:
        if (
            len(args) != 4
            or type(args[0]) is not float
            or any(type(a) is not bool for a in args[1:])
        ):
            return (
                f"arguments {args!r}: ScaledDotProductAttention takes [scale (float), do_causal, "
                "has_sinks, output_logsumexp (bools)]"
            )
        if args[2] or args[3]:
            return "attention sinks and log-sum-exp outputs are not supported"
        if len(ins) not in (3, 4) or any(len(s) != 4 for s in ins[:3]):
            return f"inputs {[list(s) for s in ins]}: q, k, v of 4 axes and an optional mask"
        q, k, v = ins[:3]
        if k[0] != q[0] or v[0] != q[0] or k[-1] != q[-1] or v[1] != k[1] or v[2] != k[2]:
            return f"q {list(q)}, k {list(k)}, v {list(v)} do not fit together"
        if k[1] == 0 or q[1] % k[1]:
            return f"{q[1]} query heads are not a multiple of {k[1]} key heads"
        if len(ins) == 4 and (args[1] or ins[3] != (*q[:-1], k[2])):
            return (
                f"mask {list(ins[3])}: broadcast to {[*q[:-1], k[2]]}, and no causal flag with it"
            )
        return None if floats else f"q is {dtypes[0] if dtypes else '?'}, not a float"
    return f"{prim} is not a fused kernel"


def scratch_bytes(
    model: MemoryModel | None,
    prim: str,
    ins: list[Shape],
    dtypes: list[str],
    args: list,
    copies: list[bool] | None = None,
) -> int:
    """The scratch a fused op is charged: its buffers (``scratch_buffers``), each as the target's
    allocator counts it (``schema.targets.counted``; the CPU's counts the request)."""
    target = model.name if model is not None else "cpu"
    sizes = scratch_buffers(target, prim, ins, dtypes, args, copies)
    return sum(counted(model, n) if model is not None else n for n in sizes if n > 0)


def scratch_buffers(
    target: str,
    prim: str,
    ins: list[Shape],
    dtypes: list[str],
    args: list,
    copies: list[bool] | None = None,
) -> list[int]:
    """Sizes of the buffers one call may hold at once besides its output on ``target``.

    ``cpu``: the fallback's intermediates. ``metal``: the kernel's, where MLX takes the kernel for
    these shapes (every fast kernel but attention always; attention per ``use_fallback``,
    metal/scaled_dot_product_attention.cpp:596-646), else the fallback's; ``copies`` says which
    inputs the kernel copies to a contiguous layout (the compiler knows the layouts; None: none,
    the least the verifier can require). ``cuda``: the larger of the fallback's and a kernel's that
    copies every input (its use_fallback and cuDNN's own workspace are not modelled)."""
    fallback = _fallback(prim, ins, dtypes, args)
    if target == "cpu":
        return fallback
    if target == "metal":
        if prim == SDPA and not metal_sdpa_kernel(ins, args):
            return fallback
        return _kernel(prim, ins, dtypes, copies or [False] * len(ins))
    kernel = _kernel(prim, ins, dtypes, [True] * len(ins))
    return fallback if sum(fallback) >= sum(kernel) else kernel


def metal_sdpa_kernel(ins: list[Shape], args: list) -> bool:
    """Whether Metal runs attention of these shapes as its kernel (``use_fallback`` false,
    metal/scaled_dot_product_attention.cpp:617-646), not the composite."""
    q, k, v = ins[:3]
    qd, vd, lq, s, gqa = q[-1], v[-1], q[2], k[2], q[1] // max(k[1], 1)
    array_mask, causal = len(ins) > 3, bool(args[1])
    vector_head = (qd == vd and qd in (64, 96, 128, 256)) or (qd == 192 and vd == 128)
    full_head = qd == vd and qd in (64, 72, 80, 96, 128)
    full_mask = not (array_mask or causal) or array_mask or (lq <= s and causal)
    full = lq > 8 and full_mask and full_head
    vector = lq <= 8 and lq <= s and vector_head and lq * gqa <= 32
    return full or vector


def _n(shape: Shape, itemsize: int) -> int:
    return math.prod(shape) * itemsize


def _fallback(prim: str, ins: list[Shape], dtypes: list[str], args: list) -> list[int]:
    """The composite's intermediates, from its code (mlx/fast.cpp, v0.32.1), each counted as a
    buffer (a view counted too where it might be a copy)."""
    it = ITEMSIZE[dtypes[0]]
    x = ins[0]
    if prim == RMS_NORM:  # fast.cpp:90-106: astype f32, square, mean (sum, * 1/N), + eps, rsqrt, *
        x32, rows = _n(x, 4), math.prod(x[:-1]) * 4
        cast_in = x32 if dtypes[0] != "float32" else 0
        cast_out = _n(x, it) if dtypes[0] != "float32" else 0
        return [cast_in, x32, rows, rows, rows, rows, x32, cast_out, _SCALARS]
    if prim == ROPE:  # fast.cpp:434-518
        dims = args[0]
        half = dims // 2
        t = x[-2]
        lead = math.prod(x[:-2])  # B x N (x of 3 axes gets N = 1; of more, N is flattened)
        part = lead * t * half * it
        whole = _n(x, it)
        tables = [t * 4] * 3 + [half * 4] * 3 + [t * half * 4] * 3  # positions, inv_freqs, angles
        casts = [t * half * it] * 2 if dtypes[0] != "float32" else []
        # x1 cos, x2 sin, their difference, x1 sin, x2 cos, their sum; a concatenation (traditional)
        # and a flattening copy (x of more than 4 axes) counted whole each.
        return [*tables, *casts, *[part] * 6, whole, whole, 4, _SCALARS]
    # SDPA, fast.cpp:717-824: q * scale; q @ k^T with k (and later v) broadcast over the query
    # heads of a group (copied by the matmul where not contiguous); the mask applied; softmax;
    # probabilities @ v (the output).
    q, k, v = ins[:3]
    b, hq, lq, d = q
    s = k[2]
    scores = b * hq * lq * s * it
    mask = ins[3] if len(ins) > 3 else None
    out = [_n(q, it), _n(q, it), b * hq * s * d * it, scores, scores, scores, scores]
    out.append(b * hq * s * v[-1] * it)
    if mask is not None:
        out.append(_n(mask, ITEMSIZE[dtypes[3]]))  # an unflattened mask may copy
    causal = len(args) > 1 and args[1] is True
    if causal:
        out += [lq * 4, s * 4, lq * s]  # the two aranges and the comparison
    return [*out, _SCALARS]


def _kernel(prim: str, ins: list[Shape], dtypes: list[str], copies: list[bool]) -> list[int]:
    """The GPU kernel's own buffers: a contiguous copy of each input in ``copies``; for attention
    of at most 8 query rows over 1024 keys or more (the vector kernel's two-pass form on the
    larger Apple GPUs, metal/scaled_dot_product_attention.cpp:692, 753-757) its partial outputs,
    row sums and maxima ([*out[:-1], blocks, D] in q's dtype and two [*out[:-1], blocks] float32,
    492-509)."""
    if prim != SDPA:  # a strided x is copied into the output itself (metal normalization.cpp:24-45,
        return []  # rope.cpp:44-50; cuda likewise: the larger fallback is what cuda charges)
    out = [_n(s, ITEMSIZE[d]) for s, d, c in zip(ins, dtypes, copies, strict=False) if c]
    q, k, v = ins[:3]
    if q[2] <= 8 and k[2] >= 1024:
        rows = q[0] * q[1] * q[2]
        blocks = _max_blocks(k[2], (q[1] // max(k[1], 1)) * q[2])
        out += [rows * blocks * v[-1] * ITEMSIZE[dtypes[0]], rows * blocks * 4, rows * blocks * 4]
    return out


def _max_blocks(n: int, n_simds: int) -> int:
    """The most blocks ``sdpa_vector_2pass`` splits ``n`` keys into on any Apple GPU class
    (metal/scaled_dot_product_attention.cpp:448-479; MLX_SDPA_BLOCKS not set)."""
    big = 64  # class 's' (Max)
    if n > 1024 and n_simds > 4:
        big = 128 if n <= 8192 else 256 if n <= 32768 else 512 if n <= 65536 else 1024
    ultra = 128  # class 'd' (Ultra)
    if n_simds <= 2 and n > 8192:
        ultra = 256
    elif n_simds >= 6:
        ultra = 512 if 16384 <= n < 65536 else 1024 if n >= 65536 else 128
    other = 64 if n_simds >= 4 else 32
    return max(big, ultra, other)
