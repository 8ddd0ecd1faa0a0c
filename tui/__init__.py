"""dctms.tui: ``dctms-tui``, the terminal inspector of plan files (Textual).

- ``app``: command line, the App (one Textual mode per screen), start-up measurement.
- ``data`` / ``diff``: figures computed from a ``Plan`` without Textual (memory curve, lifetime rows,
  buffer reuse, arena placements, schedule rows, plan-to-plan deltas), unit-tested on their own.
- ``state``: the inspected plan(s) shared by every screen.
- ``screens``: Overview, Memory, Lifetimes, Buffers, Schedule, Ops, Diff, help.
- ``widgets``: Line-API charts over slots (Gantt, memory curve, arena map), envelope bar, bars, tables.
"""
