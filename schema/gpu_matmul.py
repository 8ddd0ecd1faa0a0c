"""The split-K partials Metal's (unquantised) matmul allocates, from MLX's source (v0.32.1).

``Matmul::eval_gpu`` and ``AddMM::eval_gpu`` (mlx/backend/metal/matmul.cpp:1451-1592, 1593-1745)
take ``M`` rows of ``K`` against ``N`` columns, fold a batch into ``M`` where the strides allow
(1492-1502), send one row and one column to ``dot_product`` (partial sums of 512-thread blocks and
a float32 result, 1044-1090), a single row or column to a gemv (no temporaries), and the rest to
``steel_matmul_axpby`` (843-1040), which splits ``K`` in two cases of an unbatched product:

* ``steel_gemm_splitk_axpby`` (502-657) for a small ``M x N`` and a long ``K``: at most 1,024 (2,048
  on Max and Ultra GPUs) 16 x 16 output tiles, ``K >= 128`` and ``K >= max(M, N)`` (924-947); it
  allocates ``[split, M, N]`` float32 partials, ``split`` = min(max(2, the power of two at or above
  (K / 16) / (32 x 32 tiles)), 32) (523-544);
* on GPUs with neural accelerators (NAX), ``steel_gemm_splitk_axpby_nax`` (659-841) when ``K >= 3 max(M,
  N)`` or ``max(M, N) <= 1024`` and ``K > 2 max(M, N)`` (949-970): ``[ceil(K / part), M, N]``
  float32, ``part`` 4,096, or 2,048, 1,024, K / 2 for smaller ``K`` (682-704).

What the plan cannot know is taken at its worst: the GPU's class (the larger tile threshold, and
both the NAX and the other kernel, keeping the larger), whether the strides let the batch fold
into ``M`` (both readings), and a gemv of 2 to 5 rows (``gemv_wide``, 1518-1540) counted as a
split. The compiler and the verifier compute this one function.
"""

from __future__ import annotations

import math

from dctms.schema.gpu_qmm import gpu_qmm_scratch
from dctms.schema.targets import counted
from dctms.schema.types import MemoryModel

Shape = tuple[int, ...] | list[int]
MATMULS = frozenset({"Matmul", "AddMM", "QuantizedMatmul"})  # ops whose GPU kernels are charged

_F32 = 4
_DOT_THREADS, _DOT_ITEMS = 512, 32  # dot_product's thread group and items per thread (1053-1054)
_MOST_TILES = 2048  # min_tmn_threshold on Max and Ultra (925); 1,024 on the others
_MOST_SPLIT = 32  # steel_gemm_splitk_axpby (533-534)


def _next_power_of_2(n: int) -> int:
    """mlx/utils.h:161-170 (0 for 0: pow(2, -inf))."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def _splitk(m: int, n: int, k: int) -> int:
    """Partials of steel_matmul_axpby's two split-K kernels for an unbatched product (0: none)."""
    most = 0
    tiles16 = -(-m // 16) * -(-n // 16)
    if tiles16 <= _MOST_TILES and k // 16 >= 8 and k >= max(m, n):
        tiles32 = -(-m // 32) * -(-n // 32)
        split = min(max(2, _next_power_of_2((k // 16) // tiles32)), _MOST_SPLIT)
        most = split * m * n * _F32
    big = max(m, n)
    if k >= 3 * big or (big <= 1024 and k > 2 * big):
        part = k // 2 if k <= 1024 else 1024 if k <= 2048 else 2048 if k <= 4096 else 4096
        most = max(most, -(-k // max(part, 1)) * m * n * _F32)
    return most


def matmul_partials(prim: str, a: Shape, b: Shape, out: Shape) -> int:
    """Bytes of the temporaries one Metal ``Matmul`` or ``AddMM`` of ``a`` by ``b`` into ``out``
    may hold besides its output and its inputs' copies; see the module docstring."""
    if len(a) < 2 or len(b) < 2 or not out or math.prod(a) == 0 or math.prod(b) == 0:
        return 0
    m, n, k = int(a[-2]), int(b[-1]), int(a[-1])
    batches = math.prod(out) // (m * n)
    most = 0
    for rows, batch in {(m, batches), (m * batches, 1)}:
        if batch != 1:
            continue  # both split kernels take an unbatched product only
        if rows == 1 and n == 1 and prim == "Matmul":
            threads = -(-k // _DOT_ITEMS)
            blocks = -(-threads // _DOT_THREADS)
            most = max(most, blocks * _F32 + math.prod(out) * _F32)  # dot_product (1067-1085)
        elif rows == 1 or n == 1:
            continue  # a gemv
        else:
            most = max(most, _splitk(rows, n, k))
    return most


def gpu_matmul_scratch(
    model: MemoryModel | None, prim: str, ins: list[Shape], dtypes: list[str], out: Shape, args: list
) -> int:
    """What a matmul op (``MATMULS``) of a plan for ``model`` is charged besides the CPU's copies
    of its inputs, as the allocator counts it: a quantised one ``schema.gpu_qmm``'s; on Metal an
    unquantised one its split-K partials or dot-product sums (``matmul_partials``); else 0."""
    if prim == "QuantizedMatmul":
        return gpu_qmm_scratch(model, ins, dtypes, out, args)
    if model is None or model.name != "metal" or prim not in MATMULS or len(ins) < 2:
        return 0
    partials = matmul_partials(prim, ins[0], ins[1], out)
    return counted(model, partials) if partials else 0
