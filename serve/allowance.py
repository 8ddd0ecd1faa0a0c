"""What a serving process holds outside MLX beyond a runner's own baseline (the plan's runtime
allowance), added once to the pool's runtime by ``dctms serve``.

Measured here with psutil (Linux x86-64, Python 3.11, mlx 0.32, starlette 1.10, uvicorn 0.54,
transformers as installed), RSS growth of a process that had already imported the runner:
importing the server (starlette, uvicorn, this package) +8.3 MiB; the first chat-template prompt
(transformers' tokenizer and jinja) +43.5 MiB. Each is rounded up to leave room for growth.
"""

from __future__ import annotations

MIB = 2**20
SERVER_STACK = 16 * MIB
CHAT_TEMPLATE = 48 * MIB


def serving_extras(any_chat_template: bool) -> tuple[tuple[str, int], ...]:
    extras = [("HTTP server stack (starlette, uvicorn; measured +8.3 MiB RSS)", SERVER_STACK)]
    if any_chat_template:
        extras.append(
            ("transformers for chat templates (measured +43.5 MiB RSS)", CHAT_TEMPLATE)
        )
    return tuple(extras)
