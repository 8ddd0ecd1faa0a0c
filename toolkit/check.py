"""``dctms check``: is a checked-in plan still what its recorded request compiles to?

A plan records what it was compiled from (``Plan.compile``: the model's config.json and every compile
option as given). ``check_plan`` re-compiles from that request -- against the recorded config, or a
model folder / config file the caller names (the model as it is now) -- and compares:

- ``ok``: the re-compile is byte-identical to the file;
- ``stale``: the re-compile differs; ``reason`` names the first differing figure (M_max first, then
  the envelope, Table 1, model fingerprint, bounds, target, generator, phases);
- ``edited``: the file is not what dctms writes: not the canonical text of the plan it decodes to,
  or (when the figures all agree) bytes a compile does not produce.

A plan whose digest (harden's sha256 of the canonical body) does not match is ``edited``; one that
cannot be read or fails validation otherwise raises ``PlanError``; a plan without a request, or a
model that cannot be compiled, raises ``DctmsError`` (the CLI's exit 2).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import msgspec

from dctms.figures.units import human
from dctms.schema.errors import DctmsError, PlanError
from dctms.schema.io import decode_plan, encode_plan, write_plan
from dctms.schema.model_folder import ModelFolder, model_from_config, open_model
from dctms.schema.types import CompileRequest, Plan
from dctms.toolkit.compiler import CompileOptions
from dctms.toolkit.kinds.dispatch import compile_kind, kind_flags, kind_of

Verdict = Literal["ok", "stale", "edited"]


@dataclass(frozen=True)
class CheckResult:
    """What ``check_plan`` found: ``verdict`` is ``"ok"`` (the plan is what its recorded request
    compiles to today), ``"stale"`` (the compiler or the model changed it: ``reason`` names the
    first difference, ``remedy`` the command that re-makes it, ``fresh`` the re-compiled plan) or
    ``"edited"`` (the file was changed after it was written)."""

    path: str
    verdict: Verdict
    reason: str  # "" when ok; else the first difference, on one line
    remedy: str  # the command line that re-makes the plan; "" when ok (nothing to do)
    fresh: Plan | None = None  # the re-compiled plan (None when the file was refused as edited)

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"

    def line(self) -> str:
        """``PATH: ok`` or ``PATH: stale: REASON; re-make with: COMMAND`` (one line)."""
        if self.ok:
            return f"{self.path}: ok (re-compiles to the same bytes)"
        return f"{self.path}: {self.verdict}: {self.reason}; re-make with: {self.remedy}"


def options_of(request: CompileRequest) -> CompileOptions:
    """The compiler options a request records (every ``CompileOptions`` field is recorded)."""
    return CompileOptions(**{f.name: getattr(request, f.name) for f in fields(CompileOptions)})


def compile_command(request: CompileRequest, model: str, output: str) -> str:
    """The ``dctms compile`` command line equivalent to ``request``."""
    defaults = CompileOptions(request.input_tokens, request.output_tokens)
    words = ["dctms", "compile", model, "-N", str(request.input_tokens)]
    words += ["-M", str(request.output_tokens)]
    flags = {
        "batch": "--batch",
        "prefill_chunk": "--prefill-chunk",
        "dtype": "--dtype",
        "device_memory": "--memory",
        "backend": "--backend",
        "target": "--target",
        "alignment": "--alignment",
        "profile": "--profile",
        "sync_every": "--sync-every",
        "pack_seconds": "--pack-seconds",
        "token_step": "--token-step",
        "window_step": "--window-step",
        "kv_bits": "--kv-bits",
        "kv_group_size": "--kv-group-size",
        "quantized_kv_start": "--quantized-kv-start",
        "max_kv_size": "--max-kv-size",
    }
    for name, flag in flags.items():
        value = getattr(request, name)
        if value != getattr(defaults, name):
            words += [flag, str(value)]
    if request.hash_weights:
        words.append("--hash-weights")
    if request.sampling:
        words.append("--sampling")
    return shlex.join(words + kind_flags(request) + ["-o", output])


def check_plan(
    path: str | os.PathLike[str],
    model: str | os.PathLike[str] | None = None,
    *,
    write: bool = False,
    progress: Callable[[str], None] | None = None,
) -> CheckResult:
    """Re-compile the plan at ``path`` from its request and compare (see the module docstring).

    ``model``: a model folder or config.json to compile against instead of the recorded config.
    ``write``: replace a stale plan with the re-compile (atomically); an edited one is left alone.
    """
    source_name = str(path)
    data = _read_bytes(Path(path))
    try:
        plan = decode_plan(data, source_name)
    except PlanError as err:
        # The plan's digest (its canonical body's sha256) no longer matches: changed after writing.
        changed = [p for p in err.problems if p.rule == "digest"]
        if changed and len(changed) == len(err.problems):
            return CheckResult(source_name, "edited", changed[0].message, "dctms compile ...")
        raise
    request = plan.compile
    if request is None:
        raise DctmsError(
            f"{source_name}: records no compile request (not written by `dctms compile` of this "
            "version): re-make it with `dctms compile`"
        )
    source = _source(plan, request, model, source_name)
    command = compile_command(request, str(model) if model is not None else "MODEL", source_name)
    canonical = encode_plan(plan)
    if canonical != data:
        line = _first_differing_line(data, canonical)
        reason = f"not the canonical text dctms writes (hand-edited? line {line} differs)"
        return CheckResult(source_name, "edited", reason, command)

    fresh = compile_kind(source, options_of(request), kind_of(request), progress)
    if request.hub is not None:  # where the model came from: provenance, not compiled
        fresh = msgspec.structs.replace(
            fresh, compile=msgspec.structs.replace(fresh.compile, hub=request.hub)
        )
    fresh_bytes = encode_plan(fresh)
    if fresh_bytes == data:
        return CheckResult(source_name, "ok", "", "", fresh)  # nothing to re-make
    difference = first_difference(plan, fresh)
    if difference is None:
        # Every figure agrees but the bytes do not: a detail of the plan was changed by hand
        # consistently enough to pass the verifier (a re-compile never differs only there).
        line = _first_differing_line(data, fresh_bytes)
        reason = f"differs from a re-compile at line {line} although every figure agrees"
        return CheckResult(source_name, "edited", reason, command, fresh)
    why = causes(plan, fresh)
    if why:
        difference += f" ({', '.join(why)})"
    if write:
        write_plan(fresh, path)
        difference += " (rewritten)"
    # From the recorded config, `check --write` re-makes it; against a model, `compile` does.
    remedy = (
        command if model is not None else shlex.join(["dctms", "check", "--write", source_name])
    )
    return CheckResult(source_name, "stale", difference, remedy, fresh)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DctmsError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DctmsError(f"{path}: is a directory, not a plan file") from None
    except OSError as err:
        raise DctmsError(f"{path}: cannot read: {err.strerror or err}") from None


def _source(
    plan: Plan, request: CompileRequest, model: str | os.PathLike[str] | None, name: str
) -> ModelFolder:
    if model is not None:
        return open_model(model)
    if plan.model.weights.files_sha256 is not None:
        raise DctmsError(
            f"{name}: records the sha256 of its weight files: give --model DIR to check them"
        )
    return model_from_config(request.config)


def _first_differing_line(a: bytes, b: bytes) -> int:
    for number, (x, y) in enumerate(zip(a.splitlines(), b.splitlines(), strict=False), 1):
        if x != y:
            return number
    return min(len(a.splitlines()), len(b.splitlines())) + 1


# ------------------------------------------------------------------------------ the first figure

# (label, getter, is a byte count): in the order a reviewer wants to hear about them.
Figure = tuple[str, Callable[[Plan], Any], bool]

FIGURES: list[Figure] = [
    ("M_max (envelope.total)", lambda p: p.envelope.total, True),
    *[
        (f"envelope.{name}", lambda p, n=name: getattr(p.envelope, n), True)
        for name in ("weights", "kv", "persistent", "intermediate", "runtime", "device", "free")
    ],
    ("stats.logical_tensors", lambda p: p.stats.logical_tensors, False),
    ("stats.physical_buffers", lambda p: p.stats.physical_buffers, False),
    ("stats.arena_bytes", lambda p: p.stats.arena_bytes, True),
    ("stats.lower_bound_bytes", lambda p: p.stats.lower_bound_bytes, True),
    ("model.architecture", lambda p: p.model.architecture, False),
    ("model.num_layers", lambda p: p.model.num_layers, False),
    ("model.vocab_size", lambda p: p.model.vocab_size, False),
    ("model.weights.count", lambda p: p.model.weights.count, False),
    ("model.weights.total_bytes", lambda p: p.model.weights.total_bytes, True),
    ("model.weights.layout_sha256", lambda p: p.model.weights.layout_sha256, False),
    ("model.weights.files_sha256", lambda p: p.model.weights.files_sha256, False),
    ("model.quantization", lambda p: p.model.quantization, False),
    ("model.config_sha256 (config.json)", lambda p: p.model.config_sha256, False),
    ("bounds", lambda p: p.bounds, False),
    ("target", lambda p: p.target, False),
    ("generator.dctms", lambda p: p.generator.dctms, False),
    ("generator.mlx", lambda p: p.generator.mlx, False),
    ("generator.mlx_lm", lambda p: p.generator.mlx_lm, False),
    ("state", lambda p: p.state, False),
    ("phases", lambda p: [ph.name for ph in p.phases], False),
]

PHASE_FIGURES: list[tuple[str, Callable[[Any], Any]]] = [
    ("arena_bytes", lambda ph: ph.arena_bytes),
    ("slack_bytes", lambda ph: ph.slack_bytes),
    ("lower_bound_bytes", lambda ph: ph.lower_bound_bytes),
    ("ops (count)", lambda ph: len(ph.ops)),
    ("tensors (count)", lambda ph: len(ph.tensors)),
    ("buffers (count)", lambda ph: len(ph.buffers)),
    ("slots (count)", lambda ph: len(ph.slots)),
    ("sync_points", lambda ph: ph.sync_points),
    ("ops", lambda ph: ph.ops),
    ("tensors", lambda ph: ph.tensors),
    ("buffers", lambda ph: ph.buffers),
    ("slots", lambda ph: ph.slots),
    ("inputs", lambda ph: ph.inputs),
    ("outputs", lambda ph: ph.outputs),
    ("constants", lambda ph: ph.constants),
]


def first_difference(recorded: Plan, fresh: Plan) -> str | None:
    """The first figure (in ``FIGURES`` order, then per phase) on which the two plans differ, as
    ``"FIGURE: OLD in the plan, NEW re-compiled"``; None when they agree on every one."""
    for label, get, is_bytes in FIGURES:
        old, new = get(recorded), get(fresh)
        if old != new:
            return _describe(label, old, new, is_bytes)
    for old_phase, new_phase in zip(recorded.phases, fresh.phases, strict=True):
        for label, get in PHASE_FIGURES:
            old, new = get(old_phase), get(new_phase)
            if old != new:
                is_bytes = label.endswith("_bytes")
                return _describe(f"phase {old_phase.name} {label}", old, new, is_bytes)
    if recorded.compile != fresh.compile:
        return "the recorded compile request differs"
    return None


def _describe(label: str, old: Any, new: Any, is_bytes: bool) -> str:
    if is_bytes and isinstance(old, int) and isinstance(new, int):
        delta = new - old
        sign = "+" if delta >= 0 else "-"
        return f"{label} {old:,} bytes in the plan, {new:,} re-compiled ({sign}{human(abs(delta))})"
    if isinstance(old, int) and isinstance(new, int):
        return f"{label} {old:,} in the plan, {new:,} re-compiled"
    if isinstance(old, str) and isinstance(new, str):
        return f"{label} {_short(old)} in the plan, {_short(new)} re-compiled"
    if isinstance(old, list) and isinstance(new, list):
        for k, (a, b) in enumerate(zip(old, new, strict=False)):
            if a != b:
                return f"{label}[{k}] differs from the re-compile"
        return f"{label}: {len(old):,} in the plan, {len(new):,} re-compiled"
    scalar = (type(None), bool, int, float, str)
    if isinstance(old, scalar) and isinstance(new, scalar):
        return f"{label} {old!r} in the plan, {new!r} re-compiled"
    return f"{label} differs from the re-compile"


def causes(recorded: Plan, fresh: Plan) -> list[str]:
    """What changed on the input side: the model config, the tool versions."""
    found = []
    if recorded.model.config_sha256 != fresh.model.config_sha256:
        found.append("the model's config.json changed")
    old, new = recorded.generator, fresh.generator
    for name in ("dctms", "mlx", "mlx_lm"):
        if getattr(old, name) != getattr(new, name):
            found.append(f"{name} {getattr(old, name)} -> {getattr(new, name)}")
    return found


def _short(text: str) -> str:
    return text[:12] + "…" if len(text) == 64 else text
