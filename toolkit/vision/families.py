"""What differs between vision-language families, in one place per family.

A family says which image sizes (after its processor) get a vision phase up to a bound, how one
image of a size becomes pixel values and feature rows, runs the vision tower and projector,
merges the feature rows into the text embeddings exactly as its mlx-vlm ``get_input_embeddings``
does (the same primitives in the same order, so the ids match mlx-vlm's), runs the language
model's body and applies its head.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from dctms.schema.errors import DctmsError


@dataclass(frozen=True)
class Size:
    phase: str
    height: int
    width: int


@dataclass(frozen=True)
class VisionFamily:
    name: str
    resolution: str  # "fixed": every image is resized to the tower's size; "dynamic"
    mrope: bool = False  # the text phases take 3-axis rotary positions

    def image_token_id(self, config: dict) -> int:
        raise NotImplementedError

    def sizes(self, config: dict, height: int, width: int) -> list[Size]:
        """The image sizes up to the bound that get a vision phase (refuses a bad bound)."""
        raise NotImplementedError

    def pixel_shape(self, config: dict, height: int, width: int) -> tuple[int, ...]:
        raise NotImplementedError

    def tokens(self, config: dict, height: int, width: int) -> int:
        raise NotImplementedError

    def hidden_size(self, model: nn.Module) -> int:
        return int(model.language_model.model.embed_tokens.weight.shape[-1])

    def vocab_size(self, model: nn.Module) -> int:
        return int(model.language_model.model.embed_tokens.weight.shape[0])

    def encode(self, model, pixel_values, dtype, height: int, width: int) -> mx.array:
        """One image's projected features, [tokens, hidden]."""
        raise NotImplementedError

    def merge(self, model, tokens, table, rows) -> mx.array:
        raise NotImplementedError

    def body(self, lm, tokens, embeds, caches, rope) -> mx.array:
        """The language model's hidden states (before the head)."""
        return lm.model(tokens, inputs_embeds=embeds, cache=caches)

    def head(self, lm, h: mx.array) -> mx.array:
        raise NotImplementedError


class Gemma3(VisionFamily):
    """SigLIP tower at a fixed resolution, average-pooled to ``mm_tokens_per_image`` tokens."""

    def image_token_id(self, config: dict) -> int:
        return int(config.get("image_token_index", 262144))

    def sizes(self, config: dict, height: int, width: int) -> list[Size]:
        side = int(config.get("vision_config", {}).get("image_size", 224))
        if (height, width) != (side, side):
            raise DctmsError(
                f"--image-size {height}x{width}: gemma3 resizes every image to its tower's "
                f"{side}x{side}; use --image-size {side}x{side}"
            )
        return [Size("vision", side, side)]

    def pixel_shape(self, config: dict, height: int, width: int) -> tuple[int, ...]:
        return (1, 3, height, width)

    def tokens(self, config: dict, height: int, width: int) -> int:
        return int(config.get("mm_tokens_per_image", 256))

    def encode(self, model, pixel_values, dtype, height, width):
        # As Gemma3 Model.get_input_embeddings: NCHW -> NHWC, tower, projector.
        hidden, _, _ = model.vision_tower(
            pixel_values.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True
        )
        return model.multi_modal_projector(hidden)[0]

    def merge(self, model, tokens, table, rows):
        # Gemma3's prepare_inputs_for_multimodal, with the scatter as a row gather.
        cfg = model.config
        embeds = model.language_model.model.embed_tokens(tokens)
        scaled = table / (cfg.hidden_size**0.5)
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        image = cfg.image_token_index
        text_mask = mx.expand_dims((tokens != image) & (tokens != pad), -1)
        pad_mask = mx.expand_dims(tokens == pad, -1)
        image_mask = mx.expand_dims(tokens == image, -1)
        final = mx.zeros(embeds.shape)
        final = mx.where(text_mask, embeds, final)
        final = mx.where(pad_mask, mx.zeros_like(final), final)
        final = mx.where(image_mask, mx.take(scaled, rows, axis=0), final)
        return final.astype(embeds.dtype)

    def head(self, lm, h):
        return lm.lm_head(h)


class Qwen2VL(VisionFamily):
    """Dynamic resolution: the processor rounds an image to multiples of ``patch x merge`` (28)
    pixels; every 14x14 patch is a row of pixel values, every 2x2 patches one image token."""

    def _cfg(self, config: dict) -> tuple[int, int, int]:
        v = config.get("vision_config", {})
        return (
            int(v.get("patch_size", 14)),
            int(v.get("spatial_merge_size", 2)),
            int(v.get("temporal_patch_size", 2)),
        )

    def image_token_id(self, config: dict) -> int:
        return int(config.get("image_token_id", 151655))

    def sizes(self, config: dict, height: int, width: int) -> list[Size]:
        patch, merge, _ = self._cfg(config)
        unit = patch * merge
        if height % unit or width % unit:
            raise DctmsError(
                f"--image-size {height}x{width}: {self.name} rounds images to multiples of "
                f"{unit} pixels; use --image-size {height // unit * unit or unit}x"
                f"{width // unit * unit or unit}"
            )
        return [
            Size(f"vision.{h}x{w}", h, w)
            for h in range(unit, height + 1, unit)
            for w in range(unit, width + 1, unit)
        ]

    def pixel_shape(self, config: dict, height: int, width: int) -> tuple[int, ...]:
        patch, _, temporal = self._cfg(config)
        channels = int(config.get("vision_config", {}).get("in_channels", 3))
        return ((height // patch) * (width // patch), channels * temporal * patch * patch)

    def tokens(self, config: dict, height: int, width: int) -> int:
        patch, merge, _ = self._cfg(config)
        return (height // (patch * merge)) * (width // (patch * merge))

    def encode(self, model, pixel_values, dtype, height, width):
        patch = model.vision_tower.config.patch_size
        grid = mx.array([[1, height // patch, width // patch]])
        dtype = model.vision_tower.patch_embed.proj.weight.dtype
        return model.vision_tower(pixel_values.astype(dtype), grid, output_hidden_states=False)

    def merge(self, model, tokens, table, rows):
        # Qwen2-VL's merge_input_ids_with_image_features for batch 1: gather the rows, select.
        embeds = model.language_model.model.embed_tokens(tokens)
        image_mask = tokens[0] == model.config.image_token_id
        gathered = mx.take(table, rows[0], axis=0)
        merged = mx.where(mx.expand_dims(image_mask, axis=-1), gathered, embeds[0])
        return mx.stack([merged], axis=0)

    def body(self, lm, tokens, embeds, caches, rope):
        return lm.model(tokens, cache=caches, inputs_embeds=embeds, position_ids=rope)

    def head(self, lm, h):
        if lm.args.tie_word_embeddings:
            return lm.model.embed_tokens.as_linear(h)
        return lm.lm_head(h)


FAMILIES: dict[str, VisionFamily] = {
    "gemma3": Gemma3("gemma3", "fixed"),
    "qwen2_vl": Qwen2VL("qwen2_vl", "dynamic", mrope=True),
}


def family_of(config: dict) -> VisionFamily:
    """The family of a VLM config.json; refuses one that is not planned yet."""
    name = config.get("model_type")
    found = FAMILIES.get(name)
    if found is None:
        raise DctmsError(
            f"not supported yet: vision-language model_type {name!r} "
            f"(planned families: {', '.join(sorted(FAMILIES))})"
        )
    return found


def is_vlm_config(config: dict) -> bool:
    """A config with a vision tower (mlx-vlm layout: a ``vision_config`` section)."""
    return isinstance(config.get("vision_config"), dict)
