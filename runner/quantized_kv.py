"""The prompt of a plan with a quantised KV cache, fed the way mlx-lm's ``generate_step`` feeds it.

mlx-lm prefills ``prompt[:-1]`` in ``prefill_step_size`` pieces and then runs the last prompt
token as the first generation step; its cache is quantised after the first call
(``quantized_kv_start`` 0), so which tokens attend in float and which over the quantised cache
depends on those call boundaries. The runner makes the same calls: the first piece with the phase
``prefill_start`` (float attention over its own tokens, quantised cache written), the others with
``prefill`` (``prefill_chunk`` = mlx-lm's ``prefill_step_size``), the last prompt token with
``decode``. A one-token prompt is mlx-lm's single float call: ``prefill_start`` alone.
"""

from __future__ import annotations

import mlx.core as mx

START = "prefill_start"


def prefill_like_mlx_lm(session, prompt: list[int], whole_chunks: bool = False) -> mx.array:
    """The first generated token (an evaluated [batch] array) after feeding ``prompt``.

    ``whole_chunks`` (a recurrent state, which a padded chunk would run over): only whole chunks
    go through ``prefill``; the rest of ``prompt[:-1]`` and its last token are decode steps."""
    chunk = session.chunk
    if whole_chunks:
        whole = (len(prompt) - 1) // chunk * chunk
        _feed_chunks(session, prompt[:whole], session.prefill)
        for position in range(whole, len(prompt) - 1):
            session._decode(mx.array([prompt[position]], dtype=mx.uint32), position)
        token = session._decode(mx.array([prompt[-1]], dtype=mx.uint32), len(prompt) - 1)
        mx.eval(token)
        return token
    head = prompt[:-1] if len(prompt) > 1 else prompt
    out = _feed_chunks(session, head, session.prefill_start or session.prefill)
    if len(prompt) == 1:
        token = out["next_token"]
    else:
        token = session._decode(mx.array([prompt[-1]], dtype=mx.uint32), len(prompt) - 1)
    mx.eval(token)
    return token


def _feed_chunks(session, head: list[int], first) -> dict[str, mx.array]:
    """``head`` in ``prefill_chunk`` pieces, the first one through the phase ``first``."""
    chunk = session.chunk
    out: dict[str, mx.array] = {}
    for start in range(0, len(head), chunk):
        piece = head[start : start + chunk]
        # float calls: those starting below quantized_start T (the first one when T is 0)
        floats = start == 0 or start < getattr(session, "quantized_start", 0)
        program = first if floats else session.prefill
        point = program.lengths.pick({"tokens": len(piece), "window": start + len(piece)})
        tokens = program.lengths.value(point, "tokens", chunk)
        out = program.run(
            {
                "tokens": mx.array([piece + [0] * (tokens - len(piece))], dtype=mx.int32),
                "position": mx.array(start, dtype=mx.int32),
                "last_index": mx.array(len(piece) - 1, dtype=mx.int32),
            },
            session.weights,
            session.state,
            wait=False,
            point=point,
        )
    return out
