"""Sampling traced into the plan (``compile --sampling``): mlx-lm 0.32's logits processors and
sampler, as ops of the prefill and decode phases, with every parameter a per-call input.

What ``generate_step`` does with ``make_logits_processors(logit_bias, repetition_penalty,
repetition_context_size)`` and ``make_sampler(temp, top_p, min_p, top_k)``, in its order:

1. logit bias: each (id, value) pair added to its logit (``bias_ids``, ``bias_values``: a fixed
   number of slots; unused ones repeat the first pair, so the write is the same);
2. repetition penalty over the last C tokens: a logit below 0 multiplied by ``penalty``, else
   divided (``recent``: the last ``RECENT_CAPACITY`` token ids, oldest first; slots older than
   ``context`` are replaced by the newest id, which the penalty already covers, so the set of ids
   penalised is exactly mlx-lm's ``tokens[-C:]``);
3. log-probabilities (the log-softmax);
4. temperature 0 (``inv_temperature`` 0): argmax, else top-p, min-p and top-k masks (each keeps the
   values at or above a threshold, so applying them in mlx-lm's order on masked values is the same
   as taking each threshold from the sorted log-probabilities), then MLX's categorical draw
   (``categorical`` below, op for op) of the masked values times 1 / temperature, with a key split
   from the ``key`` input exactly as MLX's global key sequence does after ``mx.random.seed``.

Disabled values make each step the identity: no bias pairs, penalty 1, top_p outside (0, 1),
log_min_p -inf, top_k 0. The phase also returns the new key, the chosen token's log-probability and
the ``TOP_LOGPROBS`` largest log-probabilities with their ids (OpenAI's ``top_logprobs`` maximum).
"""

from __future__ import annotations

import mlx.core as mx

from dctms.schema import sampling as interface
from dctms.schema.sampling import BIAS_SLOTS, RECENT_CAPACITY, TOP_LOGPROBS

# Per-call inputs of a sampling phase, in the order they follow ``tokens`` / ``position`` /
# ``last_index``; the outputs after ``next_token`` (the decode phase's end with ``next_recent``,
# the window with the token it was fed appended, which the runner feeds to the next step).
INPUTS = tuple(interface.INPUTS)
OUTPUTS = tuple(interface.OUTPUTS)
DECODE_OUTPUTS = tuple(interface.DECODE_OUTPUTS)


def placeholders() -> dict[str, mx.array]:
    """Arrays of each sampling input's shape and dtype. The float scalars are float32, as MLX makes
    a Python float before casting it to the logits' dtype (``_like_logits``)."""
    return {
        "key": mx.zeros((2,), mx.uint32),
        "inv_temperature": mx.array(0, mx.float32),
        "top_p": mx.array(0, mx.float32),
        "log_min_p": mx.array(0, mx.float32),
        "top_k": mx.array(0, mx.int32),
        "penalty": mx.array(1, mx.float32),
        "context": mx.array(1, mx.int32),
        "recent": mx.zeros((RECENT_CAPACITY,), mx.uint32),
        "bias_ids": mx.zeros((BIAS_SLOTS,), mx.uint32),
        "bias_values": mx.zeros((BIAS_SLOTS,), mx.float32),
    }


