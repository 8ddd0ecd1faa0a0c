"""Converters that import other formats' models into mlx-lm model folders (``dctms convert-gguf``).

An import tool, not a compiler pass: nothing here imports the compiler (``dctms.toolkit``).
"""
