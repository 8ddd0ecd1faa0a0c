"""Vision-language plans (gemma3, a fixed-resolution SigLIP tower): compile, run, match mlx-vlm.

A tiny random gemma3 folder is written by ``toolkit.vision_tiny`` (mlx-vlm's own model class, a
byte tokenizer with the image tokens, transformers' Gemma3 image processor). Images are PNG/JPEG
files of several sizes made here; gemma3's processor resizes each to the tower's 32x32. The ids are
compared with mlx-vlm's own greedy ``generate_step`` on mlx-vlm's own processor's inputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dctms.cli.main import main
from dctms.schema.io import read_plan, write_plan
from dctms.schema.verify import verify_plan

N, M, K, SIDE = 40, 6, 2, 32
PROMPT = "<start_of_image>look<start_of_image>tell"


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> tuple[Path, Path]:
    """(plan, folder): a tiny gemma3 compiled for K=2 images of 32x32, N=40, M=6."""
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions
    from dctms.toolkit.vision_compile import VisionOptions, compile_vlm_plan
    from dctms.toolkit.vision_tiny import write_tiny_vlm

    folder = write_tiny_vlm(tmp_path_factory.mktemp("gemma3") / "model", "gemma3")
    plan = compile_vlm_plan(
        open_model(folder), CompileOptions(N, M, pack_seconds=0.2), VisionOptions(K, SIDE, SIDE)
    )
    path = folder.parent / "gemma3.plan"
    write_plan(plan, path)
    return path, folder


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[Path]:
    """Random RGB images of several sizes (all resized to 32x32 by gemma3's processor)."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(7)
    out = []
    pixels = [
        (rng.random((40, 50, 3)) * 255).astype(np.uint8),  # noise
        np.zeros((20, 30, 3), np.uint8),  # black
        np.full((32, 32, 3), 255, np.uint8),  # white
    ]
    for k, (array, fmt) in enumerate(zip(pixels, ["PNG", "JPEG", "PNG"], strict=True)):
        path = folder / f"img{k}.{fmt.lower()}"
        Image.fromarray(array).save(path, fmt)
        out.append(path)
    return out


def test_the_plan_has_three_streams_and_one_envelope(gemma3) -> None:
    plan = read_plan(gemma3[0])
    assert verify_plan(plan) == []
    v = plan.vision
    assert (v.family, v.resolution, v.images, v.image_size) == ("gemma3", "fixed", K, [SIDE, SIDE])
    assert v.feature_rows == K * v.tokens_per_image == K * 4
    assert [s.name for s in v.streams] == ["vision", "text", "output"]
    phases = {p.name: p for p in plan.phases}
    assert set(phases) == {"vision", "prefill", "decode"}
    # Only the projected features leave the vision phase: one output, the table.
    vision = phases["vision"]
    assert [(b.name, b.shape) for b in vision.outputs] == [
        ("image_features", [v.feature_rows, v.hidden_size])
    ]
    assert {b.name for b in vision.inputs if b.kind == "input"} == {
        "pixel_values", "image_features", "row"
    }
    assert [b.shape for b in vision.inputs if b.name == "pixel_values"] == [[1, 3, SIDE, SIDE]]
    prefill_inputs = {b.name for b in phases["prefill"].inputs if b.kind == "input"}
    assert {"image_features", "image_rows"} <= prefill_inputs
    # The vision tower's convolution is planned with its temporaries (unfolded patches).
    conv = [op for op in vision.ops if op.primitive == "Convolution"]
    assert len(conv) == 1 and conv[0].scratch >= 4 * (SIDE * SIDE * 3) * 2
    env = plan.envelope
    assert env.intermediate == max(p.arena_bytes + p.slack_bytes for p in plan.phases)
    assert env.total == env.weights + env.kv + env.persistent + env.intermediate + env.runtime


def test_compiling_twice_gives_identical_bytes(gemma3, tmp_path) -> None:
    rc = main(["compile", str(gemma3[1]), "-N", str(N), "-M", str(M), "--images", str(K),
               "--image-size", f"{SIDE}x{SIDE}", "--pack-seconds", "0.2", "-q",
               "-o", str(tmp_path / "again.plan")])
    assert rc == 0
    assert (tmp_path / "again.plan").read_bytes() == gemma3[0].read_bytes()


def _mlx_vlm_ids(folder: Path, prompt: str, paths: list[Path], tokens: int) -> tuple[list, list]:
    """mlx-vlm's own processor and greedy generation: (prompt ids, generated ids)."""
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import load_model, load_processor
    from PIL import Image

    model = load_model(folder)
    processor = load_processor(folder, add_detokenizer=False)
    assert type(processor).__module__.startswith("mlx_vlm.")  # its own processor ran
    pil = [Image.open(p).convert("RGB") for p in paths]
    inputs = processor(text=[prompt], images=pil or None, return_tensors="mlx")
    pixels = inputs.get("pixel_values") if pil else None
    steps = generate_step(
        inputs["input_ids"], model, pixels, inputs.get("attention_mask"), max_tokens=tokens,
        temperature=0.0,
    )
    out = [int(t) for (t, _), _ in zip(steps, range(tokens), strict=False)]
    return inputs["input_ids"][0].tolist(), out


def _ours(plan_path: Path, folder: Path, prompt: str, paths: list[Path], tokens: int):
    from dctms.runner.load import load_checked_plan
    from dctms.runner.request import validate_request
    from dctms.runner.tokenize import Tokenizer
    from dctms.runner.vision_input import prepare, read_images
    from dctms.runner.vision_session import VisionSession
    from dctms.schema.model_folder import open_model_folder

    plan = load_checked_plan(plan_path)
    pil = read_images([str(p) for p in paths], plan)
    inputs = prepare(plan, folder, Tokenizer(folder), prompt, pil)
    request = validate_request(plan, inputs.prompt, tokens, set())
    session = VisionSession(plan, open_model_folder(folder))
    gen = session.generate_vision(request, inputs.pixels, inputs.image_rows)
    return plan, inputs, gen.tokens, mx.get_peak_memory()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prompt", "which"),
    [(PROMPT, [0, 1]), ("<start_of_image>what is it", [2]), ("describe", [1]),
     ("just text", [])],
    ids=["two-images", "one-image", "unmarked-image", "text-only"],
)
def test_ids_equal_mlx_vlm_within_the_envelope(gemma3, images, prompt, which) -> None:
    plan_path, folder = gemma3
    paths = [images[i] for i in which]
    plan, inputs, ours, peak = _ours(plan_path, folder, prompt, paths, M)
    marked = prompt if prompt.count("<start_of_image>") == len(paths) else (
        "<start_of_image>" * len(paths) + prompt
    )
    their_prompt, theirs = _mlx_vlm_ids(folder, marked, paths, M)
    assert list(inputs.prompt) == their_prompt
    assert ours == theirs
    provable = plan.envelope.provable
    assert peak <= provable
    assert provable / peak <= 1.05