def _like_logits(s: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    """The scalars mlx-lm multiplies or adds to the logits as Python floats, in the logits' dtype
    (a float32 array would promote bfloat16 logits); top_p multiplies float32 sums and stays."""
    cast = ("inv_temperature", "log_min_p", "penalty", "bias_values")
    return {k: v.astype(dtype) if k in cast else v for k, v in s.items()}


def sample(logits: mx.array, s: dict[str, mx.array], fed: mx.array | None) -> tuple:
    """(next_token, next_key, logprob, top_ids, top_logprobs[, next_recent]) for ``logits``
    [1, vocab]; ``fed``: the decode step's input token (appended to ``recent`` first), None in
    prefill, whose ``recent`` already ends with the prompt's last token."""
    s = _like_logits(s, logits.dtype)
    recent = s["recent"]
    if fed is not None:
        recent = mx.concatenate([recent[1:], fed.astype(mx.uint32)])
    logits = _logit_bias(logits, s["bias_ids"], s["bias_values"])
    logits = _repetition_penalty(logits, recent, s["context"], s["penalty"])
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    greedy = mx.argmax(logprobs, axis=-1)
    order = mx.argsort(logprobs, axis=-1)
    ascending = mx.take_along_axis(logprobs, order, axis=-1)
    masked = _top_k(_min_p(_top_p(logprobs, ascending, s["top_p"]), s["log_min_p"]), ascending, s)
    split = mx.random.split(s["key"])
    drawn = categorical(masked * s["inv_temperature"], split[1])
    # A draw never leaves the vocabulary (it is fed back as the next token's embedding row), even
    # from the NaNs of temperature 0's unused draw.
    drawn = mx.minimum(drawn, logprobs.shape[-1] - 1)
    token = mx.where(s["inv_temperature"] == 0, greedy, drawn)
    logprob = mx.take_along_axis(logprobs, token[:, None], axis=-1)
    # The largest log-probabilities as arrays of their own (gathers, not slices: a slice would be a
    # view that keeps the whole sorted vocabulary alive while the runner holds the outputs).
    vocab = logprobs.shape[-1]
    last = mx.arange(vocab - min(TOP_LOGPROBS, vocab), vocab)[None]
    top_ids = mx.take_along_axis(order, last, axis=-1)
    top = mx.take_along_axis(logprobs, top_ids, axis=-1)
    outs = (token, split[0], logprob, top_ids, top)
    return outs if fed is None else (*outs, recent)


def _logit_bias(logits: mx.array, ids: mx.array, values: mx.array) -> mx.array:
    # mlx-lm: logits.at[:, ids].add(values), for distinct ids
    at = ids[None]
    return mx.put_along_axis(logits, at, mx.take_along_axis(logits, at, axis=-1) + values, axis=-1)


def _repetition_penalty(
    logits: mx.array, recent: mx.array, context: mx.array, penalty: mx.array
) -> mx.array:
    slots = recent.shape[0]
    inside = mx.arange(slots) >= slots - context
    ids = mx.where(inside, recent, recent[-1])[None]
    chosen = mx.take_along_axis(logits, ids, axis=-1)
    chosen = mx.where(chosen < 0, chosen * penalty, chosen / penalty)
    return mx.put_along_axis(logits, ids, chosen, axis=-1)


def _top_p(logprobs: mx.array, ascending: mx.array, top_p: mx.array) -> mx.array:
    # mlx-lm's apply_top_p, active for 0 < top_p < 1
    probs = mx.exp(ascending.astype(mx.float32))
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + probs[..., :1]
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    # Off (top_p 0, or so small its product with the total underflows) every entry counts as
    # dropped: an index one past the vocabulary, which MLX's gather would read unchecked. Active,
    # the largest value is never dropped (nothing lies above it), so the clamp changes nothing.
    dropped = mx.minimum(dropped, ascending.shape[-1] - 1)
    threshold = mx.take_along_axis(ascending, dropped, axis=-1)
    active = (top_p > 0) & (top_p < 1)
    return mx.where(active & (logprobs < threshold), -float("inf"), logprobs)


def _min_p(logprobs: mx.array, log_min_p: mx.array) -> mx.array:
    # mlx-lm's apply_min_p with min_tokens_to_keep 1; log_min_p -inf disables it
    scaled = mx.max(logprobs, axis=-1, keepdims=True) + log_min_p
    return mx.where(logprobs < scaled, -float("inf"), logprobs)


def _top_k(logprobs: mx.array, ascending: mx.array, s: dict[str, mx.array]) -> mx.array:
    # mlx-lm's apply_top_k keeps the k largest: every value at or above the k-th largest (a tie at
    # that value keeps all its members, where argpartition would keep some); top_k 0 disables it.
    top_k = s["top_k"]
    vocab = ascending.shape[-1]
    # top_k at least 1 in the unpicked branch too: the index stays inside the axis for every top_k
    # the runner feeds (0..vocab-1), which the verifier's index_safety rule proves
    at = mx.where(top_k > 0, vocab - mx.maximum(top_k, 1), 0).reshape(1, 1)
    threshold = mx.take_along_axis(ascending, at, axis=-1)
    return mx.where(logprobs < threshold, -float("inf"), logprobs)


# MLX's categorical draw, op for op (mlx 0.32: the inverse of the cumulative distribution at one
# uniform number), except that the uniform number's 32 random bits are computed here from the key
# with elementwise integer ops (the Threefry-2x32 hash MLX's RandomBits evaluates for a one-element
# draw): no Python call re-creates a one-element RandomBits primitive, which the runner needs.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA  # Threefry's key-schedule constant


def threefry_first(key: mx.array) -> mx.array:
    """The first word of Threefry-2x32(key, counter (0, 0)): MLX's bits of a one-element draw,
    shape [1], uint32."""
    k0, k1 = key[0:1], key[1:2]
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    c0, c1 = k0, k1  # the counter (0, 0) plus the key
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            c0 = c0 + c1
            c1 = ((c1 << r) | (c1 >> (32 - r))) ^ c0
        c0 = c0 + ks[(i + 1) % 3]
        c1 = c1 + ks[(i + 2) % 3] + (i + 1)
    return c0


def categorical(logits: mx.array, key: mx.array) -> mx.array:
    """``mx.random.categorical(logits, key=key)`` for logits [1, vocab]: the same ops on the same
    values, shape [1], uint32."""
    x = logits.reshape(-1).astype(mx.float32)
    top = mx.max(x, axis=0)
    infinite = (top == float("inf")) | (top == -float("inf"))
    weights = mx.where(infinite, (x == top).astype(mx.float32), mx.exp(x - top))
    below = mx.cumsum(weights, axis=0, inclusive=False)
    low, high = mx.array(0.0), mx.array(1.0)
    uniform = mx.minimum(
        threefry_first(key).astype(mx.float32) / 4294967296.0, 0.9999999403953552
    )
    uniform = (high - low) * uniform + low
    return mx.searchsorted(below, uniform * mx.sum(weights, axis=0), side="right") - 1
