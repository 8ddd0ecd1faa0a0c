"""A run of a vision-language plan: the text session plus the vision phase and its features table.

Order: the text ``Session`` opens (fingerprint, limits, weights, KV state), then the features
table is allocated once at the plan's ``feature_rows``; each image runs the plan's ``vision``
phase, which writes its rows into the table; prefill reads the rows of the image-token positions
(``image_rows``). Images and prompt were checked against the plan before (``vision_input``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from dctms.runner.execute import PhaseProgram
from dctms.runner.primitives import dtype_from_name
from dctms.runner.session import Generation, Session
from dctms.schema.errors import DctmsError


class VisionSession(Session):
    def __init__(self, plan, model, verify_hashes: bool = False):
        if plan.vision is None:
            raise DctmsError("not a vision-language plan")
        super().__init__(plan, model, verify_hashes)
        phases = {p.name: p for p in plan.phases}
        self.vision = PhaseProgram(phases["vision"])
        table = next(b for b in phases["prefill"].inputs if b.name == "image_features")
        self.table = mx.zeros(table.shape, dtype=dtype_from_name(table.dtype))
        mx.eval(self.table)
        self.rows: Sequence[int] = ()
        self.vision_s = 0.0

    def held_bytes(self) -> int:
        return super().held_bytes() + self.table.nbytes + sum(
            a.nbytes for a in self.vision.constants.values()
        )

    def encode_images(self, pixels: Sequence[np.ndarray]) -> None:
        """Run the vision phase once per image, filling rows k*T .. (k+1)*T of the table."""
        t = self.plan.vision.tokens_per_image
        if len(pixels) > self.plan.vision.images:
            raise DctmsError(f"{len(pixels)} images, the plan allows {self.plan.vision.images}")
        for k, px in enumerate(pixels):
            out = self.vision.run(
                {
                    "pixel_values": mx.array(px),
                    "image_features": self.table,
                    "row": mx.array(k * t, dtype=mx.int32),
                },
                self.weights,
                {},
            )
            self.table = out["image_features"]

    def generate_vision(self, request, pixels: Sequence[np.ndarray], rows: Sequence[int], **kw
                        ) -> Generation:
        """Encode the images, then generate as the text session does; TTFT covers both."""
        if len(rows) != len(request.prompt):
            raise ValueError("image_rows must have one entry per prompt token")
        start = time.perf_counter()
        self.encode_images(pixels)
        self.vision_s = time.perf_counter() - start
        self.rows = rows
        gen = self.generate(request, **kw)
        gen.ttft_s += self.vision_s
        return gen

    def _prefill(self, prompt: list[int]) -> mx.array:
        out: dict[str, mx.array] = {}
        rows = list(self.rows) or [0] * len(prompt)
        for start in range(0, len(prompt), self.chunk):
            piece = prompt[start : start + self.chunk]
            pad = self.chunk - len(piece)
            out = self.prefill.run(
                {
                    "tokens": mx.array([piece + [0] * pad], dtype=mx.int32),
                    "position": mx.array(start, dtype=mx.int32),
                    "last_index": mx.array(len(piece) - 1, dtype=mx.int32),
                    "image_features": self.table,
                    "image_rows": mx.array(
                        [rows[start : start + self.chunk] + [0] * pad], dtype=mx.int32
                    ),
                },
                self.weights,
                self.state,
                wait=False,
            )
        token = out["next_token"]
        mx.eval(token)
        return token
