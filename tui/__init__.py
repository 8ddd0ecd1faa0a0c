"""dctms.tui: ``dctms-tui``, the terminal inspector of plan files (Textual).

- ``app``: command line, the App (one Textual mode per screen), start-up measurement.
- ``data``: view models over a ``Plan`` without Textual (lookups, lifetime rows, buffer reuse, arena
  placements, schedule and op rows), unit-tested on their own. The figures the CLI prints too
  (overview, memory curve, plan-to-plan deltas) come from ``dctms.figures``; no compiler module is
  imported.
- ``state``: the inspection (plan or plans) shared by every screen.
- ``screens``: Overview, Memory, Lifetimes, Buffers, Schedule, Ops, Diff, help.
- ``widgets``: Line-API charts over slots (Gantt, memory curve, arena map), envelope bar, bars, tables.
"""
