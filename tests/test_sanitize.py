"""Weights the model class's ``sanitize`` fills in (issue 35): a gemma3 vision-language folder
without ``language_model.lm_head.weight`` -- as real Gemma 3 checkpoints are; mlx-vlm's
``sanitize`` ties the head to the embedding -- compiles, binds the head to the stored embedding by
name, and runs to the same ids as the folder that stores the head (equal to the embedding)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from dctms.cli.main import main
from dctms.schema.io import read_plan

HEAD, EMBED = "language_model.lm_head.weight", "language_model.model.embed_tokens.weight"
COMPILE = ["-N", "40", "-M", "3", "--prefill-chunk", "16", "--images", "1", "--image-size",
           "32x32", "--pack-seconds", "0", "-q"]  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the folder with the head stored, the same without it, an image)."""
    from PIL import Image

    from dctms.toolkit.vision.tiny import write_tiny_vlm

    root = tmp_path_factory.mktemp("sanitize")
    stored = write_tiny_vlm(root / "stored", "gemma3")
    tied = write_tiny_vlm(root / "tied", "gemma3")
    weights = mx.load(str(tied / "model.safetensors"))
    assert mx.array_equal(weights.pop(HEAD), weights[EMBED])
    mx.save_safetensors(str(tied / "model.safetensors"), weights, metadata={"format": "mlx"})
    image = root / "image.png"
    Image.new("RGB", (32, 32), (30, 160, 90)).save(image)
    return stored, tied, image


def test_a_head_tied_by_sanitize_is_bound_to_the_embedding(folders, tmp_path) -> None:
    stored, tied, image = folders
    plans = {}
    for name, folder in (("stored", stored), ("tied", tied)):
        plans[name] = tmp_path / f"{name}.plan"
        assert main(["compile", str(folder), *COMPILE, "-o", str(plans[name])]) == 0
    plan = read_plan(plans["tied"])
    names = {w.name for w in plan.model.weights.tensors}
    assert HEAD not in names and EMBED in names
    bound = [b.name for p in plan.phases for b in p.inputs if b.kind == "weight"]
    assert HEAD not in bound and bound.count(EMBED) >= 1
    # The folder that stores the head keeps its own binding (nothing changes for it).
    assert HEAD in {w.name for w in read_plan(plans["stored"]).model.weights.tensors}
    ids = {}
    for name, folder in (("stored", stored), ("tied", tied)):
        proc = subprocess.run(
            [sys.executable, "-m", "dctms.cli.main", "run", str(plans[name]), "--model",
             str(folder), "--prompt", "<start_of_image>what is it", "--image", str(image)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        ids[name] = proc.stdout.strip()
    assert ids["tied"] == ids["stored"] and ids["tied"]
