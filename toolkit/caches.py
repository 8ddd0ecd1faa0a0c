"""The static state a plan allocates for a model's cache, and the cache objects tracing hands it.

mlx-lm's models talk to their cache through a small protocol (``update_and_fetch``, ``make_mask``,
``offset``; a quantised cache also has ``bits`` and ``group_size``, which switches the model's
attention to ``quantized_scaled_dot_product_attention``; a recurrent one is an ``ArraysCache``).
Tracing replaces mlx-lm's growing caches by fixed-size arrays written at an array position, so one
graph serves every call (``CACHE_SUPPORT`` lists every cache class and what becomes of it):

* a plain KV cache (``trace.StaticKVCache``): keys and values of ``capacity`` positions;
* a quantised KV cache (``--kv-bits``, mlx-lm's ``QuantizedKVCache``): for keys and for values the
  packed uint32 words, the scales and the biases ``mx.quantize`` makes, each of ``capacity``
  positions; calls quantise their new keys and values and, once mlx-lm would have converted its
  cache (``quantized_kv_start``), attend over the quantised cache with MLX's quantised matmuls.
  The calls before (the first one at least) attend in float: ``prefill_start`` / ``decode_start``;
* a sliding-window layer (``RotatingKVCache``): a ring of a whole number of chunks written at
  ``position mod slots`` (``RingKVCache``; ``KeepRingKVCache`` when it keeps tokens, as
  ``--max-kv-size`` does), masked to what mlx-lm's buffer holds;
* recurrent state (``ArraysCache``): its arrays at their fixed shapes (``StaticArraysCache``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import mlx.core as mx

from dctms.schema.errors import DctmsError
from dctms.schema.types import KVStorage
from dctms.toolkit.lengths import TOKENS, LengthFit, NotAffine, digest, fit, sample_lengths
from dctms.toolkit.mlx_lm_classes import defer_package_init
from dctms.toolkit.trace import KVLayout, PhaseTracer, StaticKVCache, TracedPhase

KV_BITS = (4, 8)  # the widths the plan supports (mlx-lm's --kv-bits accepts these among others)
KV_GROUP_SIZES = (32, 64, 128)
# Phase of the first prompt chunk of a quantised cache (float attention over its own tokens).
PREFILL_START = "prefill_start"
# With a quantized_kv_start T >= 1, the float calls before mlx-lm's switch: prompt pieces and
# decode steps starting below T attend over a float cache (and write the quantised one too).
DECODE_START = "decode_start"
FLOAT_PHASES = (PREFILL_START, DECODE_START)
QUANT_PARTS = ("", ".scales", ".biases")  # packed words, scales, biases (mx.quantize's order)


# Every cache class mlx-lm 0.32's models make, and what a plan does with it: "planned", or the one
# line that says why it is refused. The docs' cache table (docs/how-to/caches.md) is tested against this.
CACHE_SUPPORT: dict[str, str] = {
    "KVCache": "planned: a static cache of N + M (+ padded prompt) positions",
    "QuantizedKVCache": "planned with --kv-bits 4 or 8, --kv-group-size 32, 64 or 128, "
    "--quantized-kv-start T",
    "RotatingKVCache": "planned (sliding-window layers: gemma3_text, olmo3, ...; --max-kv-size "
    "W, keep 4): a ring of the window + one chunk",
    "ChunkedKVCache": "refused: chunked attention (llama4) is not planned yet",
    "ArraysCache": "planned (recurrent state: mamba, ...): its arrays at their fixed shapes, "
    "prompts fed in whole chunks and single tokens",
    "ConcatenateKVCache": "refused: a growing concatenated cache is not planned yet",
    "CacheList": "refused: a per-layer list of caches (hybrid attention) is not planned yet",
}


@dataclass(frozen=True)
class Recurrent:
    """A layer whose cache is mlx-lm's ``ArraysCache(size)``: ``size`` arrays of fixed shape
    (a convolution window, an SSM state, ...) that each call replaces."""

    size: int


@dataclass(frozen=True)
class Rotating:
    """A layer whose cache is mlx-lm's ``RotatingKVCache(max_size=window, keep=keep)``."""

    window: int
    keep: int = 0


# mlx-lm's make_prompt_cache(model, max_kv_size): RotatingKVCache(max_size=max_kv_size, keep=4)
MAX_KV_KEEP = 4


