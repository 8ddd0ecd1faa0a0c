"""dctms.runner: executes a plan verbatim and proves its memory envelope every run.

Small and separate by design: it imports ``dctms.schema``, mlx, psutil and (for text) tokenizers,
never the compiler, the TUI or mlx-lm's model code. ``load`` refuses mismatches, ``session`` owns
the static state and the token loop, ``execute`` interprets a phase, ``primitives`` re-creates MLX
primitives one to one, ``sampling`` feeds a --sampling plan its settings, ``measure``/``report``
observe and report.
"""
