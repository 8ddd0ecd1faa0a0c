"""The compiler for vision-language models: config (+ weights), text bounds and image bounds in,
a verified ``Plan`` with a ``vision`` section out.

Same passes as ``toolkit.compiler`` (schedule, lifetimes, assign per phase; envelope; emit; the
verifier's self-check), over three traced phases (``toolkit.vision.trace``). The phases run one
after another, so M_intermediate is the largest of their arenas; the features table the images
fill is an input of the vision and prefill phases and is counted with their inputs (persistent).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace

import msgspec

from dctms.schema.errors import DctmsError
from dctms.schema.model_folder import ModelFolder
from dctms.schema.sizes import nbytes
from dctms.schema.types import (
    CompileRequest,
    Plan,
    Stream,
    Vision,
    VisionRequest,
    VisionVariant,
)
from dctms.schema.vision_bytes import TABLE, intermediate_need
from dctms.toolkit import compiler as text
from dctms.toolkit.envelope import build_envelope
from dctms.toolkit.module_paths import attach_modules
from dctms.toolkit.profiles import ridge_point
from dctms.toolkit.sanitize import bind_to_stored, stored_sources
from dctms.toolkit.trace import kv_capacity, max_window
from dctms.toolkit.vision.families import family_of

MAX_IMAGES = 64


@dataclass(frozen=True)
class VisionOptions:
    images: int  # K: most images per call
    height: int  # the largest image after the model's own preprocessing
    width: int
    overlap: bool = False  # vision calls on a second MLX stream, overlapping prefill


def parse_image_size(text_value: str) -> tuple[int, int]:
    """``HxW`` (e.g. ``224x224``) as two positive integers; one line naming the problem else."""
    parts = text_value.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise DctmsError(f"--image-size {text_value!r}: expected HEIGHTxWIDTH, e.g. 224x224")
    h, w = (int(p) for p in parts)
    if not (1 <= h <= 16384 and 1 <= w <= 16384):
        raise DctmsError(f"--image-size {text_value}: each side must be between 1 and 16384")
    return h, w


def compile_vlm_plan(
    source: ModelFolder,
    opts: text.CompileOptions,
    vision: VisionOptions,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Trace the vision, prefill and decode phases of an mlx-vlm model and plan them together."""
    from dctms.toolkit.vision.trace import VisionShapes, VisionTracer, build_vlm

    say = progress or (lambda _msg: None)
    opts = replace(opts, real_lengths=False)  # fixed phases: the runner pads every call
    text._check_options(opts)
    if opts.batch != 1:
        raise DctmsError(f"vision-language plans are for batch 1 (got --batch {opts.batch})")
    if not 1 <= vision.images <= MAX_IMAGES:
        raise DctmsError(f"--images must be between 1 and {MAX_IMAGES}, got {vision.images}")
    config = source.config
    family = family_of(config)
    sizes = family.sizes(config, vision.height, vision.width)
    headers = source.headers() if source.weight_files else None
    settings = text.resolve_settings(config, headers, opts)
    text.use_device(settings.backend)
    say(f"building {family.name} {settings.dtype} vision-language model (lazy weights)")
    model = build_vlm(config, settings.dtype)
    variants = [
        VisionVariant(
            phase=size.phase,
            height=size.height,
            width=size.width,
            tokens=family.tokens(config, size.height, size.width),
            pixel_shape=list(family.pixel_shape(config, size.height, size.width)),
        )
        for size in sizes
    ]
    tokens = max(v.tokens for v in variants)
    shapes = VisionShapes(tokens, vision.images, family.hidden_size(model))
    if shapes.feature_rows > opts.input_tokens:
        raise DctmsError(
            f"{vision.images} images of {tokens} tokens each need {shapes.feature_rows} prompt "
            f"tokens, more than -N {opts.input_tokens}; raise -N or lower --images"
        )
    chunk = settings.prefill_chunk
    capacity = kv_capacity(opts.input_tokens, opts.output_tokens, chunk)
    window = max_window(capacity)
    prompt_window = min(window, math.ceil(opts.input_tokens / chunk) * chunk)
    tracer = VisionTracer(model, family, shapes, capacity=capacity, dtype=settings.dtype)
    say(
        f"tracing {len(variants)} vision phase(s) (up to {vision.height}x{vision.width} -> "
        f"{tokens} tokens), prefill ({chunk} tokens) and decode against a {capacity}-position "
        "cache"
    )
    encoders = [
        tracer.vision(v.phase, tuple(v.pixel_shape), v.height, v.width, v.tokens) for v in variants
    ]
    traced = tracer.traced([*encoders, tracer.prefill(chunk, prompt_window), tracer.decode(window)])
    if headers is not None:  # as mlx-vlm's load: the class's sanitize fills in tied weights
        traced = bind_to_stored(traced, stored_sources(model, headers))
    weights = text.fingerprint_weights(traced.weights, headers, source, opts.hash_weights)
    ridge = ridge_point(settings.profile)
    phases = []
    for tp in traced.phases:
        say(f"planning {tp.name}: {len(tp.ops)} primitives")
        phases.append(
            text.plan_phase(
                tp,
                ridge,
                opts.alignment,
                opts.sync_every,
                settings.allocator_slack,
                opts.pack_seconds / len(traced.phases),
                rules=text.memory_rules(settings.backend, opts.run_ahead),
            )
        )
    names, slack = {v.phase for v in variants}, settings.allocator_slack
    state = _state(traced, names, slack, vision.overlap)
    envelope = build_envelope(
        weights=weights.total_bytes,
        kv=sum(s.bytes for s in state if s.kind == "kv"),
        persistent=sum(s.bytes for s in state if s.kind == "persistent"),
        intermediate=intermediate_need(
            SimpleNamespace(
                phases=phases,
                vision=SimpleNamespace(variants=variants, overlap=vision.overlap),
                target=SimpleNamespace(allocator_slack=slack),
            )
        ),
        backend=settings.backend,
        device_memory=opts.device_memory,
        cache_enabled=settings.allocator_slack > 0,
    )
    plan = text.emit_plan(
        source, opts, settings, traced, capacity, weights, state, phases, envelope
    )
    request = VisionRequest(vision.images, vision.height, vision.width, vision.overlap)
    plan = msgspec.structs.replace(
        plan,
        compile=CompileRequest(config=config, **asdict(opts), vision=request),
        vision=Vision(
            family=family.name,
            resolution=family.resolution,
            images=vision.images,
            image_size=[vision.height, vision.width],
            tokens_per_image=tokens,
            feature_rows=shapes.feature_rows,
            hidden_size=shapes.hidden,
            image_token_id=family.image_token_id(config),
            variants=variants,
            mrope=family.mrope,
            overlap=vision.overlap,
            streams=[
                Stream("vision", [v.phase for v in variants], 1 if vision.overlap else 0),
                Stream("text", ["prefill", "decode"]),
                Stream("output", ["prefill", "decode"]),
            ],
        ),
    )
    plan = attach_modules(plan, traced.phases)
    text.self_check(plan)
    return plan


def _state(traced, variants: set[str], slack: int, overlap: bool):
    """The text compiler's state without the vision variants' input blocks: a vision call's own
    inputs are counted with its arena, and the features table among them is prefill's input too
    (their constants are all made once, so stay). A serial plan holds one table, not two calls'
    (``schema.vision_bytes.input_copies``)."""
    state = text.state_tensors(traced, slack)
    state = [s for s in state if s.name not in {f"{v}.inputs" for v in variants}]
    if overlap:
        return state
    table = next(b for b in traced.phase("prefill").inputs if b.name == TABLE)
    once = nbytes(table.shape, table.dtype)
    once += min(once, slack)
    return [
        msgspec.structs.replace(s, shape=[s.bytes - once], bytes=s.bytes - once)
        if s.name == "prefill.inputs"
        else s
        for s in state
    ]
