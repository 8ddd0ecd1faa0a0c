"""Qwen2-VL's 3-axis rotary positions (M-RoPE) of a prompt, as its language model numbers them.

Text tokens count up on all three axes alike. An image's tokens form a (t, h, w) grid of merged
patches placed at the next position p: token (i, j, k) gets positions (p + i, p + j, p + k); the
text after it continues at one past the largest position used. Decoding continues from there: a
generated token at cache position q has position q + delta on every axis, where delta = (largest
prompt position + 1) - prompt length.
"""

from __future__ import annotations

from collections.abc import Sequence


def mrope_positions(
    ids: Sequence[int], image_token_id: int, grids: Sequence[tuple[int, int, int]]
) -> tuple[list[list[int]], int]:
    """([3][len(ids)] positions, delta) for ``ids`` whose images have merged-patch ``grids``
    (one (t, h, w) per image, in prompt order; each image's t*h*w image tokens are contiguous)."""
    axes: list[list[int]] = [[], [], []]
    p, i, image = 0, 0, 0
    while i < len(ids):
        if ids[i] == image_token_id and image < len(grids):
            t, h, w = grids[image]
            for ti in range(t):
                for hi in range(h):
                    for wi in range(w):
                        for axis, offset in zip(axes, (ti, hi, wi), strict=True):
                            axis.append(p + offset)
            p += max(t, h, w)
            i += t * h * w
            image += 1
        else:
            for axis in axes:
                axis.append(p)
            p += 1
            i += 1
    if len(axes[0]) != len(ids):
        raise ValueError("an image's tokens run past the end of the prompt")
    return axes, p - len(ids)
