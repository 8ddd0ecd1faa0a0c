"""What a serving process holds outside MLX beyond a runner's own baseline (the plan's runtime
allowance), added once to the pool's runtime by ``dctms serve``.

Measured here with psutil (Linux x86-64, Python 3.11, mlx 0.32, starlette 1.10, uvicorn 0.54),
RSS growth of a process that had already imported the runner: importing the server (starlette,
uvicorn, this package) +8.3 MiB, rounded up. Transformers for chat templates (+43.5 MiB measured)
is already inside the runner's baseline (``RUNTIME_FLOOR``, measured with a chat template loaded).
"""

from __future__ import annotations

MIB = 2**20

SERVER_STACK = 16 * MIB


def serving_extras() -> tuple[tuple[str, int], ...]:
    return (("HTTP server stack (starlette, uvicorn; measured +8.3 MiB RSS)", SERVER_STACK),)
