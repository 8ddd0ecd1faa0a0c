"""dctms.schema: the plan file contract, depending on nothing else of ours.

- ``types``: the msgspec structs of a plan; ``plan.schema.json`` (from ``schema_gen``) says the same.
- ``io``: ``encode_plan`` / ``write_plan`` (canonical, atomic), ``decode_plan`` / ``read_plan`` (parse,
  version, schema, verify; ``PlanError`` for any bad input).
- ``values``: primitive arguments as plain values and the one non-finite float codec ``io`` applies.
- ``verify``: ``verify_plan(plan) -> list[Problem]``, the semantic rules (``rules_*`` modules).
- ``sizes``: dtype sizes, alignment, arena tenants, the lower bound -- conventions shared with the compiler.
- ``versions``: ``SCHEMA_VERSION`` policy. ``errors``: ``DctmsError``, ``PlanError``, ``Problem``.
"""