def check_cache_support(model, max_kv_size: int | None = None) -> list[Rotating | Recurrent | None]:
    """Each layer's cache as mlx-lm's ``make_prompt_cache(model, max_kv_size)`` makes it:
    ``Rotating`` (a sliding window), ``Recurrent`` (``ArraysCache``) or None (a full KV cache);
    refuse caches that are not planned, naming each class and why (``CACHE_SUPPORT``)."""
    defer_package_init()  # mlx-lm's model code without its package __init__
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    arch = getattr(model, "model_type", None) or "model"
    if not hasattr(model, "make_cache"):
        if not hasattr(model, "layers"):
            raise DctmsError("not supported yet: model exposes no .layers to size its KV cache")
        if max_kv_size is not None:
            return [Rotating(max_kv_size, MAX_KV_KEEP)] * len(model.layers)
        return [None] * len(model.layers)
    if max_kv_size is not None:
        raise DctmsError(
            f"--max-kv-size: {arch} makes its own cache, and mlx-lm ignores max_kv_size for such "
            "models (mlx-lm#1343)"
        )
    caches = model.make_cache()
    kinds = sorted(
        {type(c).__name__ for c in caches if type(c) not in (KVCache, RotatingKVCache, ArraysCache)}
    )
    if kinds:
        why = "; ".join(
            f"{k}: {CACHE_SUPPORT.get(k, 'refused: an unknown cache class').split(': ', 1)[1]}"
            for k in kinds
        )
        raise DctmsError(f"not supported yet: {arch} needs {why}")
    out: list[Rotating | Recurrent | None] = []
    for c in caches:
        if type(c) is RotatingKVCache:
            out.append(Rotating(c.max_size, c.keep))
        elif type(c) is ArraysCache:
            out.append(Recurrent(len(c.cache)))
        else:
            out.append(None)
    return out


