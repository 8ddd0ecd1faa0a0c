"""Plan schema versions and the policy for changing them.

Policy: every struct in ``types`` forbids unknown fields, so a plan that carries a field this dctms does
not know cannot be read safely. Any change to the plan format (a field the compiler adds later, a field
removed or renamed, a changed meaning) is therefore a ``SCHEMA_VERSION`` step, together with a new
``$id`` in ``plan.schema.json`` (``plan-v<N>.json``). A reader refuses plans newer than it understands
with a one-line message that says what to do, refuses older ones (< ``OLDEST_SUPPORTED``) with a
line saying how to recompile them, and versions that never existed (< 1) as not a plan version.

History: 1, the first format. 2, tensor records are a tagged union on ``kind`` (always written) and a
scratch tensor names its op in ``op``; ``Target.backend`` and ``StateTensor.kind`` are closed sets.
3, ``Op.index`` is gone: an op's index is its position in ``Phase.ops`` (the verifier required them
equal, so the field only cost bytes: ~90 kB on a 7B plan). Also within 3: ``Op.layer`` is gone and
module paths came in its place (``Plan.modules``, a module tree, and ``Phase.modules``, run-length
coded module runs); an op's layer is the one its module path names (``schema.modules``).
4, ``Weights.fused``: a weight a phase binds may be several stored tensors end to end (fused
projections, ``schema.fused``). A version 3 plan also lacks the compiler's merged primitives and fused
projections, so it is refused with the line that says to recompile rather than run slower.
5, ``CompileRequest.run_ahead`` ("free": lifetimes widened by MLX's own bound on its host's run-ahead,
no throttle; "throttled": the runner's memory limit holds it to one partial task). A version 4 plan
also counts every elementwise output as a buffer of its own where MLX donates its input (the compiler
now plans donation), so it is refused with the line that says to recompile. Also within 5:
``CompileRequest.hub`` (the Hugging Face id and snapshot commit a plan was compiled from), absent
from plans compiled from a folder or a config, which are byte-identical to before.
6, batched plans (``bounds.batch`` B > 1) are B slots with ragged positions (``toolkit.slots``): the
prefill phase takes a ``slot`` input, the decode phase a ``positions`` vector and the length
``rows`` (``Lengths.names``); in version 5 a batch meant B sequences of one shared length. Also
new since 5: ``CompileRequest.hub`` and ``CompileRequest.sampling``, which were added within 5
without a step. Also new in 6: ``Bounds.prefix_blocks`` and the ``save_block`` / ``load_block``
phases (a prompt-prefix pool, ``toolkit.prefix_pool``), ``CompileRequest.prefix_blocks`` /
``prefix_cache``, ``Target.memory_model`` (a GPU target's memory model from MLX's source,
``schema.targets``) and ``CompileRequest.target``; each absent from plans that do not use it.
A version 5 plan is refused with the line that says to recompile.
Also within 6: ``CompileRequest.fused`` (compile --fused) and MLX's fused kernels as ops
(``RMSNorm``, ``RoPE``, ``ScaledDotProductAttention``, ``schema.fast_ops``) in GPU-target and
--fused plans. Not a step: a CPU plan without --fused is byte-identical to before; an older dctms
refuses to read a --fused plan (an unknown field), and its runner refuses a fused op (a primitive
it cannot re-create) in one line; an older verifier reads a GPU-target plan's fused ops as opaque
primitives of their recorded shapes, which they are (it lacks the rule ``fused_kernels``).
Also within 6: a batched plan's ``move_slot`` phase (``toolkit.slot_move``), with a sync point
after each row it reads. Not a step: a batch-1 plan is byte-identical to before; an older runner
leaves the phase unused (its sequences keep their slots) and this runner runs an older batched plan
without moves.
The version is checked before anything else, so a newer plan gets this message rather than a list of
"unknown field" errors.
"""

from __future__ import annotations

from dctms.schema.errors import Problem
from dctms.schema.types import SCHEMA_VERSION

OLDEST_SUPPORTED = 6  # the reader understands exactly this range
SCHEMA_ID = f"https://dctms.dev/schema/plan-v{SCHEMA_VERSION}.json"


def version_problem(document: object) -> Problem | None:
    """The problem with the ``schema_version`` of a parsed plan document, or None when it is readable.

    A missing or non-integer ``schema_version`` is left to schema validation, which names the field.
    """
    if not isinstance(document, dict):
        return None
    version = document.get("schema_version")
    if type(version) is not int:  # bool is an int subclass; JSON true is not a version
        return None
    if version > SCHEMA_VERSION:
        return Problem(
            "$",
            f"plan schema_version {version} is newer than this dctms understands ({SCHEMA_VERSION}); "
            "upgrade dctms (pip install -U dctms) or recompile the plan with this version",
            "schema_version",
        )
    if 1 <= version < OLDEST_SUPPORTED:
        return Problem(
            "$",
            f"plan schema_version {version} is older than this dctms ({SCHEMA_VERSION}): "
            "recompile it with `dctms compile`",
            "schema_version",
        )
    if version < 1:
        return Problem(
            "$",
            f"plan schema_version {version} is not a dctms plan version (this dctms reads "
            f"{OLDEST_SUPPORTED}..{SCHEMA_VERSION}); recompile the plan with `dctms compile`",
            "schema_version",
        )
    return None
