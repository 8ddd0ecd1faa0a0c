"""Images and prompt of a vision-language request, checked against the plan before anything is
allocated in MLX.

Images (PNG/JPEG) go through the family's image processor from ``transformers``, loaded from the
model folder the way mlx-vlm's processors load it (``AutoImageProcessor``, the slow processor
first); the prompt's image placeholders are expanded to the image's tokens as mlx-vlm's processor
expands them. This module imports no mlx-vlm code (the runner never imports model code).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dctms.schema.errors import DctmsError
from dctms.schema.types import Plan


class ImageRefused(DctmsError):
    """An image (or a number of images) the plan was not compiled for."""


@dataclass(frozen=True)
class Prompting:
    """How a family's prompt marks an image and what one image becomes in it."""

    placeholder: str  # counted in the prompt: one per image
    unmarked: str  # put before the prompt for each image it does not mark
    expansion: str  # the placeholder is replaced by this, {tokens} = the image's tokens
    image_token: str


PROMPTING = {
    "gemma3": Prompting(
        "<start_of_image>",
        "<start_of_image>",
        "\n\n<start_of_image>{tokens}<end_of_image>\n\n",
        "<image_soft_token>",
    ),
    "qwen2_vl": Prompting(
        "<|image_pad|>", "<|vision_start|><|image_pad|><|vision_end|>", "{tokens}", "<|image_pad|>"
    ),
}


@dataclass(frozen=True)
class VisionInputs:
    prompt: tuple[int, ...]  # token ids, image tokens expanded
    pixels: tuple[np.ndarray, ...]  # one pixel_values array per image, its variant's shape
    phases: tuple[str, ...]  # the vision phase (variant) of each image
    image_rows: tuple[int, ...]  # per prompt position: the features-table row (0 for text)
    processor: str  # the image processor class that ran
    rope: tuple[tuple[int, ...], ...] | None = None  # [3][len(prompt)] M-RoPE positions
    rope_delta: int = 0  # decode position = cache position + rope_delta (M-RoPE)


def read_images(paths: list[str], plan: Plan) -> list:
    """The images as RGB PIL images; refuses more than the plan's K before opening any."""
    vision = _vision(plan)
    if len(paths) > vision.images:
        raise ImageRefused(
            f"{len(paths)} images, but the plan allows at most {vision.images} per call; "
            f"recompile with --images {len(paths)}"
        )
    from PIL import Image, UnidentifiedImageError

    images = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise DctmsError(f"--image {path}: no such file")
        try:
            with Image.open(p) as img:
                if img.format not in ("PNG", "JPEG"):
                    raise DctmsError(f"--image {path}: {img.format} image; PNG or JPEG only")
                images.append(img.convert("RGB"))
        except (UnidentifiedImageError, OSError) as err:
            raise DctmsError(f"--image {path}: not a readable image ({err})") from None
    return images


def prepare(
    plan: Plan,
    folder: Path,
    tokenizer,
    text: str,
    images: list,
    add_special_tokens: bool = True,
) -> VisionInputs:
    """Token ids and pixel values for ``text`` with ``images``, checked against the plan's bounds
    (number of images, size after preprocessing; the prompt length is the request's).
    ``add_special_tokens`` False: the text is a rendered chat template that holds them already."""
    vision = _vision(plan)
    prompting = PROMPTING.get(vision.family)
    if prompting is None:
        raise DctmsError(f"not supported yet: running {vision.family} plans")
    variants = {(v.height, v.width): v for v in vision.variants}
    pixels, phases, grids, counts = [], [], [], []
    name = ""
    if images:
        processor = _image_processor(folder)
        name = type(processor).__name__
        for k, img in enumerate(images):
            out = processor(images=[img], return_tensors="np")
            px = np.asarray(out["pixel_values"], dtype=np.float32)
            if "image_grid_thw" in out:  # dynamic resolution: the grid of 14x14 patches
                t, gh, gw = (int(x) for x in np.asarray(out["image_grid_thw"])[0])
                patch, merge = int(processor.patch_size), int(processor.merge_size)
                size = (gh * patch, gw * patch)
                grids.append((t, gh // merge, gw // merge))
            else:
                size = tuple(int(x) for x in px.shape[-2:])
            variant = variants.get(size)
            if variant is None or list(px.shape) != list(variant.pixel_shape):
                h, w = size
                bound = f"{vision.image_size[0]}x{vision.image_size[1]}"
                raise ImageRefused(
                    f"image {k + 1} is {h}x{w} after preprocessing, the plan's bound is {bound}; "
                    f"recompile with --image-size {max(h, vision.image_size[0])}x"
                    f"{max(w, vision.image_size[1])}"
                )
            pixels.append(px)
            phases.append(variant.phase)
            counts.append(variant.tokens)
    marked = text.count(prompting.placeholder)
    if marked > len(images):
        raise DctmsError(
            f"the prompt marks {marked} images ({prompting.placeholder}), but {len(images)} "
            "were given"
        )
    # Images the prompt does not mark go first, as a chat template puts them.
    text = prompting.unmarked * (len(images) - marked) + text
    pieces = text.split(prompting.placeholder)
    expanded = pieces[0]
    for count, piece in zip(counts, pieces[1:], strict=True):
        expanded += prompting.expansion.format(tokens=prompting.image_token * count) + piece
    ids = tokenizer.encode(expanded, add_special_tokens=add_special_tokens)
    rows, image, within = [], 0, 0
    for t in ids:
        if t == vision.image_token_id and image < len(counts):
            rows.append(image * vision.tokens_per_image + within)
            within += 1
            if within == counts[image]:
                image, within = image + 1, 0
        else:
            rows.append(0)
    found = sum(1 for t in ids if t == vision.image_token_id)
    if found != sum(counts):
        raise DctmsError(
            f"the prompt holds {found} image tokens, its {len(images)} images need "
            f"{sum(counts)} (the text itself uses the image token?)"
        )
    rope, delta = None, 0
    if vision.mrope:
        from dctms.runner.vision_rope import mrope_positions

        axes, delta = mrope_positions(ids, vision.image_token_id, grids)
        rope = tuple(tuple(a) for a in axes)
    return VisionInputs(
        tuple(ids), tuple(pixels), tuple(phases), tuple(rows), name, rope, delta
    )


def _image_processor(folder: Path):
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoImageProcessor

    try:
        try:
            return AutoImageProcessor.from_pretrained(str(folder), use_fast=False)
        except ValueError:
            return AutoImageProcessor.from_pretrained(str(folder))
    except Exception as err:  # transformers raises many exception types here
        raise DctmsError(f"{folder}: cannot load the image processor: {err}") from None


def _vision(plan: Plan):
    if plan.vision is None:
        raise DctmsError("--image: the plan is not a vision-language plan (compile with --images)")
    return plan.vision