@pytest.mark.slow
def test_the_image_changes_the_ids(gemma3, images) -> None:
    plan_path, folder = gemma3
    noise = _ours(plan_path, folder, "<start_of_image>x", [images[0]], M)[2]
    black = _ours(plan_path, folder, "<start_of_image>x", [images[1]], M)[2]
    assert noise != black


def _run(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["run", *argv])
    return rc, capsys.readouterr().err.strip()


def _no_session(monkeypatch) -> None:
    """Fail the test if a refusal came only after the session allocated anything."""
    from dctms.runner import vision_session

    def refuse(*_a, **_k):
        raise AssertionError("the session was opened before the request was refused")

    monkeypatch.setattr(vision_session.VisionSession, "__init__", refuse)


def test_more_images_than_k_are_refused_before_allocating(gemma3, images, capsys,
                                                            monkeypatch) -> None:
    _no_session(monkeypatch)
    plan, folder = gemma3
    args = [str(plan), "--model", str(folder), "--prompt", "x"]
    for p in images:
        args += ["--image", str(p)]
    rc, err = _run(capsys, *args)
    assert rc == 2 and len(err.splitlines()) == 1
    assert "3 images" in err and "at most 2" in err and "--images 3" in err


def test_a_prompt_over_n_is_refused_before_allocating(gemma3, images, capsys, monkeypatch) -> None:
    _no_session(monkeypatch)
    plan, folder = gemma3
    rc, err = _run(capsys, str(plan), "--model", str(folder), "--prompt", "y" * 60,
                   "--image", str(images[0]))
    assert rc == 2 and len(err.splitlines()) == 1
    assert f"N = {N}" in err and "-N" in err


def test_an_image_over_the_bound_is_refused(gemma3, images, capsys, monkeypatch) -> None:
    """A processor that yields a larger image than the plan's bound (a changed preprocessor
    config) is refused with the size and how to recompile."""
    _no_session(monkeypatch)
    plan, folder = gemma3
    cfg = json.loads((folder / "preprocessor_config.json").read_text())
    changed = folder.parent / "bigger"
    import shutil

    shutil.copytree(folder, changed)
    cfg["size"] = {"height": 48, "width": 48}
    (changed / "preprocessor_config.json").write_text(json.dumps(cfg))
    rc, err = _run(capsys, str(plan), "--model", str(changed), "--prompt", "x",
                   "--image", str(images[0]))
    assert rc == 2 and len(err.splitlines()) == 1
    assert "48x48" in err and "32x32" in err and "--image-size 48x48" in err


def test_bad_image_files_are_refused(gemma3, tmp_path, capsys) -> None:
    plan, folder = gemma3
    missing = tmp_path / "nope.png"
    rc, err = _run(capsys, str(plan), "--model", str(folder), "--prompt", "x",
                   "--image", str(missing))
    assert rc == 2 and "no such file" in err
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not an image")
    rc, err = _run(capsys, str(plan), "--model", str(folder), "--prompt", "x",
                   "--image", str(junk))
    assert rc == 2 and "not a readable image" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--images", "2", "--image-size", "64x64"], "use --image-size 32x32"),
        (["--images", "2"], "both --images K and --image-size"),
        (["--images", "0", "--image-size", "32x32"], "--images must be between"),
        (["--images", "2", "--image-size", "32by32"], "expected HEIGHTxWIDTH"),
        (["--images", "20", "--image-size", "32x32"], "raise -N or lower --images"),
    ],
)
def test_bad_vision_compile_options_are_one_line(gemma3, capsys, extra, needle) -> None:
    rc = main(["compile", str(gemma3[1]), "-N", str(N), "-M", str(M), "-q", *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and needle in err


def test_text_only_use_never_imports_mlx_vlm(tmp_path) -> None:
    """Compiling and running a text plan, and importing every text-path module, loads no mlx-vlm."""
    probe = f"""
import sys, json
from pathlib import Path
from conftest import TINY_QWEN2
from dctms.toolkit.tiny_model import write_tiny_model
from dctms.cli.main import main
folder = write_tiny_model(Path({str(tmp_path)!r}) / "m", dict(TINY_QWEN2))
assert main(["compile", str(folder), "-N", "8", "-M", "2", "-q", "-o", str(folder / "p.plan")]) == 0
assert main(["run", str(folder / "p.plan"), "--model", str(folder), "--tokens", "1,2,3"]) == 0
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "mlx_vlm")))
"""
    tests = Path(__file__).parent
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
        cwd=tests, env={**__import__("os").environ, "PYTHONPATH": str(tests)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
