"""Pass 1 for vision-language models: the real MLX graphs of an mlx-vlm model, three phases.

* ``vision``: one image's ``pixel_values`` (as the family's processor makes them) through the
  vision tower and the projector; the projected features are written into rows ``row ..
  row + T`` of the ``image_features`` table (``mx.slice_update`` at an array start, so one graph
  serves every image). Only this table outlives the phase.
* ``prefill``: a chunk of ``tokens`` whose image-token positions take their embedding from the
  table (``image_rows`` says which row), merged exactly as the family's ``get_input_embeddings``
  merges them, then the language model against the static KV cache.
* ``decode``: one token through the language model (text embeddings only).

The language model is mlx-vlm's own (``model.language_model``), traced with the same static
cache as text plans (``toolkit.trace.StaticKVCache``). This module imports mlx-vlm; nothing on the
text path imports it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from dctms.schema.errors import DctmsError
from dctms.toolkit.module_paths import trace_module_paths
from dctms.toolkit.trace import (
    DTYPES,
    KVLayout,
    StaticKVCache,
    Traced,
    TracedBinding,
    TracedPhase,
    _export,
    _ProbeCache,
    _zero_cost,
    cast_floating,
)
from dctms.toolkit.vision.families import VisionFamily, family_of


def build_vlm(config: dict, dtype: str) -> nn.Module:
    """mlx-vlm's own model class for ``config`` (lazy parameters, cast to ``dtype``)."""
    try:
        from mlx_vlm.utils import get_model_and_args, update_module_configs
    except ImportError as err:
        raise DctmsError(
            f"vision-language models need mlx-vlm (pip install 'dctms[vlm]'): {err}"
        ) from None
    try:
        arch, _ = get_model_and_args(dict(config))
        cfg = dict(config)
        cfg.setdefault("text_config", {})
        cfg.setdefault("vision_config", {})
        model_config = arch.ModelConfig.from_dict(cfg)
        model_config = update_module_configs(
            model_config, arch, cfg, ["text", "vision", "perceiver", "projector", "audio"]
        )
        model = arch.Model(model_config)
    except Exception as err:  # noqa: BLE001 - mlx-vlm's model code on an unusual config
        raise DctmsError(
            f"config does not build a {config.get('model_type')} mlx-vlm model: {err}"
        ) from None
    cast_floating(model, dtype)
    return model


@dataclass(frozen=True)
class VisionShapes:
    """The features table: K images of at most T rows each, ``hidden`` wide."""

    tokens_per_image: int  # T: the most feature rows one image fills
    images: int  # K
    hidden: int

    @property
    def feature_rows(self) -> int:
        return self.images * self.tokens_per_image


