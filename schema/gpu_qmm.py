"""What a quantised matmul's GPU kernels allocate besides their output, from MLX's source (v0.32.1).

**Metal** (mlx/backend/metal/quantized.cpp). ``QuantizedMatmul::eval_gpu`` (1781-1877) picks a
kernel from the shapes: with ``M`` rows of ``K`` against ``N`` outputs, a transposed weight (every
mlx-lm ``Linear``) and ``M`` at or above the device's qmv batch limit, an unbatched product goes to
``qmm_splitk`` (1119-1216), which splits ``K`` into ``split_k`` parts when that gives enough
threadgroups and allocates their partial sums, ``[split_k, *out]`` of x's dtype, as a temporary of
the command buffer (1159-1169); a weight that is not transposed with ``K >= 1024`` and ``M < 4``
goes to ``qvm_split_k`` (627-746), whose partials are ``out`` with a ``split_k`` axis (8, or 32
past ``K = 8192``; 643, 684-690). Every other path (qmv, qmv_quad, qmv_wide, qvm, qmm, qmm_nax)
allocates nothing besides its output and the contiguous copies of its inputs
(``ensure_row_contiguous_matrix``, 65-83), which the CPU's count already covers. Two things the
plan does not know are taken at their worst: the device's qmv batch limit
(``get_qmv_batch_limit``, 85-141: 6 to 33 by GPU generation and size) at its lowest over every
generation, so a product counts its partials wherever some Apple GPU splits it; and ``M`` both
ways MLX may read it (``x.shape(-2)``, or every row of a row-contiguous ``x`` against a 2-D
weight, 1797-1799), keeping the larger.

**CUDA** (mlx/backend/cuda/quantized/quantized.cpp:15-127, qmm/qmm_sm90.cu:19-26, 136-138,
qmm/qmm.cu:20-50). On a compute-capability-9 GPU (H100, H200) an affine, transposed product with
``K % 64 == 0`` and ``N`` a multiple of 4 runs ``qmm_sm90`` unless it is one row of at most 16,384
by 16,384 (qmv), and ``qmm_sm90`` copies its scales and biases transposed, as temporaries of the
CUDA graph, on every call. The device's generation is not in the plan, so every CUDA plan charges
them (on other GPUs ``qmm_sm80``, ``qmm_naive`` and ``qmv`` allocate nothing more).

The compiler and the verifier compute this one function, so a GPU plan charges each quantised
matmul at least these bytes.
"""

from __future__ import annotations

import math

from dctms.schema.sizes import ITEMSIZE
from dctms.schema.targets import counted
from dctms.schema.types import MemoryModel

Shape = tuple[int, ...] | list[int]

# The lowest qmv batch limit of get_qmv_batch_limit (quantized.cpp:85-141) over every branch:
# (K and N <= 2048, <= 4096, larger).
_LOWEST_QMV_LIMIT = (13, 10, 6)
_QVM_LIMIT = 4  # a weight that is not transposed: qvm below 4 rows (quantized.cpp:1803)
_QVM_SPLIT_FROM = 1024  # qvm_split_k from this K on (1852-1874)
_TARGET_THREADGROUPS = 512  # qmm_splitk aims at about this many threadgroups (1133-1138)
_TILE = 32  # qmm_splitk's bm = bn = 32 and its smallest K alignment (1134, 1144)


def lowest_qmv_limit(k: int, n: int) -> int:
    """The fewest rows at which some Apple GPU leaves qmv for qmm (get_qmv_batch_limit)."""
    if k <= 2048 and n <= 2048:
        return _LOWEST_QMV_LIMIT[0]
    if k <= 4096 and n <= 4096:
        return _LOWEST_QMV_LIMIT[1]
    return _LOWEST_QMV_LIMIT[2]


def qmm_split_k(m: int, n: int, k: int, group_size: int) -> int:
    """qmm_splitk's ``split_k`` (quantized.cpp:1133-1152); 1 or less: it runs plain qmm."""
    tiles = -(-n // _TILE) * -(-m // _TILE)
    split = max(1, _TARGET_THREADGROUPS // tiles)
    align = group_size if group_size > _TILE else _TILE
    split = min(split, k // align)
    while split > 1 and k % (split * align) != 0:
        split -= 1
    return split


def qmm_partials(x: Shape, w: Shape, out: Shape, itemsize: int, args: list) -> int:
    """Bytes of the split-K partials one Metal ``QuantizedMatmul`` [group_size, bits, mode,
    transpose] of ``x`` by the packed ``w`` into ``out`` may hold (0 where no split path is
    taken); see the module docstring."""
    group_size, transpose = int(args[0]), bool(args[3])
    if len(x) < 1 or len(out) < 1 or not all(int(d) > 0 for d in (*x, *out)):
        return 0
    k, n, size = int(x[-1]), int(out[-1]), math.prod(out)
    rows = [int(x[-2]) if len(x) >= 2 else 1]
    if len(w) == 2:
        rows.append(math.prod(x) // k)  # a row-contiguous x against a 2-D weight (1797-1799)
    most = 0
    for m in rows:
        batches = size // (m * n)
        if transpose:
            if m < lowest_qmv_limit(k, n) or batches != 1:
                continue  # qmv (1829-1847), or qmm of a batched product (1811-1826)
            split = qmm_split_k(m, n, k, group_size)
        else:
            if m >= _QVM_LIMIT or k < _QVM_SPLIT_FROM:
                continue  # qmm or qvm (1811-1826, 1851-1866)
            split = 32 if k > 8192 else 8
        if split > 1:
            most = max(most, split * size * itemsize)
    return most


def cuda_qmm_copies(ins: list[Shape], dtypes: list[str], out: Shape, args: list) -> list[int]:
    """Bytes of the transposed scales and biases ``qmm_sm90`` copies for this product ([] where
    it is not taken); see the module docstring."""
    transpose = bool(args[3])
    if len(ins) < 4 or not transpose or len(out) < 1 or not all(int(d) > 0 for d in out):
        return []  # no biases: not affine, so not qmm_sm90 (qmm.cu:41-43)
    k, n = int(ins[0][-1]), int(out[-1])
    m = int(out[-2]) if len(out) > 1 else 1
    batches = math.prod(out) // (m * n)
    if k % 64 != 0 or n % 4 != 0:
        return []  # qmm.cu:35-40 (uint32 words: n * 4 bytes a multiple of 16)
    if m == 1 and batches == 1 and n <= 16384 and k <= 16384:
        return []  # qmv (quantized.cpp:102-107)
    return [math.prod(ins[2]) * ITEMSIZE[dtypes[2]], math.prod(ins[3]) * ITEMSIZE[dtypes[3]]]


def gpu_qmm_scratch(
    model: MemoryModel | None, ins: list[Shape], dtypes: list[str], out: Shape, args: list
) -> int:
    """What a ``QuantizedMatmul`` of a plan for ``model`` is charged besides the CPU's copies of
    its inputs, each buffer as the allocator counts it (``schema.targets.counted``): on Metal its
    split-K partials (``qmm_partials``), on CUDA ``qmm_sm90``'s transposed scales and biases
    (``cuda_qmm_copies``); 0 on the CPU."""
    if model is None or len(ins) < 2 or any(d not in ITEMSIZE for d in dtypes):
        return 0
    if model.name == "metal":
        buffers = [qmm_partials(ins[0], ins[1], out, ITEMSIZE[dtypes[0]], args)]
    else:
        buffers = cuda_qmm_copies(ins, dtypes, out, args)
    return sum(counted(model, n) for n in buffers if n > 0)
