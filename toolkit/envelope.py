"""Pass 5, envelope: M_max = M_weights + M_KV + M_persistent + M_intermediate + M_runtime.

* weights: exact parameter bytes (safetensors headers when weights exist, else the traced shapes).
* kv: the static cache exactly as the runner allocates it (every layer's keys and values).
* persistent: other memory the runner holds across steps: the graphs' constants and the per-call
  input arrays (token ids, position, last index).
* intermediate: the largest arena over the phases (intermediates, scratch and run-ahead included).
* runtime: what lives outside MLX's active memory: the runner process itself and the MLX buffer
  cache the runner allows (it sets ``mx.set_cache_limit(intermediate)``). The first four terms are
  the *provable* part, checked against MLX's peak every run; runtime is an allowance for RSS.
"""

from __future__ import annotations

from dctms.schema.types import Envelope

# Resident memory of a Python process that has imported the runner (mlx, msgspec, jsonschema,
# tokenizers, psutil) and evaluated one array: measured 38 MiB with psutil on the CPU backend
# (Linux x86-64, Python 3.11, mlx 0.32.4); rounded up to leave room for interpreter growth.
PROCESS_BASELINE = {"cpu": 64 * 2**20, "gpu": 192 * 2**20}
PROCESS_BASELINE_SOURCE = {
    "cpu": "runner process baseline 64 MiB (measured 38 MiB RSS: python 3.11 + mlx 0.32.4 cpu + "
    "runner imports) + MLX buffer cache limit = M_intermediate",
    "gpu": "runner process baseline 192 MiB (estimate for Metal: library, command queues; not "
    "measured here) + MLX buffer cache limit = M_intermediate",
}


def build_envelope(
    *,
    weights: int,
    kv: int,
    persistent: int,
    intermediate: int,
    backend: str,
    device_memory: int | None,
) -> Envelope:
    runtime = PROCESS_BASELINE.get(backend, PROCESS_BASELINE["gpu"]) + intermediate
    total = weights + kv + persistent + intermediate + runtime
    return Envelope(
        weights=weights,
        kv=kv,
        persistent=persistent,
        intermediate=intermediate,
        runtime=runtime,
        total=total,
        runtime_source=PROCESS_BASELINE_SOURCE.get(backend, PROCESS_BASELINE_SOURCE["gpu"]),
        device=device_memory,
        free=None if device_memory is None else device_memory - total,
    )
