"""dctms.figures: what a plan's numbers are, computed once, for every renderer (no Textual, no MLX).

The CLI's text, markdown and JSON renderers (``dctms.views``) and the inspector's widgets
(``dctms.tui``) both draw from these typed rows, so the two cannot disagree. Imports only
``dctms.schema``.

- ``units``: byte units (``MIB``), the one size formatter ``human``, ``parse_size``.
- ``overview``: header, bounds, the memory envelope, the paper's Table 1, arena vs lower bound.
- ``memory``: the live-bytes curve of a phase, its peak, and the tenants live at a slot.
- ``comparison``: what changed between two plans (envelope, Table 1, phases, bounds, model).
- ``pool``: several plans in one process: what is summed, what shared, the pool's envelope.
- ``op_costs``: FLOPs and bytes moved of one primitive (weights, KV, activations, scratch).
- ``roofline``: a plan on a target's roofline: per phase and op class, predicted decode tok/s, TTFT.
"""
