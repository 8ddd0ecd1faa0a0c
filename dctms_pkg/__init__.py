"""dctms: Deterministic Compile-Time Memory Scheduling for MLX inference.

The Python API -- these names are stable; everything in the subpackages may change::

    import dctms

    plan = dctms.read_plan("plans/qwen7b.plan")          # validated, or dctms.PlanError
    plan.envelope.total                                   # M_max in bytes (an int)
    plan.envelope.weights, plan.envelope.kv               # ... and its components

    plan = dctms.compile_plan("models/qwen", input_tokens=2048, output_tokens=256)
    dctms.write_plan(plan, "qwen.plan")                   # canonical bytes, atomic

    result = dctms.fit("models/qwen", memory="16GiB", output_tokens=256)
    result.input_tokens, result.plan.envelope.total       # the longest prompt that fits

    dctms.check_plan("qwen.plan").ok                       # still what its request compiles to?

A scheduler admitting jobs by M_max needs only ``read_plan``: reading a plan imports msgspec and
jsonschema, never MLX or mlx-lm (``compile_plan``, ``fit`` and ``check_plan`` import the compiler
when called). Bad input raises ``DctmsError`` (one-line message, ``exit_code`` 2); an invalid plan
raises its subclass ``PlanError`` (``problems`` lists every finding); a ``compile_plan`` whose M_max
does not fit its ``memory`` raises the subclass ``OverBudgetError`` (the shortfall in its message,
the plan in ``err.plan``; ``exit_code`` 1, as ``dctms compile --memory`` exits).

Subpackages: ``dctms.schema`` (the plan file contract), ``dctms.toolkit`` (compiler passes),
``dctms.runner`` (executes plans), ``dctms.views`` (text, dot, trace), ``dctms.cli`` (the
``dctms`` command, built on this API), ``dctms.tui`` (the inspector).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from dctms.schema.errors import (  # plain exception classes, no imports
    DctmsError,
    OverBudgetError,
    PlanError,
)

if TYPE_CHECKING:
    from dctms.schema.types import Envelope, Plan
    from dctms.toolkit.check import CheckResult
    from dctms.toolkit.compiler import CompileOptions

__version__ = "0.1.0"

__all__ = [
    "CheckResult",
    "DctmsError",
    "Envelope",
    "FitResult",
    "OverBudgetError",
    "Plan",
    "PlanError",
    "check_plan",
    "compile_plan",
    "fit",
    "read_plan",
    "write_plan",
]

PathLike = str | os.PathLike[str]
Progress = Callable[[str], None]


def read_plan(path: PathLike, *, for_run: bool = False) -> Plan:
    """Read and validate the plan file at ``path`` (schema version, JSON Schema, semantic
    verifier). The verifier's proof that every index stays inside its array (rule
    ``index_safety``, seconds on a 7B plan) runs with ``for_run=True``, as ``dctms validate`` and
    the runner read; reading a plan for its figures does not need it. Raises ``PlanError`` naming
    every problem; never imports MLX."""
    from dctms.schema.io import read_plan as _read

    return _read(path, for_run=for_run)


def write_plan(plan: Plan, path: PathLike) -> None:
    """Write ``plan`` to ``path`` in the canonical text (same plan, same bytes), atomically."""
    from dctms.schema.io import write_plan as _write

    _write(plan, path)


def compile_plan(
    model: PathLike,
    input_tokens: int,
    output_tokens: int,
    *,
    batch: int = 1,
    prefill_chunk: int | None = None,
    dtype: str | None = None,
    memory: int | str | None = None,
    backend: Literal["cpu", "gpu"] | None = None,
    target: str | None = None,
    alignment: int = 64,
    profile: str | None = None,
    sync_every: int = 0,
    run_ahead: Literal["free", "throttled"] = "free",
    hash_weights: bool = False,
    pack_seconds: float = 2.0,
    real_lengths: bool = True,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    max_kv_size: int | None = None,
    token_step: int | None = None,
    window_step: int | None = None,
    ranks: int = 1,
    rank: int = 0,
    parallel: Literal["pipeline", "tensor"] | None = None,
    split: tuple[int, ...] | None = None,
    sampling: bool = False,
    prefix_blocks: int = 0,
    prefix_cache: int | str | None = None,
    fused: bool = False,
    progress: Progress | None = None,
) -> Plan:
    """Compile the memory plan of an mlx-lm model for prompts of at most ``input_tokens`` tokens
    and at most ``output_tokens`` generated ones -- what ``dctms compile`` does.

    ``model`` is a folder holding config.json (and, optionally, the model*.safetensors the plan is
    then fingerprinted against) or a config.json path. ``memory`` (bytes, or a size such as
    "16GiB") is recorded as the device budget: ``plan.envelope.free`` is then what is left; when
    M_max does not fit, ``OverBudgetError`` is raised (its message gives the shortfall in bytes,
    ``err.plan`` is the plan). The other options are ``dctms compile``'s (see its ``--help``).
    ``pack_seconds`` is the offset packer's search budget (a fixed amount of work, so the plan
    does not depend on the machine). ``run_ahead`` is ``--run-ahead``: "free" (MLX's own run-ahead
    bound, no throttle) or "throttled" (a smaller envelope; the runner's memory limit holds MLX's
    host back). ``real_lengths=False`` leaves out the length points the runner
    runs short calls at (fixed, padded phases; the envelope is the same); ``token_step`` and
    ``window_step`` set their grid (``dctms compile --token-step/--window-step``). ``ranks`` > 1
    with ``parallel`` compiles rank ``rank`` of the model split by mlx-lm's ``pipeline`` (``split``:
    layers per rank) or ``shard`` (tensor); ``dctms.toolkit.kinds.distributed.compile_ranks`` makes every
    rank's. ``sampling`` is ``--sampling``: mlx-lm's sampler, logits processors and the top
    log-probabilities traced into the plan (per-call settings; see ``dctms run --help``).
    ``target`` is ``--target``: "cpu", "metal[-PROFILE]" or "cuda[-PROFILE]" (a GPU's memory
    model from MLX's source: the graph is traced on the CPU on any machine; see the docs' Targets).
    ``batch`` > 1 plans that many slots (sequences in flight at once, each at its own position;
    ``dctms.runner.batch``); ``prefix_blocks`` (or ``prefix_cache``, bytes or a size) adds a
    prompt-prefix pool of that many blocks (``dctms.toolkit.prefix_pool``). ``fused`` is
    ``--fused``: mx.fast's kernels as single plan ops in a CPU plan (``dctms.toolkit.fused_kernels``). ``progress`` receives one line per compiler pass. Weights are never loaded.
    """
    from dctms.figures.budget import shortfall
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import compile_plan as _compile

    options = _options(
        input_tokens,
        output_tokens,
        batch=batch,
        prefill_chunk=prefill_chunk,
        dtype=dtype,
        device_memory=_bytes(memory, "memory"),
        backend=backend,
        target=target,
        alignment=alignment,
        profile=profile,
        hash_weights=hash_weights,
        sync_every=sync_every,
        run_ahead=run_ahead,
        pack_seconds=pack_seconds,
        real_lengths=real_lengths,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
        max_kv_size=max_kv_size,
        token_step=token_step,
        window_step=window_step,
        ranks=ranks,
        rank=rank,
        parallel=parallel,
        split=split,
        sampling=sampling,
        fused=fused,
        prefix_blocks=prefix_blocks,
        prefix_cache=_bytes(prefix_cache, "prefix_cache"),
    )
    plan = _compile(open_model(model), options, progress)
    short = shortfall(plan.envelope)
    if short:
        raise OverBudgetError(short, plan)
    return plan


def _options(input_tokens: int, output_tokens: int, **fields: Any) -> CompileOptions:
    """The compiler's options at these bounds: the one place the API builds them, so that
    ``compile_plan`` and ``fit`` take the same set."""
    from dctms.toolkit.compiler import CompileOptions

    return CompileOptions(input_tokens=input_tokens, output_tokens=output_tokens, **fields)


@dataclass(frozen=True)
class FitResult:
    """The answer of ``fit``: the largest ``searched`` value whose plan fits ``budget``."""

    searched: Literal["input_tokens", "output_tokens"]
    value: int | None  # None when not even 1 token fits
    input_tokens: int | None
    output_tokens: int | None
    budget: int
    cap: int  # the search stopped here at the latest (max_position_embeddings, else 2^20)
    plan: Plan | None  # the plan at the answer
    compiles: int = 0  # plans compiled by the search
    totals: dict[int, int] = field(default_factory=dict)  # value -> M_max of every compile

    @property
    def capped(self) -> bool:
        """The answer is the cap (the budget would allow more)."""
        return self.value == self.cap


def fit(
    model: PathLike,
    memory: int | str,
    *,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
    batch: int = 1,
    prefill_chunk: int | None = None,
    dtype: str | None = None,
    backend: Literal["cpu", "gpu"] | None = None,
    target: str | None = None,
    alignment: int = 64,
    profile: str | None = None,
    sync_every: int = 0,
    run_ahead: Literal["free", "throttled"] = "free",
    hash_weights: bool = False,
    pack_seconds: float = 2.0,
    real_lengths: bool = True,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    max_kv_size: int | None = None,
    token_step: int | None = None,
    window_step: int | None = None,
    ranks: int = 1,
    rank: int = 0,
    parallel: Literal["pipeline", "tensor"] | None = None,
    split: tuple[int, ...] | None = None,
    sampling: bool = False,
    prefix_blocks: int = 0,
    prefix_cache: int | str | None = None,
    fused: bool = False,
    progress: Progress | None = None,
) -> FitResult:
    """The largest N (give ``output_tokens``) or M (give ``input_tokens``) whose M_max fits
    ``memory`` -- what ``dctms fit`` searches (``views.fit.largest_fitting``: a linear estimate of
    the crossing, then interpolation, bisection when that stalls), capped by the config's
    max_position_embeddings (N + M). Takes every ``compile_plan`` option; with ``ranks`` > 1 the
    budget is per rank: a probe's M_max is the largest of its ranks' (``rank`` is then ignored and
    ``result.plan`` is the rank with the largest M_max). The probes compile
    without the length points (the envelope is the same); ``result.plan`` is compiled with the
    options as given."""
    from dataclasses import replace

    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import compile_plan as _compile
    from dctms.toolkit.compiler import length_extent, length_step
    from dctms.toolkit.kinds.distributed import widest_rank
    from dctms.toolkit.limits import MAX_TOKENS
    from dctms.views.fit import DEFAULT_CAP, largest_fitting, max_positions

    if (input_tokens is None) == (output_tokens is None):
        raise DctmsError("fit: give exactly one of input_tokens or output_tokens")
    budget = _bytes(memory, "memory")
    assert budget is not None
    search_n = output_tokens is not None
    fixed = output_tokens if search_n else input_tokens
    assert fixed is not None
    if fixed < 1:
        raise DctmsError(f"fit: the fixed token count must be at least 1, got {fixed}")
    source = open_model(model)
    limit = max_positions(source.config)
    cap = min(DEFAULT_CAP if limit is None else limit - fixed, MAX_TOKENS - fixed)
    fields = dict(
        batch=batch,
        prefill_chunk=prefill_chunk,
        dtype=dtype,
        device_memory=budget,
        backend=backend,
        target=target,
        alignment=alignment,
        profile=profile,
        hash_weights=hash_weights,
        sync_every=sync_every,
        run_ahead=run_ahead,
        pack_seconds=pack_seconds,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
        max_kv_size=max_kv_size,
        token_step=token_step,
        window_step=window_step,
        ranks=ranks,
        rank=rank,
        parallel=parallel,
        split=split,
        sampling=sampling,
        fused=fused,
        prefix_blocks=prefix_blocks,
        prefix_cache=_bytes(prefix_cache, "prefix_cache"),
    )
    def bounds(value: int) -> tuple[int, int]:
        return (value, fixed) if search_n else (fixed, value)

    base = _options(*bounds(1), **fields, real_lengths=False)

    def compiled(opts, probe: bool = False):  # with ranks, the budget is per rank
        return (widest_rank if ranks > 1 else _compile)(source, opts, probe=probe)

    def measure(value: int) -> int:
        n, m = bounds(value)
        plan = compiled(replace(base, input_tokens=n, output_tokens=m), probe=True)
        if progress is not None:
            progress(f"{'N' if search_n else 'M'} = {value:,}: M_max {plan.envelope.total:,}")
        return plan.envelope.total

    # as `dctms fit`: the cap first, one compile per length key, probes on the chunk grid
    step, extent = length_step(base, search_n), length_extent(base, search_n, cap)
    found = (
        largest_fitting(measure, budget, cap, hint=cap, step=step, extent=extent)
        if cap >= 1
        else None
    )
    best = found.best if found is not None else None
    plan = None
    if best is not None:
        plan = compiled(_options(*bounds(best), **fields, real_lengths=real_lengths))
    return FitResult(
        searched="input_tokens" if search_n else "output_tokens",
        value=best,
        input_tokens=(best if search_n else fixed) if best is not None else None,
        output_tokens=(fixed if search_n else best) if best is not None else None,
        budget=budget,
        cap=cap,
        plan=plan,
        compiles=len(found.probes) if found is not None else 0,
        totals={p.value: p.total for p in found.probes} if found is not None else {},
    )


def check_plan(
    path: PathLike, model: PathLike | None = None, *, write: bool = False
) -> CheckResult:
    """Re-compile the plan at ``path`` from the request it records -- against ``model`` (a folder
    or config.json) when given, else the recorded config -- and compare: ``result.verdict`` is
    "ok", "stale" (``result.reason`` names the first differing figure) or "edited". ``write``
    replaces a stale plan with the re-compile. What ``dctms check`` does."""
    from dctms.toolkit.check import check_plan as _check

    return _check(path, model, write=write)


def _bytes(value: int | str | None, name: str) -> int | None:
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        if value is not None and value < 1:
            raise DctmsError(f"{name} must be at least 1 byte, got {value}")
        return value
    if isinstance(value, str):
        from dctms.figures.units import parse_size

        try:
            return parse_size(value)
        except DctmsError as err:
            raise DctmsError(f"{name}: {err}") from None
    raise DctmsError(f"{name} must be a byte count or a size such as '16GiB', got {value!r}")


def __getattr__(name: str):
    # Types on first use, so `import dctms` itself stays free of imports.
    if name in ("Plan", "Envelope"):
        from dctms.schema import types

        return getattr(types, name)
    if name == "CheckResult":
        from dctms.toolkit.check import CheckResult

        return CheckResult
    raise AttributeError(f"module 'dctms' has no attribute {name!r}")
