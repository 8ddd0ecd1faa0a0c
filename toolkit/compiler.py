"""The compiler: model config (+ optional weights) and bounds in, a verified ``Plan`` out.

Passes, in order, each its own module: 1 trace, then per phase 2 schedule, 3 lifetimes, 4 assign;
then 5 envelope; last the emit step (``emit_phase``, ``emit_plan``) and the verifier's self-check.
Phases are looked up by name ("prefill", "decode"), never by position.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import mlx.core as mx
import msgspec

import dctms
from dctms.schema.errors import DctmsError, InternalError
from dctms.schema.fast_ops import FUSED
from dctms.schema.fingerprint import HeaderTensor, file_sha256, layout_sha256
from dctms.schema.model_folder import ModelFolder
from dctms.schema.sizes import (
    RUN_AHEAD,
    THROTTLED_RUN_AHEAD,
    cast_overshoot,
    is_arena_tenant,
    live_bytes,
    nbytes,
    recorded_run_ahead,
    slack_bytes,
)
from dctms.schema.targets import GPU_TARGETS, overhead, run_ahead_budget
from dctms.schema.types import (
    SCHEMA_VERSION,
    TENSOR_VARIANTS,
    Binding,
    Bounds,
    Buffer,
    CompileRequest,
    Constant,
    Envelope,
    FusedWeight,
    Generator,
    LengthAffine,
    Lengths,
    MemoryModel,
    ModelInfo,
    Op,
    Phase,
    Plan,
    Quantization,
    Scratch,
    SlidingWindow,
    StateTensor,
    Stats,
    SyncPoint,
    Target,
    TargetProfile,
    Weights,
    WeightTensor,
)
from dctms.schema.verify import verify_plan
from dctms.toolkit import assign, caches, limits, prefix_pool, slot_move
from dctms.toolkit.common_ops import merge_common_ops
from dctms.toolkit.envelope import build_envelope
from dctms.toolkit.fuse_projections import conflicting_weights, fuse_projections
from dctms.toolkit.fused_kernels import expanded, fuse_kernels
from dctms.toolkit.lengths import (
    ROWS,
    TOKEN_STEP,
    TOKENS,
    WINDOW,
    WINDOW_STEP,
    LengthFit,
    NotAffine,
    digest,
    fit,
    instantiate,
    prefill_candidates,
    rows_candidates,
    rows_grid,
    sample_lengths,
    sample_rows,
    single_candidates,
    verified_points,
)
from dctms.toolkit.lifetimes import CPU_RULES, MemoryRules, PhaseLives, analyse
from dctms.toolkit.memory_model import RESHAPES, VIEW_ALWAYS
from dctms.toolkit.mlx_lm_classes import mlx_lm_version
from dctms.toolkit.module_paths import attach_modules
from dctms.toolkit.profiles import DEFAULT_PROFILE, get_profile, ridge_point
from dctms.toolkit.schedule import Schedule, build_schedule
from dctms.toolkit.targets import ROUNDING_BLOCK, resolve_target, rounding_block, target_slack
from dctms.toolkit.trace import (
    DTYPES,
    PhaseTracer,
    Traced,
    TracedBinding,
    TracedPhase,
    build_model,
    kv_capacity,
    max_window,
)

# Their output shape is an input of the runner's call (a pipeline rank receives the activations
# of the tokens at the call's length point, so Recv's shape follows the lengths too).
CREATION_PRIMITIVES = ("Arange", "Full", "Recv")
ARENA_KINDS = ("intermediate", "output", "scratch")

# MLX's allocators reuse a cached buffer for a request of S bytes when it is smaller than
# min(2 S, S + 2 pages) (mlx/backend/common/buffer_cache.h) and count its whole size: each live
# buffer may cost up to min(S, 2 pages) more. On the CPU the runner disables the buffer cache
# (mx.set_cache_limit(0): measured no throughput loss on a 21M model, 37.7-40.7 -> 40.8-45.2
# tok/s), so there is no reuse and no slack; Metal keeps its cache (new MTLBuffers are costly),
# with 16 KiB pages.
ALLOCATOR_SLACK = {"cpu": 0, "gpu": 2 * 16384}


@dataclass(frozen=True)
class CompileOptions:
    input_tokens: int
    output_tokens: int
    batch: int = 1
    prefill_chunk: int | None = None
    dtype: str | None = None
    device_memory: int | None = None
    backend: str | None = None
    # The target memory model (schema.targets): "cpu", "metal[-PROFILE]" or "cuda[-PROFILE]"; a
    # GPU target is traced on the CPU and planned by its allocator model (toolkit.targets).
    target: str | None = None
    alignment: int = 64
    profile: str | None = None
    hash_weights: bool = False
    # Decoder layers per segment between sync points; 0 = the phase end only (the default: on the
    # CPU backend a per-layer sync costs ~15 % decode throughput and saves < 0.2 % of the arena).
    sync_every: int = 0
    # How far MLX's host may run ahead of its worker (schema.sizes.RUN_AHEAD): "free" (the default)
    # widens lifetimes by MLX's own bound and needs no throttle; "throttled" widens them by one
    # partial task and has the runner hold the host back with MLX's memory limit: a ~3 % smaller
    # envelope, but near its peak the host busy-waits (on this 2-core CPU prefill ran up to 2x slower).
    run_ahead: str = "free"
    # Search budget of the offset packer, shared by the phases whose greedy packing misses the
    # lower bound (a fixed amount of work, so the plan does not depend on the machine's speed).
    pack_seconds: float = 2.0
    # Trace smaller lengths too and record the verified points the runner may run at (see
    # toolkit.lengths); off: fixed phases (the envelope is the same either way: `fit` probes so).
    real_lengths: bool = True
    # The length grid's steps (None: toolkit.lengths' TOKEN_STEP / WINDOW_STEP).
    token_step: int | None = None
    window_step: int | None = None
    # A quantised KV cache with mlx-lm's settings (generate_step's kv_bits, kv_group_size,
    # quantized_kv_start); None: the cache in the activation dtype (see toolkit.caches).
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    # mlx-lm's max_kv_size: every layer a RotatingKVCache(max_kv_size, keep=4) (models without
    # their own make_cache, as mlx-lm); None: the full cache.
    max_kv_size: int | None = None
    # One rank of a model split over ``ranks`` processes by mlx-lm (toolkit.distributed).
    ranks: int = 1
    rank: int = 0
    parallel: str | None = None
    split: tuple[int, ...] | None = None
    # mlx-lm's sampler and logits processors traced into both phases, their parameters per-call
    # inputs (toolkit.sampling); off: greedy argmax only, as before.
    sampling: bool = False
    # A prompt-prefix pool (toolkit.prefix_pool): K blocks of prefill_chunk positions, or as many
    # as ``prefix_cache`` bytes hold.
    prefix_blocks: int = 0
    prefix_cache: int | None = None
    # MLX's fused kernels as plan ops (toolkit.fused_kernels): always on a GPU target, whose GPU
    # runs them; ``fused`` asks for them in a CPU plan too (the runner's mx.fast calls fall back to
    # the composite there, which each op's scratch is charged with).
    fused: bool = False


def _check_options(opts: CompileOptions) -> None:
    limits.check_options(opts)
    for name in ("input_tokens", "output_tokens", "batch"):
        if getattr(opts, name) < 1:
            raise DctmsError(
                f"{name.replace('_', ' ')} must be at least 1, got {getattr(opts, name)}"
            )
    if opts.prefill_chunk is not None and opts.prefill_chunk < 1:
        raise DctmsError(f"prefill chunk must be at least 1, got {opts.prefill_chunk}")
    if not 0 <= opts.pack_seconds <= 3600:
        raise DctmsError(f"--pack-seconds must be between 0 and 3600, got {opts.pack_seconds}")
    for flag, step in (("--token-step", opts.token_step), ("--window-step", opts.window_step)):
        if step is not None and step < 1:
            raise DctmsError(f"{flag} must be at least 1, got {step}")
    if opts.sync_every < 0:
        raise DctmsError(f"--sync-every must be 0 (phase end only) or more, got {opts.sync_every}")
    if opts.alignment < 1 or opts.alignment & (opts.alignment - 1):
        raise DctmsError(f"alignment must be a power of two, got {opts.alignment}")
    if opts.sampling:
        _check_sampling(opts)
    if opts.batch > 1 or _pooled(opts):
        _check_batch(opts)
    if opts.prefix_blocks < 0:
        raise DctmsError(f"--prefix-blocks must be 0 (none) or more, got {opts.prefix_blocks}")
    if opts.prefix_blocks and opts.prefix_cache is not None:
        raise DctmsError("give --prefix-blocks or --prefix-cache, not both")
    if opts.dtype is not None and opts.dtype not in DTYPES:
        raise DctmsError(f"dtype must be one of {', '.join(DTYPES)}, got {opts.dtype}")
    if opts.fused and (opts.ranks != 1 or opts.parallel is not None):
        raise DctmsError("--fused is not supported with --ranks/--parallel yet")
    if opts.fused and opts.backend == "gpu":
        raise DctmsError("--fused with --backend gpu: a GPU trace holds MLX's kernels already")


def _check_sampling(opts: CompileOptions) -> None:
    """--sampling is traced into the plain text phases: one sequence, a float full KV cache, one
    rank (the other runners feed greedy phases)."""
    others = [
        (opts.batch != 1, f"--batch {opts.batch}"),
        (opts.kv_bits is not None, "--kv-bits"),
        (opts.max_kv_size is not None, "--max-kv-size"),
        (opts.ranks != 1 or opts.parallel is not None, "--ranks/--parallel"),
    ]
    for given, flag in others:
        if given:
            raise DctmsError(f"--sampling is not supported with {flag} yet")


DECODE_ONE = "decode_one"  # a batched plan's decode step of slot 0 alone (runner.batch)


def _pooled(opts: CompileOptions) -> bool:
    """Whether the options ask for a prompt-prefix pool (``toolkit.prefix_pool``)."""
    return opts.prefix_blocks > 0 or opts.prefix_cache is not None


def _check_batch(opts: CompileOptions) -> None:
    """A batched plan's slots (``toolkit.slots``) and a prefix pool are planned over a float full
    KV cache, one rank, greedy decoding (each refused in one line, not planned wrong)."""
    what = f"--batch {opts.batch}" if opts.batch > 1 else "--prefix-blocks/--prefix-cache"
    if _pooled(opts) and opts.sampling:
        raise DctmsError(f"{what} is not supported with --sampling yet")
    others = [
        (opts.kv_bits is not None, "--kv-bits"),
        (opts.max_kv_size is not None, "--max-kv-size"),
        (opts.ranks != 1 or opts.parallel is not None, "--ranks/--parallel"),
    ]
    for given, flag in others:
        if given:
            raise DctmsError(f"{what} is not supported with {flag} yet")


@dataclass(frozen=True)
class Settings:
    """What the options leave open, decided once: every later pass reads these."""

    dtype: str
    prefill_chunk: int
    backend: str
    profile: TargetProfile
    allocator_slack: int
    memory_model: MemoryModel | None = None  # a GPU target's allocator model (schema.targets)


def compile_plan(
    source: ModelFolder,
    opts: CompileOptions,
    progress: Callable[[str], None] | None = None,
    *,
    probe: bool = False,
) -> Plan:
    """Run the passes in order (trace, then per phase schedule, lifetimes, assign; then state and
    envelope) and emit the plan, which the independent verifier must accept. A ``probe`` (``dctms
    fit``'s) wants the envelope only: it skips the module paths' recording trace and the verifier,
    neither of which changes the envelope; such a plan is for reading, never for writing."""
    say = progress or (lambda _msg: None)
    _check_options(opts)
    limits.check_config(source.config)
    headers = source.headers() if source.weight_files else None
    settings = resolve_settings(source.config, headers, opts)
    use_device(trace_device(settings))  # the graph (fast kernels or their composites) depends on it
    part = plan_model(source, headers, opts, settings, say, probe=probe)
    state, phases = part.state, part.phases
    envelope = build_envelope(
        weights=part.weights.total_bytes,
        kv=sum(s.bytes for s in state if s.kind == "kv"),
        persistent=sum(s.bytes for s in state if s.kind == "persistent"),
        intermediate=max(p.arena_bytes + p.slack_bytes for p in phases),
        backend=settings.backend,
        device_memory=opts.device_memory,
        cache_enabled=settings.allocator_slack > 0,
    )
    check_cast_overshoot(part.weights, envelope)
    plan = emit_plan(
        source, opts, settings, part.traced, part.capacity, part.weights, state, phases, envelope
    )
    plan = attach_modules(plan, part.traced.phases)
    if part.rank is not None:
        plan = part.rank.annotate(plan)
    if not probe:
        self_check(plan)
    return plan


@dataclass(frozen=True)
class ModelPart:
    """Passes 1-4 of one model: its trace, cache capacity, weights fingerprint, phases, state."""

    traced: Traced
    capacity: int
    weights: Weights
    phases: list[Phase]
    state: list[StateTensor]
    rank: Any = None  # the rank's model as mlx-lm split it (toolkit.distributed.Rank), when one


# More phases traced with a model's tracer (speculative decoding's verify): called with the tracer,
# the largest window and whether to fit lengths; returns each phase with its fit (or why none).
MorePhases = Callable[[PhaseTracer, int, bool], list[tuple[TracedPhase, "LengthFit | str | None"]]]


def plan_model(
    source: ModelFolder,
    headers: list[HeaderTensor] | None,
    opts: CompileOptions,
    settings: Settings,
    say: Callable[[str], None],
    *,
    extra_positions: int = 0,
    more_phases: MorePhases | None = None,
    pack_seconds: float | None = None,
    probe: bool = False,
) -> ModelPart:
    """Trace one model and plan each of its phases (``pack_seconds``: their packing budget, by
    default ``opts.pack_seconds``); ``extra_positions`` enlarges the KV cache beyond N + M."""
    ranked: list = []
    traced, capacity, fits = trace_source(
        source.config, headers, opts, settings, say, extra_positions, more_phases, ranked, probe
    )
    if ranked:
        headers = ranked[0].headers(headers)
    weights = fingerprint_weights(traced.weights, headers, source, opts.hash_weights, traced.fused)
    ridge = ridge_point(settings.profile)
    budget = opts.pack_seconds if pack_seconds is None else pack_seconds
    phases = []
    for tp in traced.phases:
        say(f"planning {tp.name}: {len(tp.ops)} primitives")
        phases.append(
            plan_phase(
                tp,
                ridge,
                opts.alignment,
                opts.sync_every,
                settings.allocator_slack,
                budget / len(traced.phases),
                fits.get(tp.name),
                _candidates(fits.get(tp.name), opts),
                say,
                rules=memory_rules(settings.backend, opts.run_ahead, settings.memory_model),
            )
        )
    if settings.memory_model is None and settings.backend == "cpu":
        for tp, phase in zip(traced.phases, phases, strict=True):
            check_fallback(tp, phase, ridge, opts, say, fits.get(tp.name))
    return ModelPart(
        traced,
        capacity,
        weights,
        phases,
        state_tensors(traced, settings.allocator_slack, settings.memory_model, weights),
        ranked[0] if ranked else None,
    )


def check_fallback(
    tp: TracedPhase,
    phase: Phase,
    ridge: float,
    opts: CompileOptions,
    say: Callable[[str], None],
    lf: LengthFit | None = None,
) -> None:
    """A CPU plan's fused ops run as MLX's composites (``mx.fast`` falls back on the CPU), whose
    graph MLX orders as a whole. So the phase with every fused op expanded to its composite is
    scheduled in MLX's own order (pass 2) and its lifetimes taken under the CPU's rules (pass 3),
    at the bound and at every verified length point; the most bytes it holds live at once must fit
    the arena the plan claims, or the compile is refused (the plan would claim less than the
    runner's MLX may hold)."""
    if not any(op.primitive in FUSED for op in tp.ops):
        return
    claim = phase.arena_bytes + phase.slack_bytes
    points = [tuple(p) for p in phase.lengths.points] if lf and phase.lengths else []
    need, where = 0, "the bound"
    for point in [None, *points]:
        at = tp if point is None else instantiate(tp, lf, point)
        full = expanded(at)
        views = {i for i, op in enumerate(full.ops) if op.primitive in VIEW_ALWAYS | RESHAPES}
        sched = build_schedule(full, views, ridge, opts.sync_every)
        lives = analyse(full, sched, memory_rules("cpu", opts.run_ahead))
        spans = [
            (*lives.slot_interval[t], -(-life.bytes // opts.alignment) * opts.alignment)
            for t, life in lives.lives.items()
            if life.kind in ARENA_KINDS
        ]
        held = max(live_bytes(spans, len(sched.slots)), default=0)
        if held > need:
            need, where = held, "the bound" if point is None else f"length point {list(point)}"
    say(
        f"{tp.name}: MLX's composites of its fused ops hold at most {need} bytes at "
        f"{len(points) + 1} points (arena {claim})"
    )
    if need > claim:
        raise DctmsError(
            f"--fused: the composites MLX's CPU runs for {tp.name}'s fused ops may hold {need} "
            f"bytes at once at {where}, more than the {claim} bytes its arena claims; compile "
            "without --fused"
        )


def check_cast_overshoot(weights: Weights, envelope) -> None:
    """While the runner casts weights at load (``--dtype``), one stored copy is in flight beside
    the resident ones; what the KV cache, persistent state and arena (not yet allocated then) leave
    must cover it, or the provable envelope would not bound the load."""
    over = cast_overshoot(weights.tensors)
    room = envelope.kv + envelope.persistent + envelope.intermediate
    if over > room:
        raise DctmsError(
            f"--dtype: casting the weights at load would exceed the resident weights by {over} "
            f"bytes, more than the {room} bytes the rest of the envelope covers; convert the "
            "weights to that dtype instead (or compile without --dtype)"
        )


def resolve_settings(
    config: dict, headers: list[HeaderTensor] | None, opts: CompileOptions
) -> Settings:
    """dtype (see ``model_dtype``), prefill chunk, backend, roofline profile."""
    dtype = model_dtype(config, headers, opts.dtype)
    chunk = default_chunk(opts)
    if opts.target is not None:
        target = resolve_target(opts)
        if target.model is not None:
            return Settings(
                dtype, chunk, "gpu", target.profile, target_slack(target.model), target.model
            )
    default = "gpu" if mx.default_device() == mx.gpu and opts.target is None else "cpu"
    backend = opts.backend or default
    return Settings(
        dtype=dtype,
        prefill_chunk=chunk,
        backend=backend,
        profile=get_profile(opts.profile or DEFAULT_PROFILE[backend]),
        allocator_slack=ALLOCATOR_SLACK[backend],
    )


DEFAULT_CHUNK = 512  # the prefill chunk when none is given (or N, when shorter)


def default_chunk(opts: CompileOptions) -> int:
    return opts.prefill_chunk or min(opts.input_tokens, DEFAULT_CHUNK)


def length_key(opts: CompileOptions, extra_positions: int = 0) -> tuple[int, int, int]:
    """What a compile depends on N and M through: (prefill chunk, KV capacity, prompt window). Two
    option sets that differ only in N or M but have the same key trace the same graphs, so their
    plans differ only in ``bounds`` and, without length points, have the same envelope: ``dctms
    fit`` compiles once per key (``length_extent``)."""
    chunk = default_chunk(opts)
    capacity = kv_capacity(opts.input_tokens, opts.output_tokens + extra_positions, chunk)
    window = max_window(capacity)
    # Prefill never attends beyond the padded prompt; decode up to N + M.
    return chunk, capacity, min(window, -(-opts.input_tokens // chunk) * chunk)


def length_extent(
    base: CompileOptions, search_n: bool, cap: int
) -> Callable[[int], tuple[int, int]]:
    """For ``dctms fit``'s search (``views.fit.largest_fitting``'s ``extent``): the interval of N
    (``search_n``; else of M) in [1, ``cap``] around a value that has its ``length_key``, with the
    other options ``base``'s. The key is nondecreasing in N and in M, so equal keys form an
    interval, and no wider than the prefill chunk (the padded prompt changes every chunk)."""

    def key(value: int) -> tuple[int, int, int]:
        n, m = (value, base.output_tokens) if search_n else (base.input_tokens, value)
        return length_key(replace(base, input_tokens=n, output_tokens=m))

    @functools.cache  # asked again for the same value (the search, then its progress line)
    def extent(value: int) -> tuple[int, int]:
        k = key(value)
        width = k[0]  # the prefill chunk
        first = value
        while first > max(1, value - width) and key(first - 1) == k:
            first -= 1
        last = value
        while last < min(cap, value + width) and key(last + 1) == k:
            last += 1
        return first, last

    return extent


def length_step(base: CompileOptions, search_n: bool) -> int:
    """The grid ``dctms fit``'s search probes on while its bracket is wide: the prefill chunk for
    N (M_max jumps where the padded prompt grows a chunk; the default chunk when none is given,
    as N is then large), 1 for M."""
    return (base.prefill_chunk or DEFAULT_CHUNK) if search_n else 1


def trace_source(
    config: dict,
    headers: list[HeaderTensor] | None,
    opts: CompileOptions,
    settings: Settings,
    say: Callable[[str], None],
    extra_positions: int = 0,
    more_phases: MorePhases | None = None,
    ranked: list | None = None,
    probe: bool = False,
) -> tuple[Traced, int, dict[str, LengthFit]]:
    """Pass 1: build the model with lazy weights, trace both phases at their largest lengths and
    (pass 1b) at smaller ones; (traced, KV capacity, the length fit of each phase that has one).
    ``extra_positions``: cache positions beyond N + M; ``more_phases``: phases traced besides.
    With ``opts.ranks`` > 1 the model is that rank's and ``ranked`` receives it."""
    say(f"building {config.get('model_type')} {settings.dtype} model (lazy weights)")
    stored = {h.name: h.dtype for h in headers} if headers else None
    # As mlx-lm loads them: every weight in the dtype it is stored in, unless --dtype casts.
    model = build_model(config, settings.dtype, stored, follow_stored=opts.dtype is None)
    rank = None
    if opts.ranks > 1 or opts.parallel is not None:
        from dctms.toolkit.kinds.rank import rank_spec, split_model

        rank = split_model(model, rank_spec(opts))
        say(f"rank {opts.rank} of {opts.ranks} ({opts.parallel}): layers {rank.layers}")
        if ranked is not None:
            ranked.append(rank)
    windows = caches.check_cache_support(model, opts.max_kv_size)
    num_layers = len(windows)
    chunk = settings.prefill_chunk  # = default_chunk(opts)
    _, capacity, prompt_window = length_key(opts, extra_positions)
    window = max_window(capacity)
    say(f"tracing prefill ({chunk} tokens) and decode against a {capacity}-position cache")
    quant = caches.kv_quantization(opts, chunk)
    rings = caches.rings_for(windows, chunk, capacity)
    if rank is None:
        if (opts.batch > 1 or _pooled(opts)) and any(r is not None for r in rings):
            what = f"--batch {opts.batch}" if opts.batch > 1 else "--prefix-blocks/--prefix-cache"
            raise DctmsError(
                f"{what} is not supported yet for models with sliding-window or recurrent layers "
                "(their slots are not planned)"
            )
        if opts.sampling and any(r is not None for r in rings):
            raise DctmsError(
                "--sampling is not supported yet for models with sliding-window or recurrent layers"
            )
        tracer = PhaseTracer(
            model,
            num_layers,
            batch=opts.batch,
            capacity=capacity,
            kv_quant=quant,
            rings=rings,
            sampling=opts.sampling,
            prefix_blocks=1 if _pooled(opts) else 0,  # a flag here: K is resolved below
        )
    else:
        if _pooled(opts):
            raise DctmsError("--prefix-blocks/--prefix-cache is not supported with --ranks yet")
        tracer = rank.tracer(
            num_layers, batch=opts.batch, capacity=capacity, kv_quant=quant, rings=rings
        )
    # Module paths (a second, recording trace; a rank's tracer carries them through its rewrite).
    paths = {"paths": not probe}
    prefill = tracer.prefill(chunk, prompt_window, **paths)
    decode = tracer.decode(window, **paths)
    # a batched plan's step of slot 0 alone: one row, as cheap as a batch-1 step (the rows
    # length stops at 2: MLX takes its scalar paths for a [1, ...] row, so rows = 1 is its own graph)
    one = [tracer.decode(window, name=DECODE_ONE, rows=1, **paths)] if opts.batch > 1 else []
    # and its slot move (toolkit.slot_move): a sequence left in a high slot goes to a free low one
    moves = [slot_move.trace_move_phase(tracer)] if opts.batch > 1 and rank is None else []
    blocks, pool = 0, []
    if _pooled(opts):
        if more_phases is not None:
            raise DctmsError("--prefix-blocks/--prefix-cache is not supported with --draft yet")
        prefix_pool.check_supported(tracer)
        blocks = prefix_pool.resolve_blocks(tracer, chunk, opts.prefix_blocks, opts.prefix_cache)
        pool = prefix_pool.trace_block_phases(tracer, blocks, chunk)
    start = caches.start_phases(tracer, quant, chunk, capacity, paths)
    more = more_phases(tracer, window, opts.real_lengths) if more_phases else []
    traced = tracer.traced(
        [*start, prefill, decode, *one, *moves, *pool, *(tp for tp, _ in more)]
    )
    traced = replace(traced, prefix_blocks=blocks)
    fits: dict[str, LengthFit] = {}
    if not opts.real_lengths:
        return _merged(traced, fits, say, _fuses(opts), _kernels(opts)), capacity, fits
    special = sorted({r.slots for r in rings if isinstance(r, caches.Ring)})
    found_start = (
        [(caches.PREFILL_START, caches.fit_start(tracer, start[0], chunk))]
        if quant and not quant.start
        else []  # the float phases before a later switch run at fixed lengths
    )
    for name, found in (
        *found_start,
        ("prefill", _fit_prefill(tracer, prefill, chunk, prompt_window, special)),
        ("decode", _fit_decode(tracer, decode, window, special, opts.batch)),
        *((DECODE_ONE, _fit_decode(tracer, tp, window, special, 1, DECODE_ONE)) for tp in one),
        *((tp.name, found) for tp, found in more),
    ):
        if isinstance(found, str):
            say(f"{name}: fixed lengths ({found})")
        else:
            fits[name] = found
    return _merged(traced, fits, say, _fuses(opts), _kernels(opts)), capacity, fits


def _merged(
    traced: Traced,
    fits: dict[str, LengthFit],
    say: Callable[[str], None],
    fuse: bool,
    kernels: bool = False,
) -> Traced:
    """Passes 1b' (``toolkit.fused_kernels``, where ``kernels``), 1c and 1d on every phase
    (``toolkit.common_ops``, ``toolkit.fuse_projections`` where ``fuse``); ``fits`` re-indexed in
    place."""
    phases, fused, merged_phases = [], {}, []
    for tp in traced.phases:
        fit = fits.get(tp.name)
        if kernels:
            tp, fit, found = fuse_kernels(tp, fit)
            if found:
                say(f"{tp.name}: {len(found)} mx.fast kernels as plan ops")
        merged, fit = merge_common_ops(tp, fit)
        if merged is not tp:
            say(f"{tp.name}: {len(tp.ops) - len(merged.ops)} repeated primitives merged")
        merged_phases.append((merged, fit))
    exclude = conflicting_weights([m for m, _ in merged_phases]) if fuse else frozenset()
    for tp, (merged, fit) in zip(traced.phases, merged_phases, strict=True):
        if fuse:
            merged, fit, groups = fuse_projections(merged, fit, exclude)
            if groups:
                say(f"{tp.name}: {len(groups)} groups of projections fused")
            for name, parts in groups.items():
                if fused.setdefault(name, parts) != parts:
                    raise InternalError(f"fused weight {name} has other parts in {tp.name}")
        if fit is not None:
            fits[tp.name] = fit
        phases.append(merged)
    return replace(traced, phases=phases, fused=fused)


def _kernels(opts: CompileOptions) -> bool:
    """MLX's fused kernels are plan ops on a GPU target (its GPU runs them) and with ``--fused``."""
    return opts.fused or (opts.target is not None and opts.target.partition("-")[0] in GPU_TARGETS)


def _fuses(opts: CompileOptions) -> bool:
    """Projections are fused where the runner reads the weights as stored into its arena: the
    CPU, no cast at load, not a rank's slices (``runner.weight_arena``)."""
    return (
        opts.backend in (None, "cpu")
        and opts.target in (None, "cpu")
        and opts.dtype is None
        and opts.ranks == 1
        and opts.parallel is None
    )


def _fit_prefill(
    tracer: PhaseTracer, bound: TracedPhase, chunk: int, window: int, special: list[int]
):
    """The prefill phase's fit over (tokens, window), or over the one that can vary; or why not.
    Each extra trace is reduced to its numbers at once (``digest``), so one at a time is alive.
    ``special``: windows not to sample at (``sample_lengths``)."""
    ts, ws = sample_lengths(chunk), sample_lengths(window, special)
    names = [n for n, s in ((TOKENS, ts), (WINDOW, ws)) if s]
    if not names:
        return "the bounds are too small to vary"
    t1, t2 = ts or (chunk, chunk)
    w1, w2 = ws or (window, window)
    points = [(chunk, window)]
    if ts:
        points.append((t1, window))
    if ws:
        points.append((chunk, w1))
    points.append((t2, w2))
    keep = [i for i, n in enumerate((TOKENS, WINDOW)) if n in names]
    try:
        samples = []
        for p in points:
            phase = bound if p == points[0] else tracer.prefill(*p)
            samples.append((tuple(p[i] for i in keep), digest(bound, phase, p)))
            del phase
        return fit(names, samples, bound)
    except NotAffine as err:
        return str(err)


def _fit_decode(
    tracer: PhaseTracer,
    bound: TracedPhase,
    window: int,
    special: list[int],
    batch: int = 1,
    name: str = "decode",
):
    """The decode phase's fit over the window -- and, for a batched plan, over the rows (busy
    slots) a step advances: (rows, window). ``decode_one`` (slot 0 alone) has one row."""
    rows = 1 if name == DECODE_ONE else batch
    ws = sample_lengths(window, special)
    rs = sample_rows(rows) if rows > 1 else None
    if not ws and not rs:
        return "the bounds are too small to vary"
    names = [n for n, s in ((ROWS, rs), (WINDOW, ws)) if s]
    r1, r2 = rs or (rows, rows)
    w1, w2 = ws or (window, window)
    points = [(rows, window)]
    if rs:
        points.append((r1, window))
    if ws:
        points.append((rows, w1))
    points.append((r2, w2))
    keep = [i for i, n in enumerate((ROWS, WINDOW)) if n in names]
    try:
        samples = []
        for r, w in points:
            phase = bound if (r, w) == points[0] else tracer.decode(w, name=name, rows=r)
            samples.append((tuple((r, w)[i] for i in keep), digest(bound, phase, (r, w))))
            del phase
        return fit(names, samples, bound)
    except NotAffine as err:
        return str(err)


def _candidates(lf: LengthFit | None, opts: CompileOptions) -> list[tuple[int, ...]]:
    """The length combinations the runner may ask for, in the fit's ``names`` order, on the
    grid ``opts`` chooses."""
    if lf is None:
        return []
    token_step, window_step = grid_steps(opts)
    if lf.names == (ROWS, WINDOW):
        return rows_candidates(lf.bound[0], lf.bound[1], window_step)
    if len(lf.names) == 2:
        return prefill_candidates(lf.bound[0], lf.bound[1], opts.input_tokens, token_step)
    if lf.names == (ROWS,):
        return [(r,) for r in rows_grid(lf.bound[0])]
    return single_candidates(lf.names[0], lf.bound[0], token_step, window_step)


def grid_steps(opts: CompileOptions) -> tuple[int, int]:
    """The (token, window) steps of the length grid: as given, else the defaults."""
    return (
        TOKEN_STEP if opts.token_step is None else opts.token_step,
        WINDOW_STEP if opts.window_step is None else opts.window_step,
    )


def state_tensors(
    traced: Traced,
    allocator_slack: int,
    model: MemoryModel | None = None,
    weights: Weights | None = None,
) -> list[StateTensor]:
    """The KV cache (the phases' state inputs) and the runner's persistent byte blocks; on a GPU
    target (``model``) also what its allocator's rounding adds to the weights and KV arrays."""
    kv = [
        StateTensor(
            b.name,
            "kv",
            list(b.shape),
            b.dtype,
            nbytes(b.shape, b.dtype),
            window=SlidingWindow(*traced.rings[b.name]) if b.name in traced.rings else None,
            recurrent=b.name in traced.recurrent,
        )
        for b in _state_bindings(traced)
    ]
    blocks = _persistent(traced.phases, allocator_slack, model)
    if model is not None:
        size = rounding_block(model, weights, kv)
        if size:
            blocks.append(StateTensor(ROUNDING_BLOCK, "persistent", [size], "uint8", size))
    return kv + blocks


def _state_bindings(traced: Traced) -> list[TracedBinding]:
    """Every phase's state inputs, once each: the decode phase's first, then any only other phases
    read (a quantised cache's float arrays, read before its switch)."""
    phases = [traced.phase("decode"), *(p for p in traced.phases if p.name != "decode")]
    seen: dict[str, TracedBinding] = {}
    for phase in phases:
        for b in phase.inputs:
            if b.kind == "state":
                seen.setdefault(b.name, b)
    return list(seen.values())


def table1_stats(phases: list[Phase]) -> Stats:
    """The paper's Table 1 figures over all phases, and the largest arena against its bound."""
    logical = sum(1 for p in phases for t in p.tensors if is_arena_tenant(t))
    physical = sum(len(p.buffers) for p in phases)
    return Stats(
        logical_tensors=logical,
        physical_buffers=physical,
        reduction=(1 - physical / logical) if logical else 0.0,
        arena_bytes=max(p.arena_bytes for p in phases),
        lower_bound_bytes=max(p.lower_bound_bytes for p in phases),
    )


def emit_plan(
    source: ModelFolder,
    opts: CompileOptions,
    settings: Settings,
    traced: Traced,
    capacity: int,
    weights: Weights,
    state: list[StateTensor],
    phases: list[Phase],
    envelope: Envelope,
) -> Plan:
    """Emit: assemble the plan document from the passes' results."""
    config = source.config
    return Plan(
        schema_version=SCHEMA_VERSION,
        generator=Generator(dctms.__version__, mx.__version__, _mlx_lm_version()),
        bounds=Bounds(
            input_tokens=opts.input_tokens,
            output_tokens=opts.output_tokens,
            batch=opts.batch,
            prefill_chunk=settings.prefill_chunk,
            dtype=settings.dtype,
            kv=caches.kv_storage(traced.kv.dtype, opts),
            kv_capacity=capacity,
            prefix_blocks=traced.prefix_blocks,
        ),
        model=model_info(source, traced, weights),
        target=Target(
            backend=settings.backend,
            alignment=opts.alignment,
            profile=settings.profile,
            device_memory=opts.device_memory,
            run_ahead_dispatches=recorded_run_ahead(
                settings.backend, opts.run_ahead, settings.memory_model
            ),
            allocator_slack=settings.allocator_slack,
            memory_model=settings.memory_model,
        ),
        state=state,
        phases=phases,
        envelope=envelope,
        stats=table1_stats(phases),
        # The inputs as given, so `dctms check` can re-compile exactly this plan.
        compile=CompileRequest(config=config, **asdict(opts)),
    )


def model_info(source: ModelFolder, traced: Traced, weights: Weights) -> ModelInfo:
    """The plan's record of one model: architecture, config hash, layers, vocabulary, weights."""
    quant = source.config.get("quantization")
    return ModelInfo(
        architecture=str(source.config.get("model_type")),
        config_sha256=source.config_sha256,
        num_layers=traced.num_layers,
        vocab_size=traced.vocab_size,
        weights=weights,
        quantization=(
            Quantization(int(quant["group_size"]), int(quant["bits"]), quant.get("mode", "affine"))
            if quant and "bits" in quant
            else None
        ),
    )


def self_check(plan: Plan) -> None:
    """A plan the independent verifier rejects is a compiler bug: never emit it."""
    problems = verify_plan(plan)
    if problems:
        raise InternalError(
            f"internal error: the compiled plan fails verification ({len(problems)} problems; "
            f"first: {problems[0]} [{problems[0].rule}]); please report this with the config"
        )


def model_dtype(config: dict, headers: list[HeaderTensor] | None, cast: str | None) -> str:
    """The model's floating dtype: ``--dtype`` when given; else, with weights, the dtype most of
    their floating bytes are stored in (mlx-lm runs weights as stored); else the config's
    ``torch_dtype``/``dtype``, else bfloat16."""
    if cast is not None:
        return cast
    floating: dict[str, int] = {}
    for h in headers or ():
        if h.dtype in DTYPES:
            floating[h.dtype] = floating.get(h.dtype, 0) + h.bytes
    if floating:
        return max(sorted(floating), key=lambda d: floating[d])
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return dtype if dtype in DTYPES else "bfloat16"


def trace_device(settings: Settings) -> str:
    """The device the graph is traced on: a GPU target's on the CPU (cross-compilation: the same
    graph on every machine, MLX's composites of the fast kernels), else the plan's backend."""
    return "cpu" if settings.memory_model is not None else settings.backend


def use_device(backend: str) -> None:
    """Make ``backend`` MLX's default device; refuse a GPU this machine does not have."""
    if backend == "gpu" and not mx.is_available(mx.gpu):
        raise DctmsError("backend gpu: this machine's MLX has no GPU (compile there, or use cpu)")
    mx.set_default_device(mx.gpu if backend == "gpu" else mx.cpu)


def _persistent(
    phases: list[TracedPhase], slack: int, model: MemoryModel | None = None
) -> list[StateTensor]:
    """Memory the runner holds across calls besides the cache: each phase's constants (made once)
    and the input arrays of two calls (one computing, one being built), each with the allocator's
    cache-reuse slack. Recorded as byte blocks (uint8, shape [bytes])."""
    blocks = []
    for tp in phases:
        inputs = [b for b in tp.inputs if b.kind == "input"]
        for what, items in (("constants", tp.constants), ("inputs", inputs)):
            sizes = [nbytes(x.shape, x.dtype) for x in items]
            # The runner builds the next call while the current one computes: two calls' inputs.
            copies = 2 if what == "inputs" else 1
            size = copies * sum(b + overhead(model, b, slack) for b in sizes)
            if size:
                blocks.append(StateTensor(f"{tp.name}.{what}", "persistent", [size], "uint8", size))
    return blocks


def _mlx_lm_version() -> str:
    return mlx_lm_version()


def fingerprint_weights(
    traced: list[TracedBinding],
    headers: list[HeaderTensor] | None,
    source: ModelFolder,
    hash_files: bool,
    fused: dict[str, tuple[str, ...]] | None = None,
) -> Weights:
    """The fingerprint: from the safetensors headers when present (and they must match the model).

    A weight the plan casts at load (``--dtype``) is counted as resident, its stored dtype kept."""
    if headers is not None:
        by_name = {h.name: h for h in headers}
        rows = []
        for b in traced:
            h = by_name.get(b.name)
            if h is None:
                raise DctmsError(f"weights in {source.where} lack {b.name}, which the model needs")
            cast = h.dtype != b.dtype and h.dtype in DTYPES and b.dtype in DTYPES
            if tuple(h.shape) != tuple(b.shape) or (h.dtype != b.dtype and not cast):
                raise DctmsError(
                    f"weights in {source.where}: {b.name} is {h.dtype}{list(h.shape)}, "
                    f"the model expects {b.dtype}{list(b.shape)}"
                )
            rows.append(
                WeightTensor(
                    b.name,
                    list(b.shape),
                    b.dtype,
                    nbytes(b.shape, b.dtype),
                    stored_dtype=h.dtype if cast else None,
                )
            )
        extra = sorted(set(by_name) - {b.name for b in traced})
        if extra:
            raise DctmsError(
                f"weights in {source.where} hold {extra[0]}, which the model does not use"
            )
        files = {f.name: file_sha256(f) for f in source.weight_files} if hash_files else None
    else:
        rows = [
            WeightTensor(b.name, list(b.shape), b.dtype, nbytes(b.shape, b.dtype)) for b in traced
        ]
        files = None
    rows.sort(key=lambda w: w.name)
    return Weights(
        count=len(rows),
        total_bytes=sum(w.bytes for w in rows),
        layout_sha256=layout_sha256([(w.name, w.shape, w.dtype) for w in rows]),
        tensors=rows,
        files_sha256=files,
        fused=[FusedWeight(n, list(p)) for n, p in sorted((fused or {}).items())],
    )


@dataclass(frozen=True)
class Placement:
    """Pass 4's result for one phase: each tenant's (buffer, offset), the buffers, the arena."""

    of: dict[str, tuple[int, int]]
    buffer_sizes: list[int]
    arena_bytes: int
    lower_bound_bytes: int
    arena_optimal: str | None  # what proves the arena minimal (see assign.Packing.proof)
    arena_gap_bytes: int


def memory_rules(backend: str, run_ahead: str, model: MemoryModel | None = None) -> MemoryRules:
    """Pass 3's rules for a backend: MLX's CPU donation and run-ahead (``run_ahead`` "free" or
    "throttled"); a GPU target's command-buffer widening in kernel ops, without donation
    (``schema.targets``); GPU plans traced natively keep the throttled widening they always had
    (they are not proven: their run-ahead is not modelled)."""
    if model is not None:
        return MemoryRules(
            donation=False, run_ahead=run_ahead_budget(model), kernels=True, model=model
        )
    if backend != "cpu":
        return MemoryRules(donation=False, run_ahead=THROTTLED_RUN_AHEAD)
    return MemoryRules(donation=True, run_ahead=RUN_AHEAD[run_ahead])


def plan_phase(
    tp: TracedPhase,
    ridge: float,
    alignment: int,
    sync_every: int,
    allocator_slack: int,
    pack_seconds: float = 0.0,
    lengths: LengthFit | None = None,
    candidates: list[tuple[int, ...]] | None = None,
    say: Callable[[str], None] | None = None,
    rules: MemoryRules = CPU_RULES,
) -> Phase:
    """Passes 2-4 on one traced phase (schedule, lifetimes, assign), the length points that keep
    the bound's lifetimes (pass 3b), then emit its record."""
    views = {i for i, op in enumerate(tp.ops) if op.primitive in VIEW_ALWAYS | RESHAPES}
    sched = build_schedule(tp, views, ridge, sync_every)
    lives = analyse(tp, sched, rules)
    placement = assign_arena(lives, alignment, pack_seconds)
    phase = emit_phase(tp, sched, lives, placement, allocator_slack, rules.model)
    if lengths is None:
        return phase
    points, dropped = verified_points(tp, lengths, sched, lives, candidates or [], rules)
    if dropped and say:
        say(f"{tp.name}: {len(dropped)} length points left out (first: {dropped[0]})")
    return msgspec.structs.replace(phase, lengths=emit_lengths(tp, sched, lengths, points))


def emit_lengths(
    tp: TracedPhase, sched: Schedule, lf: LengthFit, points: list[tuple[int, ...]]
) -> Lengths:
    """The phase's ``lengths`` record: names, bound, verified points, and the affine places grouped
    by function (op arguments by *plan* op index, input binding axes)."""
    position = {i: p for p, i in enumerate(sched.order)}
    groups: dict[tuple[tuple[int, ...], int], list[str]] = {}
    for (i, path), f in sorted(lf.args.items(), key=lambda kv: (position[kv[0][0]], kv[0][1])):
        place = f"o{position[i]}/" + ".".join(map(str, path))
        groups.setdefault((f.k, f.c), []).append(place)
    for b in tp.inputs:
        for axis, f in sorted(lf.shapes.get(b.id, {}).items()):
            groups.setdefault((f.k, f.c), []).append(f"i{b.id}/{axis}")
    # Ops that create an array of a given shape (Full, Arange) need their output's shape.
    for i in sched.order:
        op = tp.ops[i]
        if op.primitive in CREATION_PRIMITIVES:
            for t in op.outputs:
                for axis, f in sorted(lf.shapes.get(t, {}).items()):
                    groups.setdefault((f.k, f.c), []).append(f"t{t}/{axis}")
    affine = [LengthAffine(list(k), c, at) for (k, c), at in sorted(groups.items())]
    return Lengths(
        names=list(lf.names),
        bound=list(lf.bound),
        points=[list(p) for p in points],
        affine=affine,
    )


def assign_arena(lives: PhaseLives, alignment: int, pack_seconds: float = 0.0) -> Placement:
    """Pass 4: buffers by interval colouring, offsets by packing (greedy, then a search of up to
    ``pack_seconds`` when it misses the lower bound), the lower bound and what proves the arena."""
    tenants = [t for t, life in lives.lives.items() if life.kind in ARENA_KINDS]
    intervals = [lives.slot_interval[t] for t in tenants]
    sizes = [lives.lives[t].bytes for t in tenants]
    buffer_of, buffer_size = assign.colour(intervals, sizes)
    packing = assign.pack(intervals, sizes, alignment, seconds=pack_seconds)
    return Placement(
        {t: (buffer_of[k], packing.offsets[k]) for k, t in enumerate(tenants)},
        buffer_size,
        packing.arena,
        packing.lower_bound,
        packing.proof,
        packing.gap,
    )


def emit_phase(
    tp: TracedPhase,
    sched: Schedule,
    lives: PhaseLives,
    placement: Placement,
    allocator_slack: int,
    model: MemoryModel | None = None,
) -> Phase:
    """Emit one phase: ops in execution order, tensor records by variant, buffers, sync points."""
    ops = []
    for p, i in enumerate(sched.order):  # an op's index in the plan is its position p
        op = tp.ops[i]
        ops.append(
            Op(
                primitive=op.primitive,
                inputs=list(op.inputs),
                outputs=list(op.outputs),
                args=op.args,
                memory_bound=sched.memory_bound[i],
                scratch=lives.scratch[p],
            )
        )
    outputs = {b.id for b in tp.outputs if b.kind == "output"}
    fresh_state = {b.id for b in tp.outputs if b.kind == "state"}
    tensors = []
    # Scratch after the op's outputs: by (producer position, scratch last).
    for t, life in sorted(
        lives.lives.items(), key=lambda kv: (kv[1].start, kv[1].scratch_of is not None)
    ):
        s, e = lives.slot_interval[t]
        buf, off = placement.of.get(t, (None, None))
        fields = dict(
            id=t,
            shape=list(life.shape),
            dtype=life.dtype,
            bytes=life.bytes,
            interval=[s, e],
            buffer=buf,
            offset=off,
            view_of=life.root if life.kind in ("view", "state") else None,
        )
        kind = _plan_kind(life, outputs)
        if kind == "intermediate" and t in fresh_state:
            kind = "output"  # a recurrent state made anew by this call (toolkit.caches)
        if kind == "scratch":
            tensors.append(Scratch(**fields, op=life.scratch_of))
        else:
            tensors.append(TENSOR_VARIANTS[kind](**fields))
    sync = [
        SyncPoint(slot=slot, reason=seg.reason, evaluate=list(seg.evaluate))
        for slot, seg in zip(sched.sync_slots, sched.segments, strict=True)
    ]
    return Phase(
        name=tp.name,
        tokens=tp.tokens,
        inputs=[Binding(b.id, b.kind, b.name, list(b.shape), b.dtype) for b in tp.inputs],
        outputs=[Binding(b.id, b.kind, b.name, list(b.shape), b.dtype) for b in tp.outputs],
        constants=[Constant(c.id, list(c.shape), c.dtype, c.value) for c in tp.constants],
        ops=ops,
        tensors=tensors,
        buffers=[Buffer(b, size) for b, size in enumerate(placement.buffer_sizes)],
        slots=sched.slots,
        sync_points=sync,
        arena_bytes=placement.arena_bytes,
        lower_bound_bytes=placement.lower_bound_bytes,
        arena_optimal=placement.arena_optimal,
        arena_gap_bytes=placement.arena_gap_bytes,
        slack_bytes=slack_bytes(tensors, len(sched.slots), allocator_slack, model),
    )


def _plan_kind(life, outputs: set[str]) -> str:
    # Views carry no kind of their own (view_of says what they alias), except a phase output.
    if life.kind == "view":
        return "output" if life.id in outputs else "intermediate"
    return life.kind
