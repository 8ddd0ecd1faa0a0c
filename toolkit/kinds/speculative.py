"""Speculative decoding in one plan: a draft model proposes K tokens, the target verifies them.

Greedy speculative decoding as mlx-lm's ``speculative_generate_step`` does it: the draft decodes K
tokens one at a time; the target scores the last accepted token and the K drafts in one call of
K + 1 tokens (the *verify* phase) and keeps the drafts up to the first one its own greedy choice
differs from, plus its own token there. The output is the target's greedy output.

Both models are planned here, each with the compiler's passes:

* the target: prefill, decode (the plan stays runnable without the draft) and verify (K + 1 tokens
  at ``position``; ``next_token`` holds the greedy id after each of them);
* the draft: prefill and decode, in ``Plan.draft``.

Both static caches hold ``kv_capacity(N, M + K)`` positions: the last verify call starts at
N + M - 2 and writes K + 1 positions. A rejected suffix is rewound by moving the write position
(the next call overwrites it; attention masks by position), so nothing is allocated per round.
Every intermediate is planned at its worst case (the longest window, every draft token proposed):
a draft call that ends early uses less. The envelope (``EnvelopePart`` per model): weights, KV and
persistent state of both are resident for the whole run and add up; the runner drains one model's
call before it starts the other's, so only one arena is live at a time and M_intermediate is the
larger of the two models' largest arenas.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import msgspec
from mlx.utils import tree_unflatten

from dctms.schema.draft import DRAFT, TARGET, VERIFY
from dctms.schema.errors import DctmsError
from dctms.schema.model_folder import ModelFolder
from dctms.schema.sizes import cast_overshoot
from dctms.schema.types import Draft, EnvelopePart, Plan, Weights
from dctms.toolkit import limits
from dctms.toolkit.compiler import (
    CompileOptions,
    ModelPart,
    _check_options,
    emit_plan,
    model_info,
    plan_model,
    resolve_settings,
    self_check,
    table1_stats,
    use_device,
)
from dctms.toolkit.envelope import build_envelope
from dctms.toolkit.lengths import WINDOW, NotAffine, digest, fit, sample_lengths
from dctms.toolkit.module_paths import attach_modules, trace_module_paths
from dctms.toolkit.trace import PhaseTracer, StaticKVCache, TracedPhase, _export

MAX_DRAFT = 64  # more draft tokens per round than any speculative setup uses


def compile_speculative(
    target: ModelFolder,
    draft: ModelFolder,
    opts: CompileOptions,
    num_draft: int,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """The plan of ``target`` with ``draft`` proposing ``num_draft`` tokens per verify call."""
    say = progress or (lambda _msg: None)
    _check_options(opts)
    if not 1 <= num_draft <= MAX_DRAFT:
        raise DctmsError(f"--num-draft must be between 1 and {MAX_DRAFT}, got {num_draft}")
    if opts.batch != 1:
        raise DctmsError(f"speculative decoding is planned for batch 1, got --batch {opts.batch}")
    if opts.kv_bits is not None:
        raise DctmsError("--draft: not supported yet with --kv-bits (a quantised KV cache)")
    for source in (target, draft):
        limits.check_config(source.config)
    check_same_vocabulary(target, draft)
    t_headers = target.headers() if target.weight_files else None
    d_headers = draft.headers() if draft.weight_files else None
    settings = resolve_settings(target.config, t_headers, opts)
    d_settings = resolve_settings(draft.config, d_headers, opts)
    use_device(settings.backend)
    # The packer's budget, shared by the five phases of the two models.
    share = opts.pack_seconds / 5
    say(f"target: {target.config.get('model_type')}, verify calls of {num_draft + 1} tokens")
    t_part = plan_model(
        target,
        t_headers,
        opts,
        settings,
        say,
        extra_positions=num_draft,
        more_phases=_verify_phase(num_draft + 1),
        pack_seconds=3 * share,
    )
    say(f"draft: {draft.config.get('model_type')}")
    d_part = plan_model(
        draft, d_headers, opts, d_settings, say, extra_positions=num_draft, pack_seconds=2 * share
    )
    for name, part, phases in (("target", t_part, TARGET_PHASES), ("draft", d_part, DRAFT_PHASES)):
        check_plain_cache(name, part, phases)
    if d_part.traced.vocab_size != t_part.traced.vocab_size:
        raise DctmsError(_vocab_message(t_part.traced.vocab_size, d_part.traced.vocab_size))
    parts = [_part(TARGET, t_part), _part(DRAFT, d_part)]
    envelope = build_envelope(
        weights=sum(p.weights for p in parts),
        kv=sum(p.kv for p in parts),
        persistent=sum(p.persistent for p in parts),
        intermediate=max(p.intermediate for p in parts),
        backend=settings.backend,
        device_memory=opts.device_memory,
        cache_enabled=settings.allocator_slack > 0,
    )
    envelope = msgspec.structs.replace(envelope, parts=parts)
    check_load_overshoot(t_part.weights, d_part.weights, parts, envelope.intermediate)
    plan = emit_plan(
        target,
        opts,
        settings,
        t_part.traced,
        t_part.capacity,
        t_part.weights,
        t_part.state,
        t_part.phases,
        envelope,
    )
    request = msgspec.structs.replace(plan.compile, draft_config=draft.config, num_draft=num_draft)
    # Each model's module paths in its own tree: the draft's layers are not the target's.
    record = attach_modules(_draft_record(draft, d_part, num_draft), d_part.traced.phases)
    plan = msgspec.structs.replace(plan, compile=request, draft=record)
    plan = attach_modules(plan, t_part.traced.phases)  # the target's, verify included
    self_check(plan)
    return plan


TARGET_PHASES = ("prefill", "decode", VERIFY)
DRAFT_PHASES = ("prefill", "decode")


def check_plain_cache(name: str, part: ModelPart, phases: tuple[str, ...]) -> None:
    """Rewinding by the write position needs a full KV cache on every layer (keys and values of
    every position): refuse sliding windows, recurrent state and extra phases they bring."""
    extra = [p.name for p in part.phases if p.name not in phases]
    odd = [
        s.name
        for s in part.state
        if s.kind == "kv"
        and (not s.name.endswith((".keys", ".values")) or s.shape[2:3] != [part.capacity])
    ]
    if extra or odd:
        what = f"phase {extra[0]}" if extra else f"state {odd[0]}"
        raise DctmsError(
            f"--draft: not supported yet: the {name} needs {what}; speculative decoding is "
            "planned for models with a full KV cache on every layer"
        )


def check_same_vocabulary(target: ModelFolder, draft: ModelFolder) -> None:
    """Refuse a pair whose configs give different vocabularies: the draft's ids feed the target."""
    tv, dv = target.config.get("vocab_size"), draft.config.get("vocab_size")
    if isinstance(tv, int) and isinstance(dv, int) and tv != dv:
        raise DctmsError(_vocab_message(tv, dv))


