"""Whether a plan runs in slots (``toolkit.slots``, ``runner.batch``).

A batched plan (``bounds.batch`` > 1) does, and so does a plan with a prompt-prefix pool
(``bounds.prefix_blocks`` > 0, ``toolkit.prefix_pool``), whose blocks are copied to and from a
sequence's slot: its prefill takes a ``slot`` input and its decode a ``positions`` vector even at
batch 1.
"""

from __future__ import annotations


def slotted(bounds) -> bool:
    """True for a plan whose phases take slots (see the module docstring)."""
    return bounds.batch > 1 or bounds.prefix_blocks > 0


# A batched plan's slot move (toolkit.slot_move): one slot's KV row copied into another.
MOVE_PHASE = "move_slot"
