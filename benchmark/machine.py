"""This machine's roofline figures, measured with MLX: read bandwidth and matmul throughput.

``dctms roofline --measure`` uses them instead of a published profile. Both are best-of-R timings
(the least disturbed run on a shared machine), on MLX's default device:

* read bandwidth: the faster of ``mx.sum`` (one thread in MLX's CPU reduce) and a matrix-vector
  product ``x @ W.T`` through the BLAS (its threads; the access a decode step's linear layers
  make) over a float32 array much larger than the caches (bytes read / time);
* matmul: a float32 square matmul (2 n^3 FLOPs / time). On the CPU MLX calls whatever BLAS the
  process loaded (``dctms`` preloads OpenBLAS when MLX carries the reference BLAS, see
  ``dctms.runner.blas``), so the library that provides ``cblas_sgemm`` is named in the source.
"""

from __future__ import annotations

import math
import time

from dctms.schema.types import TargetProfile

READ_BYTES = 256 * 2**20
MATMUL_N = 1024
REPEATS = 5


def _best_seconds(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


READ_METHOD = "mx.sum and a BLAS matrix-vector product x @ W.T"


def measure_read_bandwidth(nbytes: int = READ_BYTES, repeats: int = REPEATS) -> float:
    """Bytes per second this machine reads a float32 array of ``nbytes``: the faster of ``mx.sum``
    and ``x @ W.T`` (W square). MLX's CPU sum runs on one thread; the BLAS's product on all of
    its threads, as the weights of a decode step are read (here: 8.3 vs 15.8-17 GB/s)."""
    import mlx.core as mx

    side = max(1, math.isqrt(nbytes // 4))
    w = mx.ones((side, side), dtype=mx.float32)
    x = mx.ones((1, side), dtype=mx.float32)
    mx.eval(w, x)
    best = float("inf")
    for run in (lambda: mx.eval(mx.sum(w)), lambda: mx.eval(x @ w.T)):
        run()  # warm-up
        best = min(best, _best_seconds(run, repeats))
    return w.nbytes / best


def measure_matmul_flops(n: int = MATMUL_N, repeats: int = REPEATS) -> float:
    """FLOP/s of a float32 ``n x n`` matmul."""
    import mlx.core as mx

    a = mx.random.normal((n, n), key=mx.random.key(0))
    b = mx.random.normal((n, n), key=mx.random.key(1))
    mx.eval(a, b)
    mx.eval(a @ b)  # warm-up
    seconds = _best_seconds(lambda: mx.eval(a @ b), repeats)
    return 2.0 * n**3 / seconds


def measured_profile(
    read_bytes: int = READ_BYTES, matmul_n: int = MATMUL_N, repeats: int = REPEATS
) -> TargetProfile:
    import mlx.core as mx

    device = str(mx.default_device())
    bandwidth = measure_read_bandwidth(read_bytes, repeats)
    flops = measure_matmul_flops(matmul_n, repeats)
    from dctms.runner.blas import loaded_blas

    blas = loaded_blas().describe()
    return TargetProfile(
        name="measured",
        peak_flops=flops,
        peak_flops_source=(
            f"measured: best of {repeats} MLX float32 {matmul_n}x{matmul_n} matmuls on {device} "
            f"of this machine, {flops / 1e9:.1f} GFLOP/s; BLAS loaded: {blas}"
        ),
        bandwidth_bytes_per_s=bandwidth,
        bandwidth_source=(
            f"measured: best of {repeats} of {READ_METHOD} over {read_bytes // 2**20} MiB of "
            f"float32 on {device} of this machine, {bandwidth / 1e9:.1f} GB/s read"
        ),
    )
