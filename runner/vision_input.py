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


# Per family: the placeholder a prompt marks an image with, and what one image becomes.
_GEMMA3 = ("<start_of_image>", "\n\n<start_of_image>{tokens}<end_of_image>\n\n", "<image_soft_token>")


@dataclass(frozen=True)
class VisionInputs:
    prompt: tuple[int, ...]  # token ids, image tokens expanded
    pixels: tuple[np.ndarray, ...]  # one pixel_values array per image, the plan's pixel shape
    image_rows: tuple[int, ...]  # per prompt position: the features-table row (0 for text)
    processor: str  # the image processor class that ran


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


def prepare(plan: Plan, folder: Path, tokenizer, text: str, images: list) -> VisionInputs:
    """Token ids and pixel values for ``text`` with ``images``, checked against the plan's bounds
    (number of images, pixel shape after preprocessing; the prompt length is the request's)."""
    vision = _vision(plan)
    if vision.family != "gemma3":
        raise DctmsError(f"not supported yet: running {vision.family} plans")
    placeholder, expansion, image_token = _GEMMA3
    pixels: list[np.ndarray] = []
    name = ""
    if images:
        processor = _image_processor(folder)
        name = type(processor).__name__
        for k, img in enumerate(images):
            out = processor(images=[img], return_tensors="np")
            px = np.asarray(out["pixel_values"], dtype=np.float32)
            if list(px.shape) != list(vision.pixel_shape):
                h, w = px.shape[-2:]
                raise ImageRefused(
                    f"image {k + 1} is {h}x{w} after preprocessing, the plan's bound is "
                    f"{vision.image_size[0]}x{vision.image_size[1]}; recompile with "
                    f"--image-size {h}x{w}"
                )
            pixels.append(px)
    marked = text.count(placeholder)
    if marked > len(images):
        raise DctmsError(
            f"the prompt marks {marked} images ({placeholder}), but {len(images)} were given"
        )
    # Images the prompt does not mark go first, as a chat template puts them.
    text = placeholder * (len(images) - marked) + text
    soft = expansion.format(tokens=image_token * vision.tokens_per_image)
    ids = tokenizer.encode(text.replace(placeholder, soft))
    rows, seen = [], 0
    for t in ids:
        if t == vision.image_token_id:
            rows.append(seen)
            seen += 1
        else:
            rows.append(0)
    if seen != vision.tokens_per_image * len(images):
        raise DctmsError(
            f"the prompt holds {seen} image tokens, {len(images)} images need "
            f"{vision.tokens_per_image * len(images)} (the text itself uses the image token?)"
        )
    return VisionInputs(tuple(ids), tuple(pixels), tuple(rows), name)


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
