"""Pass 1, trace: the real MLX primitive graph of an mlx-lm model, without materialising weights.

The model class is built from config.json (quantised as the config says), its parameters are
replaced by zero-cost broadcasts of a scalar, and ``mx.export_function`` with a callback hands us
every primitive of one call. Two phases are traced against a *static* KV cache of fixed capacity
whose write position is an input array, so one graph serves every step:

* ``prefill``: ``prefill_chunk`` tokens at ``position``; ``last_index`` picks the chunk's last real
  token (the final chunk is padded), whose greedy next token is returned.
* ``decode``: one token at ``position``.

Both return ``next_token`` (greedy, computed exactly as mlx-lm's sampler does) and the updated cache.
Attention reads a window of the cache (``StaticKVCache``): a phase can be traced at any prompt-chunk
length and window, which is how ``toolkit.lengths`` finds the sizes that follow the lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from dctms.schema.errors import DctmsError
from dctms.schema.values import args_to_plain, dtype_name
from dctms.toolkit.last_row import last_layer_on_picked_row
from dctms.toolkit.mlx_lm_classes import defer_package_init, model_classes
from dctms.toolkit.module_paths import trace_module_paths
from dctms.toolkit.sampling import DECODE_OUTPUTS as SAMPLING_DECODE_OUTPUTS
from dctms.toolkit.sampling import INPUTS as SAMPLING_INPUTS
from dctms.toolkit.sampling import OUTPUTS as SAMPLING_OUTPUTS
from dctms.toolkit.sampling import placeholders as sampling_placeholders
from dctms.toolkit.sampling import sample

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass(frozen=True)
class TracedTensor:
    id: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class TracedOp:
    primitive: str
    args: list
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class TracedBinding:
    id: str
    kind: str  # input | weight | state | output
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class TracedConstant:
    id: str
    shape: tuple[int, ...]
    dtype: str
    value: list


@dataclass
class TracedPhase:
    name: str
    tokens: int
    inputs: list[TracedBinding]
    outputs: list[TracedBinding]
    constants: list[TracedConstant]
    ops: list[TracedOp]
    tensors: dict[str, TracedTensor] = field(default_factory=dict)
    # The module path that created each op (toolkit.module_paths), when traced with paths.
    module_paths: list[str] | None = None


@dataclass(frozen=True)
class KVLayout:
    """Per-layer key/value shapes the model asks its cache to store, found by probing."""

    keys: tuple[tuple[int, ...], ...]  # (batch, kv_heads, capacity, head_dim) per layer
    values: tuple[tuple[int, ...], ...]
    dtype: str


@dataclass
class Traced:
    phases: list[TracedPhase]
    weights: list[TracedBinding]  # parameter path, shape, dtype (kind "weight")
    kv: KVLayout
    num_layers: int
    vocab_size: int
    # state name -> (window, slots) of a sliding-window layer's ring (see toolkit.caches)
    rings: dict[str, tuple[int, int]] = field(default_factory=dict)
    recurrent: tuple[str, ...] = ()  # state names of recurrent layers (ArraysCache)
    # fused weight name -> its parts, in column order (toolkit.fuse_projections)
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    prefix_blocks: int = 0  # blocks of the prompt-prefix pool (toolkit.prefix_pool), 0: none

    def phase(self, name: str) -> TracedPhase:
        """The traced phase called ``name`` ("prefill" or "decode")."""
        for phase in self.phases:
            if phase.name == name:
                return phase
        raise KeyError(f"no traced phase {name!r}")


# ------------------------------------------------------------------------------------ the model


def build_model(
    config: dict,
    dtype: str,
    stored: dict[str, str] | set[str] | None = None,
    follow_stored: bool = False,
) -> nn.Module:
    """mlx-lm's own model class for ``config``, cast to ``dtype`` and quantised like mlx-lm does.

    Parameters stay lazy (never evaluated), so building a 7B model costs no weight memory.
    ``stored``: name -> dtype of the tensors in the safetensors files, when present; then a layer
    is quantised exactly when its ``.scales`` are stored, as mlx-lm's loader decides, and with
    ``follow_stored`` every floating parameter takes the dtype it is stored in (mlx-lm's
    ``load_weights`` keeps the file's dtypes).
    """
    weight_names = set(stored) if stored is not None else None
    try:
        model_class, args_class = model_classes(config)
    except ValueError as err:
        raise DctmsError(f"not supported yet: {err}") from None
    try:
        model = model_class(args_class.from_dict(config))
    except Exception as err:  # noqa: BLE001 - mlx-lm's model code on an unusual config: its error
        raise DctmsError(
            f"config does not build a {config.get('model_type')} model: {err}"
        ) from None
    # mlx-lm's convert casts floating parameters to the target dtype before quantising.
    cast_floating(model, dtype)
    quant = config.get("quantization") or config.get("quantization_config")
    if quant and "bits" in quant:
        quantize_like_mlx_lm(model, quant, weight_names)
    if follow_stored and isinstance(stored, dict):
        _follow_stored_dtypes(model, stored)
    return model


def cast_floating(model: nn.Module, dtype: str) -> None:
    """Cast every floating parameter of ``model`` to ``dtype`` (lazily: nothing is computed)."""
    target = DTYPES[dtype]
    model.update(
        tree_unflatten(
            [
                (k, v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v)
                for k, v in tree_flatten(model.parameters())
            ]
        )
    )


def _follow_stored_dtypes(model: nn.Module, stored: dict[str, str]) -> None:
    changed = [
        (k, v.astype(DTYPES[stored[k]]))
        for k, v in tree_flatten(model.parameters())
        if mx.issubdtype(v.dtype, mx.floating)
        and stored.get(k) in DTYPES
        and dtype_name(v.dtype) != stored[k]
    ]
    if changed:
        model.update(tree_unflatten(changed))


def quantize_like_mlx_lm(model: nn.Module, quant: dict, weight_names: set[str] | None) -> None:
    """Quantise as mlx-lm does: with weights present, exactly the layers whose ``.scales`` are stored
    (its loader); without, the layers its ``convert`` would quantise (``utils.quantize_model``:
    quantisable, last axis divisible by the group size, and the model's own ``quant_predicate``)."""
    group_size, bits = int(quant["group_size"]), int(quant["bits"])
    model_predicate = getattr(model, "quant_predicate", None)

    def predicate(path: str, module: nn.Module) -> Any:
        if path in quant:  # per-layer override recorded in the config
            return quant[path]
        if not hasattr(module, "to_quantized"):
            return False
        if weight_names is not None:
            return f"{path}.scales" in weight_names
        if module.weight.shape[-1] % group_size != 0:
            return False
        return model_predicate(path, module) if model_predicate is not None else True

    nn.quantize(
        model,
        group_size=group_size,
        bits=bits,
        mode=quant.get("mode", "affine"),
        class_predicate=predicate,
    )


# ------------------------------------------------------------------------------------ static cache


class StaticKVCache:
    """A KV cache of fixed capacity written at an array position (``mx.slice_update``).

    It speaks mlx-lm's cache protocol (``offset``, ``update_and_fetch``, ``make_mask``) so the model's
    own attention code runs unchanged. Attention reads the first ``window`` positions only (a Slice
    view, masked by position): the plan is traced at the largest window and the runner instantiates
    it at the window a call needs (see ``toolkit.lengths``). The window is always a *proper* slice
    (``kv_capacity`` keeps one spare position): MLX creates no Slice for a full-range slice, and the
    graph must be the same at every window.
    """

    def __init__(self, keys: mx.array, values: mx.array, position: mx.array, window: int):
        self.keys, self.values, self.offset, self.window = keys, values, position, window

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        start = self.offset.reshape(1)
        self.keys = mx.slice_update(self.keys, k, start, axes=(2,))
        self.values = mx.slice_update(self.values, v, start, axes=(2,))
        return self.keys[:, :, : self.window, :], self.values[:, :, : self.window, :]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        queries = (self.offset + mx.arange(n))[:, None]
        keys = mx.arange(self.window)[None]
        mask = queries >= keys
        if window_size is not None:
            mask = mask & (queries < keys + window_size)
        return mask

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False


class _ProbeCache:
    """Records the key/value shapes a layer writes, so the static cache needs no shape tables."""

    def __init__(self) -> None:
        self.offset = 0
        self.shapes: tuple | None = None
        self.keys: mx.array | None = None  # read back by mlx-lm's pipeline stages (mx.depends)

    def update_and_fetch(self, k: mx.array, v: mx.array):
        self.shapes = (tuple(k.shape), tuple(v.shape), k.dtype)
        self.keys = k
        return k, v

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        defer_package_init()  # mlx-lm's model code without its package __init__
        from mlx_lm.models.base import create_attention_mask  # noqa: F401  (same defaults)

        return "causal" if n > 1 else None


def _zero_cost(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    # A broadcast scalar: the right shape and dtype for tracing, a few bytes of memory.
    return mx.broadcast_to(mx.zeros((), dtype), shape)


def probe_kv(model: nn.Module, num_layers: int, batch: int, probes: list | None = None) -> KVLayout:
    """The key/value shapes each layer writes; ``probes``: a cache object per layer, where a layer
    that is not a KV layer gets its own kind (a recurrent one: see ``toolkit.caches``), whose
    KVLayout entries are None."""
    probes = probes or [_ProbeCache() for _ in range(num_layers)]
    tokens = mx.zeros((batch, 1), mx.int32)
    try:
        model(tokens, cache=probes)
    except Exception as err:  # model code raising on an unusual config
        raise DctmsError(
            f"not supported yet: model call failed while probing its cache: {err}"
        ) from None
    kv = [p for p in probes if isinstance(p, _ProbeCache)]
    if any(p.shapes is None for p in kv):
        raise DctmsError("not supported yet: some layers never write a KV cache (shared-KV model)")
    floating = [
        v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)
    ]
    dtypes = [p.shapes[2] for p in kv] or floating[:1] or [mx.float32]
    return KVLayout(
        keys=tuple(p.shapes[0] if isinstance(p, _ProbeCache) else None for p in probes),
        values=tuple(p.shapes[1] if isinstance(p, _ProbeCache) else None for p in probes),
        dtype=dtype_name(dtypes[0]),
    )


# ------------------------------------------------------------------------------------ tracing


def kv_capacity(input_tokens: int, output_tokens: int, prefill_chunk: int) -> int:
    """Positions the static cache holds: N + M (or the padded prompt, if longer) plus one spare, so
    that the largest attention window (``max_window``) is still a proper slice of the cache."""
    padded = -(-input_tokens // prefill_chunk) * prefill_chunk  # integers: any size, exactly
    return max(input_tokens + output_tokens, padded) + 1


def max_window(capacity: int) -> int:
    """The largest attention window: every position but the spare one."""
    return capacity - 1


class PhaseTracer:
    """Traces the two phases of one model at any lengths: ``prefill(tokens, window)`` and
    ``decode(window)``; each call is one ``mx.export_function`` of the model's real code."""

    def __init__(
        self,
        model: nn.Module,
        num_layers: int,
        *,
        batch: int,
        capacity: int,
        kv_quant=None,
        rings=None,
        sampling: bool = False,
        prefix_blocks: int = 0,
    ):
        from dctms.toolkit.caches import StateLayout, probes_for  # built on this module's caches

        self.model, self.num_layers, self.batch = model, num_layers, batch
        # A batched plan (toolkit.slots): B slots, a prefill chunk of one sequence into its slot,
        # a decode step of the first ``rows`` slots each at its own position.
        self.slotted = batch > 1 or prefix_blocks > 0
        self.prefix_blocks = prefix_blocks
        # compile --sampling: mlx-lm's logits processors and sampler traced after the logits
        # (toolkit.sampling), their parameters per-call inputs
        self.sampling = sampling
        self.params = dict(tree_flatten(model.parameters()))
        self.weights = {
            k: _zero_cost(tuple(v.shape), v.dtype) for k, v in sorted(self.params.items())
        }
        # ``rings``: each layer's caches.Ring (a sliding window) or caches.Recurrent, None for a
        # full KV cache; ``kv_quant``: a caches.KVQuantization (mlx-lm's kv_bits etc.) or None.
        probes = probes_for(rings, num_layers)
        self.kv = probe_kv(model, num_layers, batch, probes)
        self.layout = StateLayout(self.kv, capacity, kv_quant, rings, probes)
        self.state = {a.name: _zero_cost(a.shape, a.dtype) for a in self.layout.arrays}

    def _caches(self, kw: dict, position, window: int, phase: str, slot) -> list:
        if not self.slotted:
            return self.layout.caches(kw, position, window, phase)
        from dctms.toolkit.slots import RowsKVCache, SlotKVCache

        pairs = [(kw[f"kv.{i}.keys"], kw[f"kv.{i}.values"]) for i in range(self.num_layers)]
        if slot is None:  # decode: ``position`` holds one position per row
            return [RowsKVCache(k, v, position, window) for k, v in pairs]
        return [SlotKVCache(k, v, position, window, slot) for k, v in pairs]

    def _step(
        self,
        tokens,
        position,
        last_index,
        window: int,
        kw: dict,
        phase: str,
        sampling=None,
        slot=None,
    ) -> tuple:
        """``sampling``: the sampling inputs by name (``toolkit.sampling``), or None: greedy."""
        model = self.model
        model.update(tree_unflatten([(k, kw[k]) for k in self.params]))
        caches = self._caches(kw, position, window, phase, slot)
        if last_index is None:
            logits = model(tokens, cache=caches)[:, -1, :]
        else:
            logits = _last_real_logits(model, tokens, caches, last_index)
        if sampling is not None:
            fed = tokens[:, -1] if last_index is None else None
            return (*sample(logits, sampling, fed), *self.layout.outputs(caches))
        # Greedy exactly as mlx-lm's generate_step: argmax of log-probabilities.
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        next_token = mx.argmax(logprobs, axis=-1)
        return (next_token, *self.layout.outputs(caches))

    def prefill(
        self, tokens: int, window: int, name: str = "prefill", paths: bool = False
    ) -> TracedPhase:
        """``tokens`` prompt tokens at ``position``; ``last_index`` picks the last real one (a
        chunk may be padded), whose greedy next token is returned. ``name``: "prefill", or
        "prefill_start" for a quantised cache's first call (see ``toolkit.caches``)."""

        def fn(tokens_, position, last_index, *rest, **kw):
            slot, rest = (rest[0], rest[1:]) if self.slotted else (None, rest)
            chosen = self._sampling_inputs(rest)
            return self._step(tokens_, position, last_index, window, kw, name, chosen, slot)

        feeds = {
            # a batched plan prefills one sequence at a time, into its slot
            "tokens": mx.zeros((1 if self.slotted else self.batch, tokens), mx.int32),
            "position": mx.array(0, mx.int32),
            "last_index": mx.array(0, mx.int32),
            **({"slot": mx.array(0, mx.int32)} if self.slotted else {}),
            **self._sampling_feeds(),
        }
        state = self._state_for(name)
        names = self._result_names(SAMPLING_OUTPUTS, self.layout.names_for(name))
        phase = _export(name, tokens, fn, feeds, self.weights, state, names)
        return self._with_paths(phase, fn, feeds, state) if paths else phase

    def decode(
        self, window: int, name: str = "decode", paths: bool = False, rows: int | None = None
    ) -> TracedPhase:
        """One token at ``position``: the previous step's next_token (shape [batch], uint32) is fed
        back as it is, so the runner can build step t+1 while step t still computes (as mlx-lm's
        generate_step does). A batched plan's decode advances ``rows`` slots (default: all), each
        at its own entry of ``positions``."""
        rows = self.batch if rows is None else rows

        def fn(tokens_, position, *rest, **kw):
            chosen = self._sampling_inputs(rest)
            return self._step(tokens_[:, None], position, None, window, kw, name, chosen)

        if self.slotted:
            where = {"positions": mx.zeros((rows,), mx.int32)}
        else:
            where = {"position": mx.array(0, mx.int32)}
        feeds = {
            "tokens": mx.zeros((rows,), mx.uint32),
            **where,
            **self._sampling_feeds(),
        }
        state = self._state_for(name)
        names = self._result_names(SAMPLING_DECODE_OUTPUTS, self.layout.names_for(name))
        phase = _export(name, 1, fn, feeds, self.weights, state, names)
        return self._with_paths(phase, fn, feeds, state) if paths else phase

    def _sampling_feeds(self) -> dict[str, mx.array]:
        return sampling_placeholders() if self.sampling else {}

    def _sampling_inputs(self, rest: tuple) -> dict[str, mx.array] | None:
        return dict(zip(SAMPLING_INPUTS, rest, strict=True)) if self.sampling else None

    def _result_names(self, sampled: tuple[str, ...], state_names) -> list[str] | int:
        """The outputs after ``next_token``: a sampling phase's own, then the state's."""
        if not self.sampling:
            return state_names
        if isinstance(state_names, int):
            state_names = [f"kv.{i}.{p}" for i in range(state_names) for p in ("keys", "values")]
        return [*sampled, *state_names]

    def _state_for(self, phase: str) -> dict[str, mx.array]:
        """The keyword state a phase is traced with: all but the cache arrays it does not use (a
        quantised cache's float arrays outside its float phases; see ``toolkit.caches``)."""
        unused = set(self.layout.names) - set(self.layout.names_for(phase))
        return {k: v for k, v in self.state.items() if k not in unused}

    def _with_paths(self, phase: TracedPhase, fn, feeds: dict, state: dict) -> TracedPhase:
        """``phase`` with the module path of every op (a second, recording trace)."""
        keywords = {**self.weights, **state}
        phase.module_paths = trace_module_paths(
            self.model, fn, list(feeds.values()), keywords, phase.ops
        )
        return phase

    def traced(self, phases: list[TracedPhase]) -> Traced:
        weight_bindings = [
            TracedBinding("", "weight", k, tuple(v.shape), dtype_name(v.dtype))
            for k, v in self.weights.items()
        ]
        decode = next(p for p in phases if p.name == "decode")
        vocab = _vocab_size(self.model, decode)
        rings = {
            a.name: (a.ring.window, a.ring.slots, a.ring.keep) for a in self.layout.arrays if a.ring
        }
        recurrent = tuple(a.name for a in self.layout.arrays if a.recurrent)
        return Traced(phases, weight_bindings, self.kv, self.num_layers, vocab, rings, recurrent)


def trace_model(
    model: nn.Module,
    num_layers: int,
    *,
    batch: int,
    prefill_chunk: int,
    capacity: int,
) -> Traced:
    """Both phases at their largest lengths: ``prefill_chunk`` tokens, the largest window."""
    tracer = PhaseTracer(model, num_layers, batch=batch, capacity=capacity)
    window = max_window(capacity)
    return tracer.traced([tracer.prefill(prefill_chunk, window), tracer.decode(window)])


def _last_real_logits(model: nn.Module, tokens: mx.array, caches: list, last_index: mx.array):
    """Logits of the chunk's last real token (the rest is padding).

    mlx-lm models compute hidden states in ``model.model`` and apply a position-wise head (tied
    embedding, lm_head, scaling, soft-capping) after it. Picking the row *before* the head, with a
    DynamicSlice at the array index, saves a [chunk x vocab] projection per prefill chunk, and the
    last layer's attention queries and feed-forward block get that row alone; models without that structure get the
    full logits sliced instead.
    """
    inner = model.get("model") if isinstance(model, dict) else None

    def pick(h: mx.array) -> mx.array:
        b, _, d = h.shape
        return mx.slice(h, last_index.reshape(1), axes=(1,), slice_size=(b, 1, d))

    def pick_along(x: mx.array, axis: int) -> mx.array:
        size = list(x.shape)
        size[axis] = 1
        return mx.slice(x, last_index.reshape(1), axes=(axis,), slice_size=tuple(size))

    if isinstance(inner, nn.Module):
        model.model = _PickLast(inner, pick)  # a plain object: kept outside the parameter tree
        try:
            # the last layer's queries and feed-forward on the picked row (``toolkit.last_row``)
            with last_layer_on_picked_row(inner, pick_along):
                return model(tokens, cache=caches)[:, -1, :]
        except _NoHiddenStates:
            pass
        finally:
            model.model = inner
    return pick(model(tokens, cache=caches))[:, 0, :]


class _NoHiddenStates(Exception):
    """``model.model`` does not return [batch, tokens, hidden] states."""


class _PickLast:
    """Stands in for ``model.model``: calls it and keeps one position; other attributes (e.g. a
    tied ``embed_tokens`` the head reuses) come from the real module."""

    def __init__(self, inner: nn.Module, pick):
        self._inner, self._pick = inner, pick

    def __call__(self, *args, **kwargs):
        h = self._inner(*args, **kwargs)
        if not isinstance(h, mx.array) or h.ndim != 3:
            raise _NoHiddenStates
        return self._pick(h)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def _vocab_size(model: nn.Module, decode: TracedPhase) -> int:
    args = getattr(model, "args", None)
    vocab = getattr(args, "vocab_size", None)
    if isinstance(vocab, int):
        return vocab
    # Fall back to the logits width: the input of the final argmax.
    for op in reversed(decode.ops):
        if op.primitive == "ArgReduce":
            return decode.tensors[op.inputs[0]].shape[-1]
    return 0


def _export(
    name: str,
    tokens: int,
    fn,
    graph_inputs: dict[str, mx.array],
    weights: dict[str, mx.array],
    state: dict[str, mx.array],
    state_order: list[str] | int,
    results: tuple[str, ...] = ("next_token",),
) -> TracedPhase:
    """One ``mx.export_function`` of ``fn``; ``state_order``: the names of the state outputs after
    ``results`` (a number of layers: ``kv.<i>.keys``, ``kv.<i>.values`` each)."""
    if isinstance(state_order, int):
        state_order = [f"kv.{i}.{p}" for i in range(state_order) for p in ("keys", "values")]
    events: list[dict] = []
    try:
        mx.export_function(events.append, fn, *graph_inputs.values(), **weights, **state)
    except DctmsError:
        raise
    except Exception as err:
        raise DctmsError(f"not supported yet: tracing the {name} graph failed: {err}") from None
    return _phase_from_events(name, tokens, list(graph_inputs), events, state_order, results)


def _phase_from_events(
    name: str,
    tokens: int,
    input_names: list[str],
    events: list[dict],
    state_order: list[str],
    results: tuple[str, ...] = ("next_token",),
) -> TracedPhase:
    tensors: dict[str, TracedTensor] = {}

    def note(entries) -> None:
        for tid, shape, dtype in entries:
            tensors[tid] = TracedTensor(tid, tuple(shape), dtype_name(dtype))

    inputs: list[TracedBinding] = []
    outputs: list[TracedBinding] = []
    constants: list[TracedConstant] = []
    ops: list[TracedOp] = []
    positional: list = []
    for ev in events:
        kind = ev["type"]
        if kind == "inputs":
            positional = ev["inputs"]
            note(positional)
        elif kind == "keyword_inputs":
            for (tid, shape, dtype), pname in zip(positional, input_names, strict=False):
                inputs.append(TracedBinding(tid, "input", pname, tuple(shape), dtype_name(dtype)))
            for key, tid in ev["keywords"]:
                t = tensors[tid]
                bkind = "state" if key.startswith("kv.") else "weight"
                inputs.append(TracedBinding(tid, bkind, key, t.shape, t.dtype))
        elif kind == "outputs":
            note(ev["outputs"])
            names = [*results, *state_order]
            for (tid, shape, dtype), oname in zip(ev["outputs"], names, strict=True):
                okind = "state" if oname.startswith("kv.") else "output"
                outputs.append(TracedBinding(tid, okind, oname, tuple(shape), dtype_name(dtype)))
        elif kind == "constants":
            for tid, arr in ev["constants"]:
                value = args_to_plain(arr.reshape(-1).tolist())
                constants.append(
                    TracedConstant(tid, tuple(arr.shape), dtype_name(arr.dtype), value)
                )
                tensors[tid] = TracedTensor(tid, tuple(arr.shape), dtype_name(arr.dtype))
        elif kind == "primitive":
            note(ev["outputs"])  # inputs are graph inputs, constants or earlier outputs
            ops.append(
                TracedOp(
                    ev["name"],
                    args_to_plain(list(ev["arguments"])),
                    tuple(i[0] for i in ev["inputs"]),
                    tuple(o[0] for o in ev["outputs"]),
                )
            )
    return TracedPhase(name, tokens, inputs, outputs, constants, ops, tensors)