def _vocab_message(target: int, draft: int) -> str:
    return (
        f"--draft: the draft's vocabulary ({draft} tokens) differs from the target's ({target}); "
        "speculative decoding needs one vocabulary"
    )


def check_load_overshoot(
    t_weights: Weights, d_weights: Weights, parts: list[EnvelopePart], intermediate: int
) -> None:
    """Casting weights at load (``--dtype``) holds one stored copy beside the resident ones. The
    runner loads the target first (everything of the draft and the arena still unallocated), then
    the draft (the target fully resident): each overshoot must fit what is not allocated yet."""
    target, draft = parts
    rooms = (
        (t_weights, target.kv + target.persistent + draft.weights + draft.kv + draft.persistent),
        (d_weights, draft.kv + draft.persistent),
    )
    for weights, room in rooms:
        over = cast_overshoot(weights.tensors)
        if over > room + intermediate:
            raise DctmsError(
                f"--dtype: casting the weights at load would exceed the resident weights by {over} "
                f"bytes, more than the {room + intermediate} bytes not yet allocated then; "
                "convert the weights to that dtype instead (or compile without --dtype)"
            )


def _part(model: str, part: ModelPart) -> EnvelopePart:
    return EnvelopePart(
        model=model,
        weights=part.weights.total_bytes,
        kv=sum(s.bytes for s in part.state if s.kind == "kv"),
        persistent=sum(s.bytes for s in part.state if s.kind == "persistent"),
        intermediate=max(p.arena_bytes + p.slack_bytes for p in part.phases),
    )


def _draft_record(source: ModelFolder, part: ModelPart, num_draft: int) -> Draft:
    return Draft(
        num_draft=num_draft,
        model=model_info(source, part.traced, part.weights),
        state=part.state,
        phases=part.phases,
        stats=table1_stats(part.phases),
    )


# ------------------------------------------------------------------------- the verify phase


def _verify_phase(tokens: int):
    """The target's extra phase: ``tokens`` tokens at ``position``, attention over the window."""

    def more(tracer: PhaseTracer, window: int, real_lengths: bool):
        bound = trace_verify(tracer, tokens, window, paths=True)
        if not real_lengths:
            return [(bound, None)]
        return [(bound, _fit_window(lambda w: trace_verify(tracer, tokens, w), bound, window))]

    return more


def trace_verify(
    tracer: PhaseTracer, tokens: int, window: int, paths: bool = False
) -> TracedPhase:
    """``tokens`` tokens at ``position`` against the static cache; ``next_token`` [batch, tokens]
    is the greedy id after each (argmax of log-probabilities, as mlx-lm's greedy sampler);
    ``paths``: with each op's module path (a second, recording trace)."""
    if tracer.layout.quant is not None:
        raise DctmsError(
            "--draft with --kv-bits: a quantised KV cache is not planned for speculative decoding yet"
        )
    if any(tracer.layout.rings):
        raise DctmsError(
            "--draft: speculative decoding over a sliding-window or recurrent cache is not planned yet"
        )

    def fn(tokens_, position, **kw):
        model = tracer.model
        model.update(tree_unflatten([(k, kw[k]) for k in tracer.params]))
        caches = [
            StaticKVCache(kw[f"kv.{i}.keys"], kw[f"kv.{i}.values"], position, window)
            for i in range(tracer.num_layers)
        ]
        logits = model(tokens_, cache=caches)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        outs = [mx.argmax(logprobs, axis=-1)]
        for c in caches:
            outs += [c.keys, c.values]
        return tuple(outs)

    feeds = {
        "tokens": mx.zeros((tracer.batch, tokens), mx.int32),
        "position": mx.array(0, mx.int32),
    }
    phase = _export(VERIFY, tokens, fn, feeds, tracer.weights, tracer.state, tracer.layout.names)
    if paths:
        keywords = {**tracer.weights, **tracer.state}
        phase.module_paths = trace_module_paths(
            tracer.model, fn, list(feeds.values()), keywords, phase.ops
        )
    return phase


def _fit_window(trace_at: Callable[[int], TracedPhase], bound: TracedPhase, window: int):
    """The phase's fit over its attention window, or why it has none (as the decode phase's)."""
    ws = sample_lengths(window)
    if not ws:
        return "the bounds are too small to vary"
    try:
        samples = [((window,), digest(bound, bound, (window,)))]
        samples += [((w,), digest(bound, trace_at(w), (w,))) for w in ws]
        return fit([WINDOW], samples, bound)
    except NotAffine as err:
        return str(err)
