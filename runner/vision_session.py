"""A run of a vision-language plan: the text session plus the vision phases and their table.

Order: the text ``Session`` opens (fingerprint, limits, weights, KV state), then the features
table is allocated once at the plan's ``feature_rows``; image k runs the vision phase of its size,
which writes its rows (from k * tokens_per_image) into the table; prefill reads the rows of the
image-token positions (``image_rows``). Images and prompt were checked against the plan before
(``vision_input``).

What runs when is the plan's ``vision.overlap``: serially (every image encoded and waited for,
then prefill), or overlapped: the vision calls run on a second MLX stream, one at a time in image
order, while prefill runs on the default stream; before the prefill call that first reads image
k's rows the host waits for image k (the sync point where the streams meet) and launches image
k + 1. So image k + 1 is encoded while the text between the two images (and image k's tokens)
is prefilled. ``serial=True`` runs an overlapped plan serially (it then uses less memory).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from dctms.runner.execute import PhaseProgram
from dctms.runner.primitives import dtype_from_name
from dctms.runner.session import Generation, Session, throttle_limit
from dctms.schema.errors import DctmsError


class VisionSession(Session):
    TAKES_IMAGES = True

    def __init__(self, plan, model, verify_hashes: bool = False):
        if plan.vision is None:
            raise DctmsError("not a vision-language plan")
        super().__init__(plan, model, verify_hashes)
        phases = {p.name: p for p in plan.phases}
        overlap = plan.vision.overlap
        # Overlapped calls are created under the vision stream's context, op by op (a recorded
        # replay would not follow the stream).
        self.encoders = {
            v.phase: PhaseProgram(phases[v.phase], replay=not overlap)
            for v in plan.vision.variants
        }
        self.vision_stream = mx.new_stream(mx.default_device()) if overlap else None
        table = next(b for b in phases["prefill"].inputs if b.name == "image_features")
        self.table = mx.zeros(table.shape, dtype=dtype_from_name(table.dtype))
        mx.eval(self.table)
        self.rows: Sequence[int] = ()
        self.rope: Sequence[Sequence[int]] | None = None
        self.rope_delta = 0
        self.pending: list[tuple[np.ndarray, str, int]] = []  # (pixels, phase, first chunk)
        self.vision_s = 0.0

    def apply_limits(self, foreign_bytes: int | None = None) -> None:
        """As the text session; with overlapped streams one op of each may start just under the
        limit, so the limit leaves room for the largest op of both."""
        super().apply_limits(foreign_bytes)
        if self.plan.vision is None or not self.plan.vision.overlap:
            return
        if foreign_bytes is None:
            foreign_bytes = self.baseline
        from msgspec.structs import replace

        variants = {v.phase for v in self.plan.vision.variants}
        vision = replace(self.plan, phases=[p for p in self.plan.phases if p.name in variants])
        largest_vision = self.plan.envelope.provable - throttle_limit(vision)
        mx.set_memory_limit(throttle_limit(self.plan) - largest_vision + foreign_bytes)

    def held_bytes(self) -> int:
        held = super().held_bytes() + self.table.nbytes
        return held + sum(
            a.nbytes for p in self.encoders.values() for a in p.constants.values()
        )

    def _encode(self, k: int, px: np.ndarray, phase: str, wait: bool) -> mx.array:
        """Image k's vision call; returns the table with its rows (computing unless ``wait``)."""
        out = self.encoders[phase].run(
            {
                "pixel_values": mx.array(px),
                "image_features": self.table,
                "row": mx.array(k * self.plan.vision.tokens_per_image, dtype=mx.int32),
            },
            self.weights,
            {},
            wait=wait,
        )
        return out["image_features"]

    def encode_images(self, pixels: Sequence[np.ndarray], phases: Sequence[str]) -> None:
        """Run each image's vision phase once, in order, each waited for (serial)."""
        if len(pixels) > self.plan.vision.images:
            raise DctmsError(f"{len(pixels)} images, the plan allows {self.plan.vision.images}")
        for k, (px, phase) in enumerate(zip(pixels, phases, strict=True)):
            # The plan counts one vision call's inputs: never two at once.
            self.table = self._encode(k, px, phase, wait=True)

    def generate_vision(self, request, inputs, serial: bool = False, **kw) -> Generation:
        """Encode the images of ``inputs`` (``vision_input.prepare``) and generate as the text
        session does, serially or overlapped as the plan says; TTFT covers the images."""
        if len(inputs.image_rows) != len(request.prompt):
            raise ValueError("image_rows must have one entry per prompt token")
        if len(inputs.pixels) > self.plan.vision.images:
            raise DctmsError(f"{len(inputs.pixels)} images, the plan allows {self.plan.vision.images}")
        start = time.perf_counter()
        self.rows, self.rope, self.rope_delta = inputs.image_rows, inputs.rope, inputs.rope_delta
        if self.vision_stream is None or serial or not inputs.pixels:
            self.encode_images(inputs.pixels, inputs.phases)
            self.pending = []
        else:
            first = _first_chunks(request.prompt, inputs.image_rows, self.plan, len(inputs.pixels))
            self.pending = [
                (px, phase, first[k])
                for k, (px, phase) in enumerate(zip(inputs.pixels, inputs.phases, strict=True))
            ]
        self.vision_s = time.perf_counter() - start
        gen = self.generate(request, **kw)
        gen.ttft_s += self.vision_s
        return gen

    def _prefill_outputs(self, prompt: list[int], sampled=None) -> dict[str, mx.array]:
        # ``sampled``: a sampling plan's inputs; a vision plan never samples (compile refuses)
        out: dict[str, mx.array] = {}
        rows = list(self.rows) or [0] * len(prompt)
        rope = self.rope or [list(range(len(prompt)))] * 3
        pending, launched, inflight = self.pending, 0, None

        def launch() -> None:
            nonlocal launched, inflight
            px, phase, _ = pending[launched]
            with mx.stream(self.vision_stream):
                inflight = (launched, self._encode(launched, px, phase, wait=False))
            launched += 1

        if pending:
            launch()
        for c, start in enumerate(range(0, len(prompt), self.chunk)):
            # The sync point where the streams meet: this call reads image k's rows.
            while inflight is not None and pending[inflight[0]][2] <= c:
                mx.eval(inflight[1])
                self.table, inflight = inflight[1], None
                if launched < len(pending):
                    launch()
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
        if inflight is not None or launched < len(pending):
            raise DctmsError("internal error: an image no prefill call reads")
        self.pending = []
        mx.eval(out["next_token"])
        return out

    def _decode_outputs(self, token: mx.array, position: int, sampled=None) -> dict[str, mx.array]:
        feeds = {"tokens": token, "position": mx.array(position, dtype=mx.int32)}
        if self.plan.vision.mrope:
            at = position + self.rope_delta
            feeds["rope_positions"] = mx.full((3, 1, 1), at, dtype=mx.int32)
        return self.decode.run(feeds, self.weights, self.state, wait=False)


def _first_chunks(prompt, rows, plan, images: int) -> list[int]:
    """Per image, the prefill call (chunk index) that first reads its rows."""
    t, token, chunk = plan.vision.tokens_per_image, plan.vision.image_token_id, plan.bounds.prefill_chunk
    first = [len(prompt)] * images
    for pos, (tok, row) in enumerate(zip(prompt, rows, strict=True)):
        if tok == token and row // t < images:
            first[row // t] = min(first[row // t], pos // chunk)
    return first