def ring_slots(window: int, chunk: int, keep: int = 0) -> int:
    """Slots of a sliding-window layer's ring: a whole number of prompt chunks (so a chunk, which
    starts at a multiple of the chunk, never wraps) holding the window - 1 - keep positions a
    chunk's first token still sees besides the kept ones, plus the chunk itself."""
    return -(-(window - 1 - keep) // chunk) * chunk + chunk


@dataclass(frozen=True)
class KVQuantization:
    """mlx-lm's ``kv_bits``, ``kv_group_size`` and ``quantized_kv_start``."""

    bits: int
    group_size: int = 64
    start: int = 0
    chunk: int = 1  # the plan's prefill chunk (the float cache holds the chunks that start below T)

    @property
    def float_positions(self) -> int:
        """Positions the float cache holds: every call that starts below ``start`` writes below
        ceil(start / chunk) * chunk; 0 when ``start`` is 0 (the first call reads its own keys)."""
        return -(-self.start // self.chunk) * self.chunk if self.start else 0


def kv_quantization(opts, chunk: int = 1) -> KVQuantization | None:
    """The KV quantisation compile options ask for (``CompileOptions.kv_bits`` etc.), or None."""
    if opts.kv_bits is None:
        return None
    return KVQuantization(opts.kv_bits, opts.kv_group_size, opts.quantized_kv_start, chunk)


def kv_storage(dtype: str, opts) -> KVStorage:
    """The plan's ``bounds.kv``: the activation dtype (of the values, or of scales and biases), and
    the bits and group size of a quantised cache."""
    if opts.kv_bits is None:
        return KVStorage(dtype=dtype)
    return KVStorage(
        dtype=dtype,
        bits=opts.kv_bits,
        group_size=opts.kv_group_size,
        quantized_start=opts.quantized_kv_start,
    )


def start_phases(
    tracer: PhaseTracer, quant, chunk: int, capacity: int, paths: dict | None = None
) -> list[TracedPhase]:
    """The float phases of a quantised cache: the first call's (own keys only) with a start of 0,
    else prompt pieces and decode steps over the float cache, up to its last position.
    ``paths``: the keywords that ask the tracer for module paths."""
    if quant is None:
        return []
    paths = paths or {}
    if not quant.start:
        return [tracer.prefill(chunk, chunk, PREFILL_START, **paths)]
    if "name" not in inspect.signature(tracer.decode).parameters:
        raise DctmsError("--quantized-kv-start above 0 is not planned for this tracer yet (--ranks)")
    window = min(capacity, quant.float_positions + 1) - 1
    return [
        tracer.prefill(chunk, window, PREFILL_START, **paths),
        tracer.decode(window, name=DECODE_START, **paths),
    ]


def fit_start(tracer: PhaseTracer, bound: TracedPhase, chunk: int) -> LengthFit | str:
    """The ``prefill_start`` phase's fit over its token count (it reads no cache window)."""
    ts = sample_lengths(chunk)
    if not ts:
        return "the bounds are too small to vary"
    try:
        samples = [((chunk,), digest(bound, bound, (chunk,)))]
        for t in ts:
            samples.append(((t,), digest(bound, tracer.prefill(t, t, PREFILL_START), (t,))))
        return fit([TOKENS], samples, bound)
    except NotAffine as err:
        return str(err)


def check_kv_quantization(q: KVQuantization, kv: KVLayout) -> None:
    """Refuse settings mlx-lm or this planner cannot run, in one line each."""
    if q.bits not in KV_BITS:
        raise DctmsError(f"--kv-bits must be one of {', '.join(map(str, KV_BITS))}, got {q.bits}")
    if q.group_size not in KV_GROUP_SIZES:
        raise DctmsError(
            f"--kv-group-size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, got {q.group_size}"
        )
    if q.start < 0:
        raise DctmsError(f"--quantized-kv-start must be 0 or more, got {q.start}")
    dims = {s[-1] for s in (*kv.keys, *kv.values)}
    bad = sorted(d for d in dims if d % q.group_size)
    if bad:
        raise DctmsError(
            f"--kv-group-size {q.group_size} does not divide the model's head dimension {bad[0]}"
        )
    if kv.dtype not in ("float32", "float16", "bfloat16"):
        raise DctmsError(f"--kv-bits: cannot quantise a {kv.dtype} cache")


@dataclass(frozen=True)
class Ring:
    """A sliding-window layer's static cache: position p lives in slot p mod ``slots``; attention
    sees the last ``window`` positions (mlx-lm's ``RotatingKVCache(max_size=window, keep=0)``)."""

    window: int
    slots: int
    keep: int = 0


def rings_for(windows: list, chunk: int, capacity: int) -> list:
    """Each layer's static cache (see ``check_cache_support``): the ring of a sliding-window layer
    whose ring is smaller than the full cache (a window the full cache holds anyway stays a full
    cache, masked to the window), ``Recurrent`` as it is, None for a full KV cache."""
    out: list = []
    for w in windows:
        if isinstance(w, Recurrent) or w is None:
            out.append(w)
            continue
        if w.keep >= w.window or w.keep > chunk:
            raise DctmsError(
                f"a rotating cache keeping {w.keep} of {w.window} tokens needs a window above the "
                f"kept tokens and a prefill chunk of at least {w.keep} (got {chunk})"
            )
        slots = ring_slots(w.window, chunk, w.keep)
        # kept tokens make mlx-lm's visible set depend on its trimming, whatever the capacity
        out.append(Ring(w.window, slots, w.keep) if w.keep or slots < capacity else None)
    return out


def probes_for(layers: list | None, num_layers: int) -> list:
    """The cache objects a one-token probe call gets: mlx-lm's own ``ArraysCache`` for a recurrent
    layer (its arrays' shapes are read back), else the tracer's key/value probe."""
    defer_package_init()  # mlx-lm's model code without its package __init__
    from mlx_lm.models.cache import ArraysCache

    from dctms.toolkit.trace import _ProbeCache

    layers = layers or [None] * num_layers
    return [ArraysCache(x.size) if isinstance(x, Recurrent) else _ProbeCache() for x in layers]


@dataclass(frozen=True)
class StateArray:
    name: str
    shape: tuple[int, ...]
    dtype: mx.Dtype
    ring: Ring | None = None
    recurrent: bool = False


class StateLayout:
    """The state arrays of one model's static cache (names, shapes, dtypes, in binding order) and
    the per-layer cache objects a traced call uses."""

    def __init__(
        self,
        kv: KVLayout,
        capacity: int,
        quant: KVQuantization | None = None,
        rings: list | None = None,
        probes: list | None = None,
    ):
        self.kv, self.capacity, self.quant = kv, capacity, quant
        # Each layer's Ring (a sliding window), Recurrent, or None (every position kept).
        self.rings = rings or [None] * len(kv.keys)
        if quant is not None and any(self.rings):
            raise DctmsError(
                "--kv-bits: a quantised sliding-window or recurrent cache is not planned yet"
            )
        if quant is not None:
            check_kv_quantization(quant, kv)
        dtype = getattr(mx, kv.dtype)
        arrays: list[StateArray] = []
        for i in range(len(kv.keys)):
            ring = self.rings[i]
            if isinstance(ring, Recurrent):
                arrays += _recurrent_arrays(i, probes[i])
                continue
            for part, (b, h, _, d) in (("keys", kv.keys[i]), ("values", kv.values[i])):
                name = f"kv.{i}.{part}"
                if quant is None:
                    size = ring.slots if ring else capacity
                    arrays.append(StateArray(name, (b, h, size, d), dtype, ring))
                    if ring and ring.keep:  # the kept tokens, then as many sink slots
                        keep = (b, h, 2 * ring.keep, d)
                        arrays.append(StateArray(f"{name}.keep", keep, dtype, ring))
                    continue
                words = d * quant.bits // 32
                groups = d // quant.group_size
                arrays.append(StateArray(name, (b, h, capacity, words), mx.uint32))
                arrays.append(StateArray(f"{name}.scales", (b, h, capacity, groups), dtype))
                arrays.append(StateArray(f"{name}.biases", (b, h, capacity, groups), dtype))
                if quant.start:  # + a spare position: the float window is a proper slice
                    size = min(capacity, quant.float_positions + 1)
                    arrays.append(StateArray(f"{name}.float", (b, h, size, d), dtype))
        self.arrays = arrays

    @property
    def recurrent(self) -> bool:
        return any(isinstance(r, Recurrent) for r in self.rings)

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.arrays]

    def names_for(self, phase: str) -> list[str]:
        """The state a phase reads and writes: the float cache only in the float phases."""
        if self.quant is None or phase in FLOAT_PHASES:
            return self.names
        return [n for n in self.names if not n.endswith(".float")]

    @property
    def num_layers(self) -> int:
        return len(self.kv.keys)

    def caches(self, kw: dict, position: mx.array, window: int, phase: str) -> list:
        """The cache object of every layer, over the state arrays in ``kw``."""
        if self.quant is None:
            out = []
            for i, ring in enumerate(self.rings):
                if isinstance(ring, Recurrent):
                    names = [f"kv.{i}.state{j}" for j in range(ring.size)]
                    out.append(StaticArraysCache([kw[n] for n in names], position))
                    continue
                k, v = kw[f"kv.{i}.keys"], kw[f"kv.{i}.values"]
                if ring is None:
                    out.append(StaticKVCache(k, v, position, window))
                elif ring.keep:
                    kept = (kw[f"kv.{i}.keys.keep"], kw[f"kv.{i}.values.keep"])
                    out.append(KeepRingKVCache(k, v, position, ring, kept))
                else:
                    out.append(RingKVCache(k, v, position, ring))
            return out
        def packed(i: int) -> tuple[list, list]:  # a layer's keys and values with their parts
            return tuple([kw[f"kv.{i}.{kv}{p}"] for p in QUANT_PARTS] for kv in ("keys", "values"))

        if phase in FLOAT_PHASES and self.quant.start:
            return [
                FloatThenQuantizedCache(
                    *packed(i),
                    position,
                    window,
                    self.quant,
                    (kw[f"kv.{i}.keys.float"], kw[f"kv.{i}.values.float"]),
                )
                for i in range(self.num_layers)
            ]
        kind = FirstChunkQuantizedCache if phase == PREFILL_START else StaticQuantizedKVCache
        return [
            kind(*packed(i), position, window, self.quant) for i in range(self.num_layers)
        ]

    def outputs(self, caches: list) -> list[mx.array]:
        """The updated state arrays, in ``names`` order."""
        out: list[mx.array] = []
        for c in caches:
            if isinstance(c, StaticArraysCache):
                out += c.updated()
            elif isinstance(c, FloatThenQuantizedCache):
                out += [*c.keys, c.float_keys, *c.values, c.float_values]
            elif isinstance(c, KeepRingKVCache):
                out += [c.keys, c.kept_keys, c.values, c.kept_values]
            elif self.quant is None:
                out += [c.keys, c.values]
            else:
                out += [*c.keys, *c.values]
        return out


class _QuantizedWrites:
    """Writes each call's keys and values into the packed words, scales and biases at ``offset``
    (an array), quantised with ``mx.quantize`` as mlx-lm's ``QuantizedKVCache`` does."""

    def __init__(
        self, keys: list, values: list, position: mx.array, window: int, q: KVQuantization
    ):
        self.keys, self.values, self.offset, self.window, self._q = (
            keys,
            values,
            position,
            window,
            q,
        )

    def _write(self, state: list, new: mx.array) -> list:
        start = self.offset.reshape(1)
        parts = mx.quantize(new, group_size=self._q.group_size, bits=self._q.bits)
        return [mx.slice_update(s, p, start, axes=(2,)) for s, p in zip(state, parts, strict=True)]

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False


class StaticQuantizedKVCache(_QuantizedWrites):
    """mlx-lm's ``QuantizedKVCache`` at fixed capacity: attention reads the first ``window``
    positions of the packed words, scales and biases (proper slices, masked by position) through
    mlx-lm's quantised attention (the model takes that path because the cache has ``bits``)."""

    def __init__(
        self, keys: list, values: list, position: mx.array, window: int, q: KVQuantization
    ):
        super().__init__(keys, values, position, window, q)
        self.bits, self.group_size = q.bits, q.group_size

    def update_and_fetch(self, k: mx.array, v: mx.array):
        self.keys, self.values = self._write(self.keys, k), self._write(self.values, v)
        w = self.window
        return [x[:, :, :w, :] for x in self.keys], [x[:, :, :w, :] for x in self.values]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        return StaticKVCache.make_mask(self, n, return_array, window_size)


class FloatThenQuantizedCache(_QuantizedWrites):
    """A call before mlx-lm's switch (``quantized_kv_start`` T >= 1; it starts below T): mlx-lm's
    float ``KVCache`` then, so it writes the float cache and attends over its first ``window``
    positions (masked by position); it also writes the quantised cache, which holds exactly what
    mlx-lm's conversion (``to_quantized``, per position) makes of those keys and values."""

    def __init__(self, keys, values, position, window, q: KVQuantization, floats):
        super().__init__(keys, values, position, window, q)
        self.float_keys, self.float_values = floats

    def update_and_fetch(self, k: mx.array, v: mx.array):
        self.keys, self.values = self._write(self.keys, k), self._write(self.values, v)
        start, w = self.offset.reshape(1), self.window
        self.float_keys = mx.slice_update(self.float_keys, k, start, axes=(2,))
        self.float_values = mx.slice_update(self.float_values, v, start, axes=(2,))
        return self.float_keys[:, :, :w, :], self.float_values[:, :, :w, :]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        return StaticKVCache.make_mask(self, n, return_array, window_size)


class FirstChunkQuantizedCache(_QuantizedWrites):
    """The first call of a quantised cache, at position 0 (mlx-lm's float ``KVCache`` before its
    conversion): writes the quantised keys and values, attends over its own float ones (it has no
    ``bits``, so the model takes the float attention path)."""

    def update_and_fetch(self, k: mx.array, v: mx.array):
        self.keys, self.values = self._write(self.keys, k), self._write(self.values, v)
        return k, v

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        queries, keys = mx.arange(n)[:, None], mx.arange(n)[None]
        mask = queries >= keys
        if window_size is not None:
            mask = mask & (queries < keys + window_size)
        return mask


class RingKVCache:
    """mlx-lm's ``RotatingKVCache(max_size=W, keep=0)`` as a fixed ring (``Ring``): a call's keys
    and values are written at ``position mod slots`` (a chunk never wraps: it starts at a multiple
    of the chunk, and the ring is a whole number of chunks); attention reads every slot, masked to
    the positions it holds that lie in the query's window (q - W, q] -- the set mlx-lm's buffer
    holds and its sliding mask lets through."""

    def __init__(self, keys: mx.array, values: mx.array, position: mx.array, ring: Ring):
        self.keys, self.values, self.offset, self.ring = keys, values, position, ring

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        start = mx.remainder(self.offset, self.ring.slots).reshape(1)
        self.keys = mx.slice_update(self.keys, k, start, axes=(2,))
        self.values = mx.slice_update(self.values, v, start, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        queries = self.offset + mx.arange(n)
        last = mx.max(queries)  # the last position this call writes
        # the position each slot holds once this call has written: the latest p <= last in it
        held = last - mx.remainder(last - mx.arange(self.ring.slots), self.ring.slots)
        q, held = queries[:, None], held[None]
        return (held >= 0) & (held <= q) & (held > q - self.ring.window)

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False


class KeepRingKVCache(RingKVCache):
    """mlx-lm's ``RotatingKVCache(max_size=W, keep=K)``, K > 0 (``--max-kv-size``): the ring as in
    ``RingKVCache`` plus the first K tokens in their own arrays (K slots, then K sink slots that a
    write at min(position, K) lands in once the kept ones are written).

    Which tokens a query sees follows mlx-lm's buffer exactly. A decode step at p sees the kept
    tokens and the last W - K positions. A prompt chunk at p0 < W sees the window (q - W, q]. Once
    p0 >= W, mlx-lm has trimmed its buffer to the kept tokens and the last W - 1 - K positions
    before appending the chunk, and masks by buffer index: query i of the chunk sees the positions
    >= max(q - W + 1, p0 - W + 1 + K) and the kept tokens at index >= i."""

    def __init__(self, keys, values, position, ring: Ring, kept: tuple[mx.array, mx.array]):
        super().__init__(keys, values, position, ring)
        self.kept_keys, self.kept_values = kept

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        keep = self.ring.keep
        start = mx.minimum(self.offset, keep).reshape(1)
        first = (lambda x: x[:, :, :keep]) if k.shape[2] > 1 else (lambda x: x)
        self.kept_keys = mx.slice_update(self.kept_keys, first(k), start, axes=(2,))
        self.kept_values = mx.slice_update(self.kept_values, first(v), start, axes=(2,))
        ring_k, ring_v = super().update_and_fetch(k, v)
        keys = mx.concatenate([self.kept_keys[:, :, :keep], ring_k], axis=2)
        values = mx.concatenate([self.kept_values[:, :, :keep], ring_v], axis=2)
        return keys, values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        w, keep, slots = self.ring.window, self.ring.keep, self.ring.slots
        queries = self.offset + mx.arange(n)
        last = mx.max(queries)
        held = last - mx.remainder(last - mx.arange(slots), slots)
        q, held, kept = queries[:, None], held[None], mx.arange(keep)[None]
        ring = (held >= keep) & (held <= q)
        if n == 1:  # mlx-lm's in-place update: the kept tokens and the last W - K positions
            return mx.concatenate([kept <= q, ring & (held > q - w + keep)], axis=1)
        trimmed = self.offset >= w
        index = mx.arange(n)[:, None]
        kept_mask = mx.where(trimmed, kept >= index, kept > q - w) & (kept <= q)
        oldest = mx.where(trimmed, self.offset - w + 1 + keep, 0)
        ring = ring & (held > q - w) & (held >= oldest)
        return mx.concatenate([kept_mask, ring], axis=1)


def _recurrent_arrays(layer: int, probe) -> list[StateArray]:
    """A recurrent layer's state arrays, shaped as mlx-lm's ``ArraysCache`` holds them after a call
    (read from the probe call)."""
    arrays = []
    for j, a in enumerate(probe.cache):
        if a is None:
            raise DctmsError(
                f"not supported yet: layer {layer}'s ArraysCache entry {j} is never set"
            )
        arrays.append(StateArray(f"kv.{layer}.state{j}", tuple(a.shape), a.dtype, recurrent=True))
    return arrays


def _arrays_cache_class():
    defer_package_init()  # mlx-lm's model code without its package __init__
    from mlx_lm.models.cache import ArraysCache

    return ArraysCache


class StaticArraysCache(_arrays_cache_class()):
    """mlx-lm's ``ArraysCache`` over the plan's state arrays. Recurrent models test
    ``isinstance(cache, ArraysCache)`` and assign ``cache[j]``, so this is one. At position 0 the
    state reads as zeros -- what mlx-lm's first call computes with (an empty cache: zero padding,
    no state) -- so a new prompt needs no reset; each new array is copied out (a ``Gather``), so the
    state kept between calls never holds a larger buffer it is a view of."""

    def __init__(self, arrays: list[mx.array], position: mx.array):
        super().__init__(len(arrays))
        first = position > 0
        self.cache = [mx.where(first, a, mx.zeros((), a.dtype)) for a in arrays]
        self.offset = position

    def updated(self) -> list[mx.array]:
        return [mx.take(a, mx.arange(a.shape[0]), axis=0) for a in self.cache]
