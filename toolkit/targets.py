"""``compile --target cpu | metal[-PROFILE] | cuda[-PROFILE]``: which memory model plans the graph.

``cpu`` is today's model (``toolkit.memory_model``, MLX's CPU backend). ``metal`` and ``cuda`` are
MLX's GPU allocators as ``schema.targets`` models them from MLX's source: the graph is traced on
the CPU on any machine (cross-compilation, so Linux CI can diff a Mac's envelope), then planned with
the target's rounding, cache reuse and command-buffer lifetimes. PROFILE names a roofline profile
(``toolkit.profiles``; on Metal it also fixes the GPU class and so the ops per command buffer).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from dctms.schema.errors import DctmsError
from dctms.schema.targets import (
    DEFAULT_TARGET_PROFILE,
    GPU_TARGETS,
    TARGETS,
    allocator_slack,
    derive,
    overhead,
)
from dctms.schema.types import MemoryModel, StateTensor, TargetProfile, Weights
from dctms.toolkit.profiles import get_profile

# The persistent block holding what a GPU allocator's rounding adds to the weights and KV arrays
# (the verifier's persistent_state re-derives it: schema.rules_derived.rounding_bytes).
ROUNDING_BLOCK = "allocator.rounding"


@dataclass(frozen=True)
class ResolvedTarget:
    name: str  # cpu | metal | cuda
    profile: TargetProfile
    model: MemoryModel | None  # None for cpu


def parse_target(text: str) -> tuple[str, str | None]:
    """``NAME[-PROFILE]`` -> (name, profile or None); refuses an unknown name in one line."""
    name, _, profile = text.partition("-")
    if name not in TARGETS or (name == "cpu" and profile):
        raise DctmsError(
            f"--target {text!r}: expected cpu, metal[-PROFILE] or cuda[-PROFILE] "
            "(PROFILE: a roofline profile, see --profile)"
        )
    return name, profile or None


def resolve_target(opts) -> ResolvedTarget:
    """The target ``opts.target`` names, checked against ``--backend`` and ``--profile``."""
    name, suffix = parse_target(opts.target)
    if opts.profile is not None and suffix is not None and opts.profile != suffix:
        raise DctmsError(f"--target {opts.target} and --profile {opts.profile} name two profiles")
    if name == "cpu":
        if opts.backend not in (None, "cpu"):
            raise DctmsError(f"--target cpu with --backend {opts.backend}: pick one")
        return ResolvedTarget("cpu", get_profile(opts.profile or "cpu-x86-2core"), None)
    if opts.backend == "cpu":
        raise DctmsError(f"--target {opts.target} plans for the gpu, not --backend cpu")
    for given, flag in (
        (opts.ranks != 1 or opts.parallel is not None, "--ranks/--parallel"),
        (opts.sampling, "--sampling"),
    ):
        if given:
            raise DctmsError(f"--target {name} is not supported with {flag} yet")
    profile = get_profile(suffix or opts.profile or DEFAULT_TARGET_PROFILE[name])
    return ResolvedTarget(name, profile, derive(name, profile.name))


def target_slack(model: MemoryModel) -> int:
    return allocator_slack(model)


def rounding_block(model: MemoryModel, weights: Weights | None, kv: list[StateTensor]) -> int:
    """Bytes the allocator's rounding and reuse add to every weight and KV array (one buffer each)."""
    arrays = [w.bytes for w in weights.tensors] if weights is not None else []
    arrays += [s.bytes for s in kv]
    return sum(overhead(model, b) for b in arrays)


def native_backend(name: str) -> bool:
    """Whether this machine's MLX has the GPU backend target ``name`` runs on."""
    if name == "metal":
        return mx.metal.is_available()
    if name == "cuda":
        return bool(getattr(mx, "cuda", None)) and mx.cuda.is_available()
    return True


def compile_note(name: str) -> str | None:
    """What ``dctms compile`` says of a GPU target: modelled, and whether it runs here."""
    if name not in GPU_TARGETS:
        return None
    where = "" if native_backend(name) else f"; this machine's MLX has no {name}: compiled only"
    return (
        f"target {name}: traced on the CPU, memory modelled from MLX's {name} allocator source "
        f"(not measured){where}"
    )
