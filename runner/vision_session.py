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
        self.encoders = {v.phase: PhaseProgram(phases[v.phase]) for v in plan.vision.variants}
        table = next(b for b in phases["prefill"].inputs if b.name == "image_features")
        self.table = mx.zeros(table.shape, dtype=dtype_from_name(table.dtype))
        mx.eval(self.table)
        self.rows: Sequence[int] = ()
        self.rope: Sequence[Sequence[int]] | None = None
        self.rope_delta = 0
        self.vision_s = 0.0

    def held_bytes(self) -> int:
        held = super().held_bytes() + self.table.nbytes
        return held + sum(
            a.nbytes for p in self.encoders.values() for a in p.constants.values()
        )

    def encode_images(self, pixels: Sequence[np.ndarray], phases: Sequence[str]) -> None:
        """Run each image's vision phase once, filling rows from k*T of the table."""
        t = self.plan.vision.tokens_per_image
        if len(pixels) > self.plan.vision.images:
            raise DctmsError(f"{len(pixels)} images, the plan allows {self.plan.vision.images}")
        for k, (px, phase) in enumerate(zip(pixels, phases, strict=True)):
            out = self.encoders[phase].run(
                {
                    "pixel_values": mx.array(px),
                    "image_features": self.table,
                    "row": mx.array(k * t, dtype=mx.int32),
                },
                self.weights,
                {},
                wait=True,  # the plan counts one vision call's inputs: never two at once
            )
            self.table = out["image_features"]

    def generate_vision(self, request, inputs, **kw) -> Generation:
        """Encode the images of ``inputs`` (``vision_input.prepare``), then generate as the text
        session does; TTFT covers both."""
        if len(inputs.image_rows) != len(request.prompt):
            raise ValueError("image_rows must have one entry per prompt token")
        start = time.perf_counter()
        self.encode_images(inputs.pixels, inputs.phases)
        self.vision_s = time.perf_counter() - start
        self.rows, self.rope, self.rope_delta = inputs.image_rows, inputs.rope, inputs.rope_delta
        gen = self.generate(request, **kw)
        gen.ttft_s += self.vision_s
        return gen

    def _prefill(self, prompt: list[int]) -> mx.array:
        out: dict[str, mx.array] = {}
        rows = list(self.rows) or [0] * len(prompt)
        rope = self.rope or [list(range(len(prompt)))] * 3
        for start in range(0, len(prompt), self.chunk):
            piece = prompt[start : start + self.chunk]
            pad = self.chunk - len(piece)
            feeds = {
                "tokens": mx.array([piece + [0] * pad], dtype=mx.int32),
                "position": mx.array(start, dtype=mx.int32),
                "last_index": mx.array(len(piece) - 1, dtype=mx.int32),
                "image_features": self.table,
                "image_rows": mx.array(
                    [rows[start : start + self.chunk] + [0] * pad], dtype=mx.int32
                ),
            }
            if self.plan.vision.mrope:
                axes = [list(a[start : start + self.chunk]) + [0] * pad for a in rope]
                feeds["rope_positions"] = mx.array([[a] for a in axes], dtype=mx.int32)
            out = self.prefill.run(feeds, self.weights, self.state, wait=False)
        token = out["next_token"]
        mx.eval(token)
        return token

    def _decode(self, token: mx.array, position: int) -> mx.array:
        feeds = {"tokens": token, "position": mx.array(position, dtype=mx.int32)}
        if self.plan.vision.mrope:
            at = position + self.rope_delta
            feeds["rope_positions"] = mx.full((3, 1, 1), at, dtype=mx.int32)
        return self.decode.run(feeds, self.weights, self.state, wait=False)["next_token"]
