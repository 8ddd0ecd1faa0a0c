"""What a knob does, measured: re-compile a plan's recorded request with one option changed.

``dctms explain`` compares each of these plans with a baseline compiled the same way from the same
request (``figures.explain.knob_effect``), so a difference is the knob's alone. The re-compiles
skip the real-length points (``real_lengths=False``, as ``dctms fit``'s probes do): they cost most
of a compile's time. Every plan kind is re-compiled as it was made (``kinds.dispatch.compile_kind``:
a speculative plan with its recorded draft, a vision-language plan with its image bounds).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

from dctms.schema.errors import DctmsError
from dctms.schema.model_folder import model_from_config, open_model
from dctms.schema.types import Plan
from dctms.toolkit.check import options_of
from dctms.toolkit.compiler import CompileOptions
from dctms.toolkit.kinds.dispatch import compile_kind, kind_of

# knob -> the CompileOptions field it sets
KNOBS = {"chunk": "prefill_chunk", "N": "input_tokens", "M": "output_tokens", "batch": "batch"}
DEFAULT_KNOBS = ("chunk", "N", "M")


@dataclass(frozen=True)
class KnobCompile:
    knob: str
    old: int
    new: int
    plan: Plan


def knob_value(plan: Plan, knob: str) -> int:
    """The value a knob has in ``plan`` (the resolved one: the chunk the compiler chose)."""
    b = plan.bounds
    return {
        "chunk": b.prefill_chunk,
        "N": b.input_tokens,
        "M": b.output_tokens,
        "batch": b.batch,
    }[knob]


def next_value(knob: str, value: int) -> int | None:
    """The value a knob is tried at: half (batch: double); None when it cannot be halved."""
    if knob == "batch":
        return value * 2
    return value // 2 if value >= 2 else None


def compile_knobs(
    plan: Plan,
    knobs: tuple[str, ...] = DEFAULT_KNOBS,
    model: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[Plan, list[KnobCompile]]:
    """The baseline (``plan``'s recorded request re-compiled the same way as the knobs) and one
    re-compile per knob with that knob changed. ``model``: a model folder or config.json to
    compile instead of the recorded config (a plan compiled with weights takes its dtypes and
    quantised layers from them)."""
    request = plan.compile
    if request is None:
        raise DctmsError(
            "the plan records no compile request, so its knobs cannot be re-compiled "
            "(re-make it with `dctms compile`, or pass --no-knobs)"
        )
    unknown = [k for k in knobs if k not in KNOBS]
    if unknown:
        raise DctmsError(f"unknown knob {unknown[0]!r} (choose from {', '.join(KNOBS)})")
    base = options_of(request)
    if model is not None:
        source = open_model(model)
    else:
        source = model_from_config(request.config)
    say = progress or (lambda _msg: None)
    say("compiling the baseline")
    kind = kind_of(request)  # text, vision-language or speculative: compiled as it was made
    baseline = compile_kind(source, dataclasses.replace(base, real_lengths=False), kind)
    out = []
    for knob in knobs:
        old = knob_value(plan, knob)
        new = next_value(knob, old)
        if new is None:
            continue
        opts: CompileOptions = dataclasses.replace(base, real_lengths=False, **{KNOBS[knob]: new})
        if knob == "N" and request.prefill_chunk is None:
            # Keep the chunk the plan runs at (the default chunk follows N).
            opts = dataclasses.replace(opts, prefill_chunk=min(plan.bounds.prefill_chunk, new))
        say(f"compiling with {knob} {old} -> {new}")
        try:
            changed = compile_kind(source, opts, kind)
        except DctmsError as err:
            raise DctmsError(f"--knobs {knob}: {old} -> {new} does not compile: {err}") from None
        out.append(KnobCompile(knob, old, new, changed))
    return baseline, out
