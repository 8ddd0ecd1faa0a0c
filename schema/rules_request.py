"""Verifier rule about ``Plan.compile``: the recorded request agrees with what the plan says it is.

``dctms check`` re-compiles a plan from its request, so a request that disagrees with the plan's
bounds, target or model fingerprint (an edit, or a compiler bug) would re-compile to a different
plan than the one recorded; it is refused here instead, naming the field.
"""

from __future__ import annotations

from collections.abc import Iterator

from dctms.schema.fingerprint import canonical_config_sha256
from dctms.schema.phase_index import PlanIndex
from dctms.schema.sizes import recorded_run_ahead

Finding = tuple[str, str]


def compile_request(ix: PlanIndex) -> Iterator[Finding]:
    """The request's config hashes to ``model.config_sha256``; every option it names is the value
    the plan records (``bounds``, ``target``); a request without ``hash_weights`` has no file hashes."""
    plan = ix.plan
    req = plan.compile
    if req is None:
        return
    if canonical_config_sha256(req.config) != plan.model.config_sha256:
        yield (
            "$.compile.config",
            "does not hash to model.config_sha256 (the config or the hash was edited)",
        )
    if req.config.get("model_type") != plan.model.architecture:
        yield (
            "$.compile.config.model_type",
            f"is {req.config.get('model_type')!r}, model.architecture is "
            f"{plan.model.architecture!r}",
        )
    b, t = plan.bounds, plan.target
    given = {
        # request field: (value the plan records, where)
        "input_tokens": (b.input_tokens, "bounds.input_tokens"),
        "output_tokens": (b.output_tokens, "bounds.output_tokens"),
        "batch": (b.batch, "bounds.batch"),
        "prefill_chunk": (b.prefill_chunk, "bounds.prefill_chunk"),
        "dtype": (b.dtype, "bounds.dtype"),
        "backend": (t.backend, "target.backend"),
        "alignment": (t.alignment, "target.alignment"),
        "profile": (t.profile.name, "target.profile.name"),
    }
    for name, (recorded, where) in given.items():
        value = getattr(req, name)
        if value is not None and value != recorded:
            yield f"$.compile.{name}", f"is {value!r}, but {where} is {recorded!r}"
    asked = (req.kv_bits, req.kv_group_size if req.kv_bits is not None else None)
    if asked != (b.kv.bits, b.kv.group_size):
        yield (
            "$.compile.kv_bits",
            f"asks for kv bits/group size {asked}, but bounds.kv records "
            f"{(b.kv.bits, b.kv.group_size)}",
        )
    # (0: a plan that assumes no run-ahead, as a hand-written one does, records no mode to compare)
    budget = recorded_run_ahead(t.backend, req.run_ahead, t.memory_model)
    if t.run_ahead_dispatches not in (0, budget):
        yield (
            "$.compile.run_ahead",
            f"is {req.run_ahead!r} ({budget} dispatches on the {t.backend} backend), but "
            f"target.run_ahead_dispatches is {t.run_ahead_dispatches}",
        )
    if req.device_memory != t.device_memory:
        yield (
            "$.compile.device_memory",
            f"is {req.device_memory!r}, but target.device_memory is {t.device_memory!r}",
        )
    if not req.hash_weights and plan.model.weights.files_sha256 is not None:
        yield (
            "$.compile.hash_weights",
            "is false, but model.weights.files_sha256 records file hashes",
        )
