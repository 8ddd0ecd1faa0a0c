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


# Images wider than tall (or taller than wide) beyond this are refused before decoding: a strip of
# pixels, not a picture (Qwen2-VL's processor refuses them itself, with a traceback before).
MAX_ASPECT = 200


def read_images(paths: list[str], plan: Plan, processor=None) -> list:
    """The images as RGB PIL images; refuses more than the plan's K before opening any, and each
    image's size from its header alone (before decoding): an aspect ratio above ``MAX_ASPECT``,
    more pixels than PIL's decompression-bomb bound, or (given the ``processor``) a size the
    processor would turn into one over the plan's bound."""
    vision = _vision(plan)
    if len(paths) > vision.images:
        raise ImageRefused(
            f"{len(paths)} images, but the plan allows at most {vision.images} per call; "
            f"recompile with --images {len(paths)}"
        )
    return [_read_image(path, k, vision, processor) for k, path in enumerate(paths)]


def _read_image(path: str, k: int, vision, processor):
    import warnings
    import zlib

    from PIL import Image, UnidentifiedImageError

    p = Path(path)
    if not p.is_file():
        raise DctmsError(f"--image {path}: no such file")
    unreadable = (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, zlib.error)
    try:
        with warnings.catch_warnings():
            # PIL warns above its pixel bound and raises above twice it; both refused below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(p)
        with img:
            if img.format not in ("PNG", "JPEG"):
                raise DctmsError(f"--image {path}: {img.format} image; PNG or JPEG only")
            width, height = img.size
            _check_header_size(path, k, height, width, vision, processor)
            return img.convert("RGB")
    except Image.DecompressionBombError as err:
        raise ImageRefused(f"--image {path}: too many pixels to decode ({err})") from None
    except unreadable as err:
        raise DctmsError(f"--image {path}: not a readable image ({err})") from None


def _check_header_size(path: str, k: int, height: int, width: int, vision, processor) -> None:
    from PIL import Image

    if min(height, width) < 1 or max(height, width) > MAX_ASPECT * min(height, width):
        raise ImageRefused(
            f"--image {path}: {height}x{width} pixels (height x width), an aspect ratio above "
            f"{MAX_ASPECT}:1"
        )
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and height * width > limit:
        raise ImageRefused(
            f"--image {path}: {height}x{width} pixels, more than the {limit:,} an image may "
            "have to be decoded (PIL's decompression-bomb bound)"
        )
    size = processed_size(processor, height, width) if processor is not None else None
    if size is not None and size not in {(v.height, v.width) for v in vision.variants}:
        raise _over_bound(k, size, vision)


def processed_size(processor, height: int, width: int) -> tuple[int, int] | None:
    """The size ``processor`` resizes a ``height`` x ``width`` image to, from its own settings and
    resizing rule, without the pixels; None when it is not one of the kinds known here."""
    import importlib

    size = processor.size if isinstance(processor.size, dict) else vars(processor.size)
    if size.get("height") and size.get("width"):  # fixed resolution (gemma3's SigLIP)
        return int(size["height"]), int(size["width"])
    rule = getattr(importlib.import_module(type(processor).__module__), "smart_resize", None)
    if rule is None or not size.get("shortest_edge") or not size.get("longest_edge"):
        return None
    factor = int(processor.patch_size) * int(processor.merge_size)  # dynamic resolution (qwen2_vl)
    return tuple(
        rule(height, width, factor, int(size["shortest_edge"]), int(size["longest_edge"]))
    )


def _over_bound(k: int, size: tuple[int, int], vision) -> ImageRefused:
    h, w = size
    bound = f"{vision.image_size[0]}x{vision.image_size[1]}"
    return ImageRefused(
        f"image {k + 1} is {h}x{w} after preprocessing, the plan's bound is {bound}; "
        f"recompile with --image-size {max(h, vision.image_size[0])}x"
        f"{max(w, vision.image_size[1])}"
    )


def prepare(
    plan: Plan,
    folder: Path,
    tokenizer,
    text: str,
    images: list,
    processor=None,
    add_special_tokens: bool = True,
) -> VisionInputs:
    """Token ids and pixel values for ``text`` with ``images``, checked against the plan's bounds
    (number of images, size after preprocessing; the prompt length is the request's);
    ``processor``: the folder's image processor when already loaded (``image_processor``);
    ``add_special_tokens`` False: the text is a rendered chat template that holds them already."""
    vision = _vision(plan)
    prompting = PROMPTING.get(vision.family)
    if prompting is None:
        raise DctmsError(f"not supported yet: running {vision.family} plans")
    variants = {(v.height, v.width): v for v in vision.variants}
    pixels, phases, grids, counts = [], [], [], []
    name = ""
    if images:
        processor = processor or image_processor(folder)
        name = type(processor).__name__
        for k, img in enumerate(images):
            try:
                out = processor(images=[img], return_tensors="np")
            except (ValueError, TypeError, ArithmeticError, OSError) as err:
                raise ImageRefused(f"image {k + 1}: {name} refuses it: {err}") from None
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
                raise _over_bound(k, size, vision)
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


def image_processor(folder: Path):
    """The folder's image processor, loaded as mlx-vlm loads it (the slow one first)."""
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
