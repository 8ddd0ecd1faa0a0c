"""dctms: Deterministic Compile-Time Memory Scheduling for MLX inference.

Subpackages: ``dctms.schema`` (plan file contract), ``dctms.toolkit`` (compiler and views),
``dctms.runner`` (executes plans), ``dctms.tui`` (inspector).
"""

__version__ = "0.1.0"
