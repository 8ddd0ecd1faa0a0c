"""The streams of a vision-language plan in the views: the memory split by stream
(``figures.streams``, drawn on the TUI's Memory screen) and ``dctms dot --view streams``.

Tiny random gemma3 (fixed-resolution tower) and qwen2_vl (dynamic: one vision phase per size)
folders from ``toolkit.vision.tiny``, compiled serially and with ``--overlap`` (N=96, 2 images,
prefill chunks of 16: six prefill calls).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from conftest import make_tiny_plan

from dctms.cli.main import main
from dctms.figures.streams import call_bytes, prefill_calls, stream_steps, sync_edges
from dctms.schema.io import read_plan, write_plan
from dctms.schema.vision_bytes import vision_phases

N, M, K, CHUNK = 96, 6, 2, 16
BOUNDS = {"gemma3": (32, 32), "qwen2_vl": (56, 84)}


@pytest.fixture(scope="module", params=[(f, o) for f in sorted(BOUNDS) for o in (False, True)],
                ids=lambda p: f"{p[0]}-{'overlap' if p[1] else 'serial'}")
def plan_path(request, tmp_path_factory) -> Path:
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions
    from dctms.toolkit.vision.compiler import VisionOptions, compile_vlm_plan
    from dctms.toolkit.vision.tiny import write_tiny_vlm

    family, overlap = request.param
    folder = write_tiny_vlm(tmp_path_factory.mktemp(family) / "model", family)
    plan = compile_vlm_plan(
        open_model(folder),
        CompileOptions(N, M, prefill_chunk=CHUNK, pack_seconds=0.2),
        VisionOptions(K, *BOUNDS[family], overlap=overlap),
    )
    path = folder.parent / f"{family}.plan"
    write_plan(plan, path)
    return path


def test_the_split_curve_holds_each_streams_calls_and_sums_as_the_envelope(plan_path) -> None:
    plan = read_plan(plan_path)
    steps = stream_steps(plan)
    calls = call_bytes(plan)
    variants = vision_phases(plan)
    largest_vision = max(calls[v] for v in variants)
    # Every step holds exactly its phases' calls (arena + slack + a vision call's inputs).
    for s in steps:
        assert s.vision_bytes == (calls[s.vision_phase] if s.vision_phase else 0)
        assert s.text_bytes == (calls[s.text_phase] if s.text_phase else 0)
        assert s.vision_phase is None or s.vision_phase in variants
        assert s.text_phase in (None, "prefill", "decode")
    # Per-stream maxima: the largest vision call and the largest text call (prefill here).
    assert max(s.vision_bytes for s in steps) == largest_vision
    assert max(s.text_bytes for s in steps) == calls["prefill"] > calls["decode"]
    # K images, six prefill calls, one decode row; overlapped, two steps hold both streams.
    assert sum(s.vision_phase is not None for s in steps) == K
    both = [s for s in steps if s.vision_bytes and s.text_bytes]
    assert prefill_calls(plan) == N // CHUNK == 6
    assert len(steps) == K + 6 + 1 - len(both)
    top = max(s.total for s in steps)
    assert top == plan.envelope.intermediate
    if plan.vision.overlap:
        assert len(both) == K and top == largest_vision + calls["prefill"]
    else:
        assert both == [] and top == max(largest_vision, calls["prefill"])


def test_a_text_plan_has_no_streams() -> None:
    plan = make_tiny_plan()
    assert stream_steps(plan) == [] and sync_edges(plan) == []


def test_the_sync_points_are_the_runners(plan_path) -> None:
    """The prefill call each image's sync edge names is the one the runner waits in, for a
    prompt whose image k is first read by prefill call k + 1."""
    from dctms.runner.vision_session import _first_chunks

    plan = read_plan(plan_path)
    v = plan.vision
    prompt, rows = [1] * N, [0] * N
    for k in range(K):
        start = (k + 1) * CHUNK
        for i in range(v.tokens_per_image):
            prompt[start + i], rows[start + i] = v.image_token_id, k * v.tokens_per_image + i
    edges = sync_edges(plan)
    assert [e.image for e in edges] == list(range(K))
    if v.overlap:
        assert [e.call for e in edges] == _first_chunks(prompt, rows, plan, K) == [1, 2]
    else:
        assert [e.call for e in edges] == [0, 0]  # every image before prefill starts


def _dot(plan_path: Path, tmp_path: Path) -> str:
    out = tmp_path / "streams.dot"
    assert main(["dot", str(plan_path), "--view", "streams", "-o", str(out)]) == 0
    return out.read_text()


def test_dot_draws_a_cluster_per_stream_and_the_sync_edges(plan_path, tmp_path) -> None:
    plan = read_plan(plan_path)
    source = _dot(plan_path, tmp_path)
    clusters = dict(re.findall(r"subgraph cluster_stream_(\w+) \{(.*?)\n\t\}", source, re.S))
    assert sorted(clusters) == ["text", "vision"]
    stream = 1 if plan.vision.overlap else 0
    assert f"vision stream (MLX stream {stream})" in clusters["vision"]
    for phase in vision_phases(plan):
        assert re.search(rf'"?phase_{re.escape(phase)}"? \[', clusters["vision"])
        assert f"phase_{phase}" not in clusters["text"]
    assert "phase_prefill -> phase_decode" in clusters["text"]
    assert f"{call_bytes(plan)['prefill']:,} B per call" in clusters["text"]
    syncs = re.findall(r'(\S+) -> phase_prefill \[label="sync: prefill call (\d+) waits for '
                       r'image (\d+)"', source)
    calls = ["1", "2"] if plan.vision.overlap else ["0", "0"]
    assert [(c, i) for _, c, i in syncs] == list(zip(calls, ["0", "1"], strict=True))
    assert f"M_intermediate {plan.envelope.intermediate:,} B" in source


def test_dot_streams_refuses_a_text_plan(tmp_path, capsys) -> None:
    plan = tmp_path / "tiny.plan"
    write_plan(make_tiny_plan(), plan)
    out = tmp_path / "s.dot"
    assert main(["dot", str(plan), "--view", "streams", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "vision-language plan" in err
    assert not out.exists()


def _memory_screen(plan) -> str:
    from test_tui_app import make_app, screen_text

    app = make_app(plan)
    shown = []

    async def run() -> None:
        async with app.run_test(size=(140, 48)) as pilot:
            await pilot.pause()
            app.switch_mode("memory")
            await pilot.pause()
            shown.append(screen_text(app))
            shown.append(str(len(app.screen.query("#streams"))))

    asyncio.run(run())
    return "\n".join(shown)


def test_the_memory_screen_splits_the_curve_by_stream(plan_path) -> None:
    from dctms.tui.widgets.stream_bars import BAR_WIDTH, bar_cells, stream_lines

    plan = read_plan(plan_path)
    steps = stream_steps(plan)
    envelope = plan.envelope.intermediate
    # The bar reaching the envelope fills the width; a step's streams keep their proportions.
    top = max(steps, key=lambda s: s.total)
    assert sum(bar_cells(top, envelope)) == BAR_WIDTH
    for s in steps:
        vision, text = bar_cells(s, envelope)
        assert (vision > 0) == (s.vision_bytes > 0) and (text > 0) == (s.text_bytes > 0)
        assert abs(vision - s.vision_bytes / envelope * BAR_WIDTH) <= 1
    assert len(stream_lines(steps, envelope, plan.vision.overlap)) == len(steps) + 1
    shown = _memory_screen(plan)
    assert f"M_intermediate {envelope:,} B" in shown
    for s in steps:
        line = next(line for line in shown.splitlines() if line.strip().startswith(s.label + " "))
        assert f"{s.total:,} B" in line
        assert (s.sync in line) if s.sync else "waits" not in line


def test_the_memory_screen_of_a_text_plan_has_no_stream_bars() -> None:
    shown = _memory_screen(make_tiny_plan())
    assert shown.endswith("\n0") and "M_intermediate" not in shown
