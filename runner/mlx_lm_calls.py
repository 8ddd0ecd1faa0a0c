"""The prompt fed at mlx-lm's own call boundaries, for plans whose results depend on them.

mlx-lm's ``generate_step`` prefills ``prompt[:-1]`` in ``prefill_step_size`` pieces and then runs
the last prompt token as the first generation step. Three caches make that structure visible:

* a quantised KV cache: mlx-lm quantises after a call that reaches ``quantized_kv_start`` T, so
  the calls starting below T (at least the first) attend in float: the runner runs those with the
  phases ``prefill_start`` / ``decode_start``, the others with ``prefill`` / ``decode``;
* a rotating cache that keeps tokens (``--max-kv-size``): what a query sees depends on how mlx-lm
  trimmed its buffer before the call;
* recurrent state: a padded chunk would run the recurrence over the padding, so only whole chunks
  go through ``prefill`` and the rest of ``prompt[:-1]`` through decode steps.

The runner makes the same calls (``prefill_chunk`` = mlx-lm's ``prefill_step_size``); a one-token
prompt is mlx-lm's single call.
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
