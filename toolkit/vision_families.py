"""What differs between vision-language families, in one place per family.

A family says how one image of a given (preprocessed) size becomes pixel values and feature rows,
runs the vision tower and projector, merges the feature rows into the text embeddings exactly as
its mlx-vlm ``get_input_embeddings`` does (the same primitives in the same order, so the ids match
mlx-vlm's), and applies the language model's head.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from dctms.schema.errors import DctmsError


@dataclass(frozen=True)
class VisionFamily:
    name: str
    resolution: str  # "fixed": every image is resized to the tower's size; "dynamic"

    def image_token_id(self, config: dict) -> int:
        raise NotImplementedError

    def check_size(self, config: dict, height: int, width: int) -> None:
        raise NotImplementedError

    def pixel_shape(self, config: dict, height: int, width: int) -> tuple[int, ...]:
        raise NotImplementedError

    def tokens_per_image(self, config: dict, height: int, width: int) -> int:
        raise NotImplementedError

    def hidden_size(self, model: nn.Module) -> int:
        return int(model.language_model.model.embed_tokens.weight.shape[-1])

    def vocab_size(self, model: nn.Module) -> int:
        return int(model.language_model.model.embed_tokens.weight.shape[0])

    def encode(self, model: nn.Module, pixel_values: mx.array, dtype: mx.Dtype) -> mx.array:
        raise NotImplementedError

    def merge(
        self, model: nn.Module, tokens: mx.array, table: mx.array, rows: mx.array
    ) -> mx.array:
        raise NotImplementedError

    def head(self, lm: nn.Module, h: mx.array) -> mx.array:
        raise NotImplementedError


class Gemma3(VisionFamily):
    """SigLIP tower at a fixed resolution, average-pooled to ``mm_tokens_per_image`` tokens."""

    def image_token_id(self, config: dict) -> int:
        return int(config.get("image_token_index", 262144))

    def _side(self, config: dict) -> int:
        return int(config.get("vision_config", {}).get("image_size", 224))

    def check_size(self, config: dict, height: int, width: int) -> None:
        side = self._side(config)
        if (height, width) != (side, side):
            raise DctmsError(
                f"--image-size {height}x{width}: gemma3 resizes every image to its tower's "
                f"{side}x{side}; use --image-size {side}x{side}"
            )

    def pixel_shape(self, config: dict, height: int, width: int) -> tuple[int, ...]:
        return (1, 3, height, width)

    def tokens_per_image(self, config: dict, height: int, width: int) -> int:
        return int(config.get("mm_tokens_per_image", 256))

    def encode(self, model: nn.Module, pixel_values: mx.array, dtype: mx.Dtype) -> mx.array:
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


FAMILIES: dict[str, VisionFamily] = {"gemma3": Gemma3("gemma3", "fixed")}


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
