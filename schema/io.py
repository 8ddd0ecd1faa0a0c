"""Canonical reading and writing of plan files.

Writing: ``encode_plan`` gives deterministic UTF-8 JSON text (keys in struct field order, fields equal
to their default omitted, layout from ``layout``, trailing newline); ``write_plan`` writes it atomically.

Reading: ``decode_plan`` runs JSON parsing, the ``schema_version`` check (before anything else can
complain), JSON Schema validation (every error), msgspec decoding and the semantic verifier, and
raises ``PlanError`` listing every problem -- never anything else, whatever the bytes. ``read_plan``
adds file-level checks. The verifier's run-only rules (``verify.RUN_ONLY``: index safety, seconds on
a 7B plan) run only with ``for_run=True``, as ``dctms validate`` and the runner's
``load_checked_plan`` read: a plan is shown, diffed or pooled without them, never run without them.

Non-finite floats inside ``Constant.value`` and ``Op.args``: the codec of ``values`` is applied here
once on encode (``to_json_value``) and once on decode (``from_json_value``); nothing else converts
them. Non-finite floats anywhere else cannot be written.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from dctms.schema.digest import body_sha256, duplicate_key, stamp
from dctms.schema.errors import PlanError, Problem
from dctms.schema.output import write_output
from dctms.schema.paths import json_path
from dctms.schema.schema_check import schema_problems
from dctms.schema.types import Plan
from dctms.schema.values import from_json_value, to_json_value
from dctms.schema.verify import verify_plan
from dctms.schema.versions import version_problem

# A 7B plan is about 2 MB; refuse anything far larger before reading it into memory.
MAX_PLAN_FILE_BYTES = 256 * 2**20

# ---------------------------------------------------------------------------------------------- write


def encode_plan(plan: Plan) -> bytes:
    """The canonical bytes of ``plan``, stamped with its digest (``schema.digest``; whatever
    ``plan.digest`` held is replaced): the same plan always gives the same bytes."""
    document = _document(plan)
    bad = _non_finite_path(document, [])
    if bad is not None:
        raise PlanError("<encode>", [Problem(bad, "non-finite float cannot be written", "finite")])
    return stamp(document)


def _document(plan: Plan) -> dict[str, Any]:
    """``plan`` as JSON values, keys in struct field order, non-finite floats spelled out."""
    # "deterministic" sorts plain dict keys (files_sha256, dicts in args) but keeps struct field order.
    document = msgspec.to_builtins(plan, order="deterministic")
    for phase in document["phases"]:
        for op in phase["ops"]:
            if "args" in op:
                op["args"] = to_json_value(op["args"])
        for constant in phase["constants"]:
            constant["value"] = to_json_value(constant["value"])
    return document


def _non_finite_path(value: Any, parts: list[str | int]) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return json_path(parts)
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        found = _non_finite_path(item, parts + [key])
        if found is not None:
            return found
    return None


def write_plan(
    plan: Plan, path: str | os.PathLike[str], *, inputs: Iterable[str | os.PathLike[str]] = ()
) -> None:
    """Write ``plan`` canonically to ``path``, atomically (``schema.output``): readers see the old
    file or the new one; never onto one of ``inputs``, a directory or a device.

    The plan is not verified here (the compiler verifies before writing; a broken plan can be written
    for inspection). Raises ``DctmsError`` when the file cannot be written.
    """
    write_output(path, encode_plan(plan), inputs=inputs)


# ----------------------------------------------------------------------------------------------- read


def read_plan(path: str | os.PathLike[str], *, for_run: bool = False) -> Plan:
    """Read and check the plan file at ``path`` (every verifier rule; the run-only ones, which a
    plan about to run needs, with ``for_run``); ``PlanError`` (one clear line) on any problem."""
    source = str(path)
    target = Path(path)

    def fail(message: str) -> PlanError:
        return PlanError(source, [Problem("$", message, "file")])

    try:
        info = target.stat()
        if target.is_dir():
            raise fail("is a directory, not a plan file")
        if not target.is_file():
            raise fail("is not a regular file")
        if info.st_size > MAX_PLAN_FILE_BYTES:
            raise fail(f"file is too large for a plan ({info.st_size} bytes)")
        data = target.read_bytes()
    except FileNotFoundError:
        raise fail("no such file") from None
    except PermissionError:
        raise fail("permission denied") from None
    except OSError as err:
        raise fail(f"cannot read: {err.strerror or err}") from None
    if not data.strip():
        raise fail("file is empty" if not data else "file contains only whitespace")
    return decode_plan(data, source, for_run=for_run)


def decode_plan(data: bytes, source: str = "<plan>", *, for_run: bool = False) -> Plan:
    """Parse, validate and verify plan bytes (the run-only rules with ``for_run``); raises
    ``PlanError`` with every problem found."""
    try:
        plan, problems = _decode(data, for_run)
    except RecursionError:
        problems = [Problem("$", "nested too deeply", "json")]
    except Exception as err:  # noqa: BLE001 - the contract is PlanError for any input whatsoever
        problems = [Problem("$", f"cannot decode ({type(err).__name__}: {err})", "json")]
    if problems:
        raise PlanError(source, problems)
    return plan


def _decode(data: bytes, for_run: bool) -> tuple[Plan | None, list[Problem]]:
    if isinstance(data, str):
        data = data.encode("utf-8")
    if not bytes(data).strip():
        return None, [Problem("$", "empty input (no JSON document)", "json")]
    # Fast path: msgspec's typed decode enforces the same types and bounds as plan.schema.json
    # (generated from them; tests/test_schema_fuzz.py checks that msgspec never accepts what the
    # schema rejects) in ~1% of the time jsonschema takes on a 7B plan. JSON Schema validation runs
    # when msgspec refuses the document, to list every error rather than the first.
    try:
        plan = msgspec.json.decode(data, type=Plan)
    except (msgspec.DecodeError, msgspec.ValidationError) as typed_error:
        return None, _explain(data, typed_error)
    version = version_problem({"schema_version": plan.schema_version})
    if version is not None:
        return None, [version]
    plan = _restore_non_finite(plan)
    key = hashlib.sha256(data).digest()
    if key in _VERIFIED and _VERIFIED[key] >= for_run:  # passed every check in this process
        _VERIFIED.move_to_end(key)
        return plan, []
    problems = verify_plan(plan, for_run=for_run)
    if not problems:  # an invalid plan is refused anyway: these would add nothing
        problems = _integrity_problems(plan, bytes(data))
    if not problems:
        _VERIFIED[key] = for_run or _VERIFIED.get(key, False)
        while len(_VERIFIED) > _VERIFIED_KEPT:
            _VERIFIED.popitem(last=False)
    return plan, problems


# The SHA-256 of plan bytes that passed every check in this process (True: the run-only rules too).
# The checks are a pure function of the bytes, so the same bytes read again (a server reloading
# its plans, the inspector reopening one, a notebook calling the API) are not verified again.
_VERIFIED: OrderedDict[bytes, bool] = OrderedDict()
_VERIFIED_KEPT = 256


def _integrity_problems(plan: Plan, data: bytes) -> list[Problem]:
    """The digest (``schema.digest``) and, in a file not in canonical form, duplicate keys (JSON
    readers keep the last of two equal keys: an edit could hide behind the first)."""
    document = _document(plan)
    actual = body_sha256(document)
    if data.strip() != stamp(document).strip():
        duplicate = duplicate_key(data)
        if duplicate is not None:
            return [Problem("$", duplicate, "json")]
    if not plan.digest:
        return [
            Problem(
                "$.digest",
                "the plan has no digest (it was not written by dctms): recompile it",
                "digest",
            )
        ]
    if plan.digest != actual:
        return [
            Problem(
                "$.digest",
                f"the plan was changed after it was written (digest {plan.digest[:12]}, "
                f"content {actual[:12]}): recompile it (dctms check re-checks a plan against "
                "its model)",
                "digest",
            )
        ]
    return []


def _explain(data: bytes, typed_error: Exception) -> list[Problem]:
    """Every problem of a document msgspec refused: JSON syntax, version, then all schema errors."""
    try:
        document = msgspec.json.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        return [Problem("$", f"not valid JSON: {err}", "json")]
    if not isinstance(document, dict):
        return [Problem("$", "expected a JSON object (a dctms plan)", "schema")]
    version = version_problem(document)
    if version is not None:
        return [version]
    # JSON Schema and msgspec agree except in corners (2.0 is an integer to JSON Schema only).
    return schema_problems(document) or [_msgspec_problem(typed_error)]


_AT = re.compile(r"^(?P<message>.*) - at `(?P<path>\$[^`]*)`$", re.DOTALL)


def _msgspec_problem(err: Exception) -> Problem:
    text = str(err)
    match = _AT.match(text)
    if match is None:
        return Problem("$", text, "schema")
    message = match["message"]
    return Problem(match["path"], message[:1].lower() + message[1:], "schema")


def _restore_non_finite(plan: Plan) -> Plan:
    phases = []
    for phase in plan.phases:
        ops = [
            msgspec.structs.replace(op, args=from_json_value(op.args)) if op.args else op
            for op in phase.ops
        ]
        constants = [
            msgspec.structs.replace(c, value=from_json_value(c.value)) for c in phase.constants
        ]
        phases.append(msgspec.structs.replace(phase, ops=ops, constants=constants))
    return msgspec.structs.replace(plan, phases=phases)
