"""A vision-language plan's memory split by stream: what the vision and the text stream hold at
each step of the plan's run, and the sync points where the streams meet.

A step is one call (or two at once, when overlapped) in run order, for the worst case the plan
bounds: K images of the largest vision call, the N-token prompt in ``ceil(N / prefill_chunk)``
prefill calls, then decode. A call holds what the envelope counts for it (``vision_bytes``):
its arena, its slack and a vision call's own inputs. Serial: every image runs alone, then the
prefill calls. Overlapped (``vision.overlap``): image k runs on the vision stream while prefill
call k runs on the text stream, and prefill call k + 1 is the first to read image k's rows (the
sync point); an image no later prefill call can wait for runs alone. So the two streams' bytes
at one step sum to at most the envelope's M_intermediate (the largest text call plus the largest
vision call), and reach it when prefill is the largest text call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dctms.schema.types import Plan
from dctms.schema.vision_bytes import intermediate_need, transient_bytes, vision_phases


@dataclass(frozen=True)
class StreamStep:
    """One step of the run: the call each stream runs (None: idle) and the bytes it holds."""

    label: str  # "image 0 | prefill 0", "prefill 3", "decode x5"
    vision_phase: str | None
    text_phase: str | None
    vision_bytes: int
    text_bytes: int
    sync: str = ""  # the sync point after this step, if any

    @property
    def total(self) -> int:
        return self.vision_bytes + self.text_bytes


@dataclass(frozen=True)
class SyncEdge:
    """Where the streams meet: ``text_phase`` call ``call`` waits for image ``image``."""

    image: int
    vision_phase: str
    text_phase: str
    call: int  # the prefill call (chunk index) that first reads the image's rows


def call_bytes(plan: Plan) -> dict[str, int]:
    """Phase name -> what one call of it holds: arena, slack, a vision call's own inputs."""
    return {p.name: p.arena_bytes + p.slack_bytes + transient_bytes(plan, p) for p in plan.phases}


def largest_vision_phase(plan: Plan) -> str:
    calls = call_bytes(plan)
    return max(sorted(vision_phases(plan)), key=lambda name: calls[name])


def prefill_calls(plan: Plan) -> int:
    b = plan.bounds
    return max(1, math.ceil(b.input_tokens / max(1, b.prefill_chunk)))


def sync_edges(plan: Plan) -> list[SyncEdge]:
    """Per image, the prefill call that waits for it (serial: the first, after every image)."""
    if plan.vision is None:
        return []
    phase, last = largest_vision_phase(plan), prefill_calls(plan) - 1
    overlap = plan.vision.overlap
    return [
        SyncEdge(k, phase, "prefill", min(k + 1, last) if overlap else 0)
        for k in range(plan.vision.images)
    ]


def stream_steps(plan: Plan) -> list[StreamStep]:
    """The run's steps, vision and text bytes apart; empty for a text plan."""
    if plan.vision is None:
        return []
    calls = call_bytes(plan)
    image = largest_vision_phase(plan)
    chunks = prefill_calls(plan)
    edges = sync_edges(plan)
    steps: list[StreamStep] = []
    done = 0  # prefill calls run so far
    for edge in edges:
        k = edge.image
        wait = f"prefill {edge.call} waits for image {k}"
        if plan.vision.overlap and done < edge.call:
            # Image k on the vision stream while prefill call k runs on the text stream.
            steps.append(
                StreamStep(
                    f"image {k} | prefill {done}", image, "prefill", calls[image],
                    calls["prefill"], wait,
                )
            )
            done += 1
        else:
            steps.append(StreamStep(f"image {k}", image, None, calls[image], 0, wait))
    for c in range(done, chunks):
        steps.append(StreamStep(f"prefill {c}", None, "prefill", 0, calls["prefill"]))
    decodes = plan.bounds.output_tokens - 1
    if decodes > 0 and "decode" in calls:
        steps.append(StreamStep(f"decode x{decodes}", None, "decode", 0, calls["decode"]))
    return steps


def envelope_check(plan: Plan) -> tuple[int, int]:
    """(the most both streams hold at one step, the envelope's M_intermediate need)."""
    return max((s.total for s in stream_steps(plan)), default=0), intermediate_need(plan)