class VisionTracer:
    """Traces the three phases of one mlx-vlm model; each is one ``mx.export_function``."""

    def __init__(
        self,
        model: nn.Module,
        family: VisionFamily,
        shapes: VisionShapes,
        *,
        capacity: int,
        dtype: str,
    ):
        self.model, self.family, self.shapes = model, family, shapes
        self.lm = model.language_model
        self.num_layers = len(self.lm.layers)
        self.dtype = DTYPES[dtype]
        self.params = dict(tree_flatten(model.parameters()))
        self.weights = {
            k: _zero_cost(tuple(v.shape), v.dtype) for k, v in sorted(self.params.items())
        }
        self.kv = self._probe_kv()
        state = {}
        for i in range(self.num_layers):
            for part, per_layer in (("keys", self.kv.keys), ("values", self.kv.values)):
                b, h, _, d = per_layer[i]
                state[f"kv.{i}.{part}"] = _zero_cost((b, h, capacity, d), DTYPES[self.kv.dtype])
        self.state = state
        self.table = mx.zeros((shapes.feature_rows, shapes.hidden), self.dtype)

    def _probe_kv(self) -> KVLayout:
        probes = [_ProbeCache() for _ in range(self.num_layers)]
        try:
            self.lm(mx.zeros((1, 1), mx.int32), cache=probes)
        except Exception as err:  # noqa: BLE001
            raise DctmsError(f"not supported yet: language model call failed: {err}") from None
        if any(p.shapes is None for p in probes):
            raise DctmsError("not supported yet: some layers never write a KV cache")
        return KVLayout(
            keys=tuple(p.shapes[0] for p in probes),
            values=tuple(p.shapes[1] for p in probes),
            dtype=str(probes[0].shapes[2]).split(".")[-1],
        )

    def _use(self, kw: dict) -> None:
        self.model.update(tree_unflatten([(k, kw[k]) for k in self.params]))

    def _caches(self, kw: dict, position: mx.array, window: int) -> list[StaticKVCache]:
        return [
            StaticKVCache(kw[f"kv.{i}.keys"], kw[f"kv.{i}.values"], position, window)
            for i in range(self.num_layers)
        ]

    def _greedy(self, logits: mx.array, caches) -> tuple:
        # Greedy exactly as mlx-vlm's generate_step: argmax of log-probabilities.
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        outs = [mx.argmax(logprobs, axis=-1)]
        for c in caches:
            outs += [c.keys, c.values]
        return tuple(outs)

    def vision(
        self, name: str, pixel_shape: tuple[int, ...], height: int, width: int, tokens: int
    ) -> TracedPhase:
        """One image of ``height`` x ``width`` into rows ``row .. row + tokens`` of the table."""

        def fn(pixel_values, image_features, row, **kw):
            self._use(kw)
            feats = self.family.encode(self.model, pixel_values, self.dtype, height, width)
            return (mx.slice_update(image_features, feats, row.reshape(1), axes=(0,)),)

        feeds = {
            "pixel_values": mx.zeros(pixel_shape, mx.float32),
            "image_features": self.table,
            "row": mx.array(0, mx.int32),
        }
        phase = _export(name, tokens, fn, feeds, self.weights, {}, 0)
        phase = self._with_paths(phase, fn, feeds, {})
        out = phase.outputs[0]
        phase.outputs = [dataclasses.replace(out, name="image_features")]
        return phase

    def prefill(self, tokens: int, window: int) -> TracedPhase:
        def fn(tokens_, position, last_index, image_features, image_rows, rope=None, **kw):
            self._use(kw)
            caches = self._caches(kw, position, window)
            embeds = self.family.merge(self.model, tokens_, image_features, image_rows)
            h = self.family.body(self.lm, tokens_, embeds, caches, rope)
            b, _, d = h.shape
            # The chunk's last real token only (the rest is padding), before the head.
            h = mx.slice(h, last_index.reshape(1), axes=(1,), slice_size=(b, 1, d))
            logits = self.family.head(self.lm, h)[:, -1, :]
            return self._greedy(logits, caches)

        feeds = {
            "tokens": mx.zeros((1, tokens), mx.int32),
            "position": mx.array(0, mx.int32),
            "last_index": mx.array(0, mx.int32),
            "image_features": self.table,
            "image_rows": mx.zeros((1, tokens), mx.int32),
        }
        if self.family.mrope:
            feeds["rope_positions"] = mx.zeros((3, 1, tokens), mx.int32)
        phase = _export("prefill", tokens, fn, feeds, self.weights, self.state, self.num_layers)
        return self._with_paths(phase, fn, feeds, self.state)

    def decode(self, window: int) -> TracedPhase:
        def fn(tokens_, position, rope=None, **kw):
            self._use(kw)
            caches = self._caches(kw, position, window)
            h = self.family.body(self.lm, tokens_[:, None], None, caches, rope)
            logits = self.family.head(self.lm, h)[:, -1, :]
            return self._greedy(logits, caches)

        feeds = {"tokens": mx.zeros((1,), mx.uint32), "position": mx.array(0, mx.int32)}
        if self.family.mrope:
            feeds["rope_positions"] = mx.zeros((3, 1, 1), mx.int32)
        phase = _export("decode", 1, fn, feeds, self.weights, self.state, self.num_layers)
        return self._with_paths(phase, fn, feeds, self.state)

    def _with_paths(self, phase: TracedPhase, fn, feeds: dict, state: dict) -> TracedPhase:
        """``phase`` with the mlx-vlm module path of every op (``vision_tower...``,
        ``multi_modal_projector``, ``language_model.model.layers.3.self_attn``): a second,
        recording trace, as text phases get (``toolkit.module_paths``)."""
        phase.module_paths = trace_module_paths(
            self.model, fn, list(feeds.values()), {**self.weights, **state}, phase.ops
        )
        return phase

    def traced(self, phases: list[TracedPhase]) -> Traced:
        weight_bindings = [
            TracedBinding("", "weight", k, tuple(v.shape), str(v.dtype).split(".")[-1])
            for k, v in self.weights.items()
        ]
        vocab = int(self.family.vocab_size(self.model))
        return Traced(phases, weight_bindings, self.kv, self.num_layers, vocab)


__all__ = ["VisionShapes", "VisionTracer", "build_vlm", "family_of"]
