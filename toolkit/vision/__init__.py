"""The compiler for vision-language models: the text compiler's passes over three traced phases.

``families`` names the mlx-vlm families it accepts, ``trace`` traces their phases, ``compiler``
makes the plan and ``tiny`` writes tiny random models of each family for tests and benchmarks.
"""
