"""``dctms dot``: .dot text (no Graphviz needed), SVG/PNG through the ``dot`` program, bad input."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from dctms.cli import main as cli
from dctms.cli.commands.dot import parse_layers
from dctms.schema.errors import DctmsError
from dctms.schema.io import read_plan
from dctms.schema.modules import op_layers
from dctms.schema.sizes import is_arena_tenant
from dctms.views import dot as views

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "plans" / "qwen1.5b.plan"
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' not installed")
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def plan():
    return read_plan(PLAN)


@pytest.fixture(scope="module")
def decode(plan):
    return views.select_phase(plan, "decode")


def dot_nodes(source: str) -> set[str]:
    """Names of the nodes declared in Graphviz source (``\tNAME [attrs]`` lines)."""
    names = set()
    for line in source.splitlines():
        m = re.match(r'\s*("(?:[^"\\]|\\.)*"|[A-Za-z0-9_.]+)\s*\[', line)
        if m and m.group(1) not in ("graph", "node", "edge"):
            names.add(m.group(1).strip('"'))
    return names


def run_dot(tmp_path: Path, capsys, *argv: str, name: str = "out.dot") -> tuple[int, str, Path]:
    out = tmp_path / name
    code = cli.main(["dot", *argv, "-o", str(out)])
    return code, capsys.readouterr().err, out


def layer_tenants(phase, first: int, last: int) -> list:
    layer_of = views.tensor_layers(read_plan(PLAN), phase)
    return [
        t
        for t in phase.tensors
        if is_arena_tenant(t) and layer_of.get(t.id) is not None and first <= layer_of[t.id] <= last
    ]


# --------------------------------------------------------------------------------- .dot source


def test_lifetimes_dot_names_every_tenant_and_buffer(tmp_path, capsys, decode):
    code, err, out = run_dot(tmp_path, capsys, str(PLAN), "--view", "lifetimes", "--phase", "decode")
    assert code == 0, err
    source = out.read_text()
    nodes = dot_nodes(source)
    tenants = [t for t in decode.tensors if is_arena_tenant(t)]
    assert {t.id for t in tenants} <= nodes
    assert not {t.id for t in decode.tensors if not is_arena_tenant(t)} & nodes  # no views/state
    for b in decode.buffers:
        assert f'label="buffer {b.id} (' in source
    assert "layout=neato" in source  # pinned positions survive a plain `dot -Tsvg`
    assert "schedule slot" in source


def test_lifetimes_positions_follow_the_intervals(decode):
    g = views.lifetimes_graph(read_plan(PLAN), decode, (5, 5))
    tenants = layer_tenants(decode, 5, 5)
    first = min(t.interval[0] for t in tenants)
    spans = {t.id: t.interval[1] - t.interval[0] + 1 for t in tenants}
    widths = {}
    for line in g.body:
        m = re.match(r'\s*"?([^" \[]+)"? \[.*pos="([-0-9.]+),[-0-9.]+!".* width=([0-9.]+)', line)
        if m and m.group(1) in spans:
            widths[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    assert set(widths) == set(spans)
    scale = next(w / spans[k] for k, (_, w) in widths.items() if spans[k] > 10)
    for t in tenants:
        x, w = widths[t.id]
        assert w == pytest.approx(max(spans[t.id] * scale, 0.01), abs=2e-4)
        assert x - w / 2 == pytest.approx((t.interval[0] - first) * scale, abs=2e-4)


def test_buffers_dot_lists_each_buffer_with_its_tenants(tmp_path, capsys, decode):
    code, err, out = run_dot(tmp_path, capsys, str(PLAN), "--view", "buffers", "--phase", "decode")
    assert code == 0, err
    source = out.read_text()
    assert {f"buffer_{b.id}" for b in decode.buffers} <= dot_nodes(source)
    for b in decode.buffers:
        tenants = [t for t in decode.tensors if is_arena_tenant(t) and t.buffer == b.id]
        noun = "tenant" if len(tenants) == 1 else "tenants"
        assert f"<b>buffer {b.id}</b>: {b.bytes:,} B" in source
        assert f"{len(tenants)} {noun}</td>" in source
        for t in tenants:
            assert f">{t.id}</td>" in source


def test_graph_is_collapsed_to_layers_by_default(tmp_path, capsys, plan, decode):
    code, err, out = run_dot(tmp_path, capsys, str(PLAN), "--view", "graph", "--phase", "decode")
    assert code == 0
    assert "one node per layer" in err and "--flat" in err
    source = out.read_text()
    nodes = dot_nodes(source)
    expected = {f"g_layer_{i}" for i in range(plan.model.num_layers)}
    assert expected | {"g_model__before_layers_", "g_model__after_layers_", "g_inputs"} <= nodes
    assert not any(n.startswith("op") for n in nodes)
    # The residual stream between consecutive layers is labelled with its shape.
    assert re.search(r'g_layer_3 -> g_layer_4 \[label="\d+ tensors?\\n\[1,1,1536\] bf16', source)
    assert "next_token (output)" in source


def test_graph_large_range_is_collapsed_with_stand_ins(tmp_path, capsys):
    code, err, out = run_dot(tmp_path, capsys, str(PLAN), "--view", "graph", "--layers", "0-9")
    assert code == 0 and "one node per layer" in err  # 800 ops
    nodes = dot_nodes(out.read_text())
    assert {f"g_layer_{i}" for i in range(10)} <= nodes
    assert {"g_layer_10__not_shown_", "g_model__before_layers___not_shown_"} <= nodes
    assert not {"g_layer_11", "g_model__before_layers_"} & nodes
    assert "g_inputs" in nodes  # each layer's rope reads the position input itself


def test_graph_layers_range_is_flat_and_clustered(tmp_path, capsys, decode):
    code, err, out = run_dot(
        tmp_path, capsys, str(PLAN), "--view", "graph", "--layers", "3-4", "--phase", "decode"
    )
    assert code == 0 and err == ""
    source = out.read_text()
    layer = op_layers(read_plan(PLAN), decode)
    ops = [i for i in range(len(decode.ops)) if layer[i] in (3, 4)]
    nodes = dot_nodes(source)
    assert {f"op{i}" for i in ops} <= nodes
    assert not {f"op{i}" for i in range(len(decode.ops)) if layer[i] not in (3, 4)} & nodes
    assert "subgraph cluster_3" in source and "subgraph cluster_4" in source
    # inside each layer, one cluster per module that made ops there
    assert 'label="self_attn.q_proj"' in source and 'label="mlp.down_proj"' in source
    assert source.count("subgraph cluster_3_") >= 10
    assert {"outside_2", "outside_5"} <= nodes  # stand-ins for the rest
    assert {"in_" + b.id for b in decode.inputs if b.name.startswith("kv.3.")} <= nodes
    assert re.search(r'op\d+ -> op\d+ \[label="\[1,1,1536\] bf16"\]', source)


def test_graph_flat_expands_every_op(tmp_path, capsys, decode):
    code, err, out = run_dot(
        tmp_path, capsys, str(PLAN), "--view", "graph", "--flat", "--phase", "decode"
    )
    assert code == 0 and err == ""
    nodes = dot_nodes(out.read_text())
    assert {f"op{i}" for i in range(len(decode.ops))} <= nodes
    assert "cluster_model" in out.read_text()


def test_tiny_plan_graph(plan_file, tmp_path, capsys, tiny_plan):
    code, _, out = run_dot(tmp_path, capsys, str(plan_file), "--view", "graph")
    assert code == 0
    source = out.read_text()
    assert {f"op{i}" for i in range(6)} | {"in_tok", "in_pos", "in_k_in", "out_out"} <= dot_nodes(
        source
    )
    assert 'op0 -> op1 [label="[1,1,8] f16"]' in source
    assert "subgraph cluster_model" in source and "subgraph cluster_0" in source


def test_prefill_phase_is_selectable(tmp_path, capsys, plan):
    prefill = views.select_phase(plan, "prefill")
    code, _, out = run_dot(tmp_path, capsys, str(PLAN), "--phase", "prefill", "--layers", "0")
    assert code == 0
    nodes = dot_nodes(out.read_text())
    assert {t.id for t in layer_tenants(prefill, 0, 0)} <= nodes


# ------------------------------------------------------------------------------ rendered output


@needs_dot
def test_buffers_svg_parses_and_names_the_expected_buffers(tmp_path, capsys, decode):
    code, err, out = run_dot(
        tmp_path, capsys, str(PLAN), "--view", "buffers", "--layers", "3-3", "--phase", "decode",
        name="b.svg",
    )
    assert code == 0, err
    root = ET.parse(out).getroot()
    assert root.tag == f"{SVG}svg"
    titles = {el.text for el in root.iter(f"{SVG}title")}
    expected = {t.buffer for t in layer_tenants(decode, 3, 3)}
    assert {f"buffer_{b}" for b in expected} <= titles
    assert not {f"buffer_{b.id}" for b in decode.buffers if b.id not in expected} & titles
    text = " ".join(el.text or "" for el in root.iter(f"{SVG}text"))
    for b in expected:
        assert f"buffer {b}" in text


@needs_dot
def test_lifetimes_svg_names_tenants(tmp_path, capsys, decode):
    code, err, out = run_dot(
        tmp_path, capsys, str(PLAN), "--layers", "2-2", "--view", "lifetimes", "--phase", "decode",
        name="l.svg",
    )
    assert code == 0, err
    root = ET.parse(out).getroot()
    titles = {el.text for el in root.iter(f"{SVG}title")}
    assert {t.id for t in layer_tenants(decode, 2, 2)} <= titles


@needs_dot
def test_graph_png(tmp_path, capsys):
    code, err, out = run_dot(tmp_path, capsys, str(PLAN), "--view", "graph", name="g.png")
    assert code == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------- no Graphviz


def test_svg_without_dot_binary_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    code, err, out = run_dot(tmp_path, capsys, str(PLAN), name="x.svg")
    assert code == 2 and not out.exists()
    assert err.count("\n") == 1
    assert "apt-get install graphviz" in err and "brew install graphviz" in err
    code, err, out = run_dot(tmp_path, capsys, str(PLAN), name="x.dot")
    assert code == 0 and out.read_text().startswith("digraph")


def test_no_dot_on_path_in_a_fresh_process(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path / "empty")}
    base = [sys.executable, "-m", "dctms.cli.main", "dot", str(PLAN), "-o"]
    proc = subprocess.run([*base, str(tmp_path / "x.png")], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "install Graphviz" in proc.stderr
    proc = subprocess.run([*base, str(tmp_path / "x.dot")], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr


# ----------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layers", "x"], "--layers wants A-B"),
        (["--layers", "5-2"], "first layer is after the last"),
        (["--layers", "28-30"], "the model has layers 0-27"),
        (["--phase", "warmup"], "no phase 'warmup' (phases: prefill, decode)"),
    ],
)
def test_bad_input_exit_2(tmp_path, capsys, argv, message):
    code, err, _ = run_dot(tmp_path, capsys, str(PLAN), *argv)
    assert code == 2
    assert message in err and err.count("\n") == 1


def test_unknown_extension_and_missing_plan(tmp_path, capsys):
    code, err, _ = run_dot(tmp_path, capsys, str(PLAN), name="x.jpg")
    assert code == 2 and "unknown output type .jpg" in err
    code, err, _ = run_dot(tmp_path, capsys, str(tmp_path / "none.plan"))
    assert code == 2 and "no such file" in err


def test_parse_layers():
    assert parse_layers(None) is None
    assert parse_layers("3") == (3, 3)
    assert parse_layers(" 2 - 7 ") == (2, 7)
    with pytest.raises(DctmsError):
        parse_layers("a-b")


# ---------------------------------------------------------------------- defaults (issue 32)


def test_the_default_phase_is_the_one_with_the_peak(tmp_path, capsys, plan):
    peak = max(plan.phases, key=lambda p: p.arena_bytes + p.slack_bytes)
    assert peak.arena_bytes + peak.slack_bytes == plan.envelope.intermediate
    assert views.select_phase(plan, None) is peak and peak.name == "prefill"
    code, err, out = run_dot(tmp_path, capsys, str(PLAN), "--view", "buffers")
    assert code == 0, err
    assert f": {peak.name} phase:" in out.read_text()


def test_lifetime_bars_are_labelled_by_module_path(plan):
    phase = views.select_phase(plan, "prefill")
    module_of = views.tensor_modules(plan, phase)
    source = views.lifetimes_graph(plan, phase, (26, 26)).source
    labelled = 0
    for t in layer_tenants(phase, 26, 26):
        line = next(x for x in source.splitlines() if re.match(rf'\s*"?{re.escape(t.id)}"? \[', x))
        label = re.search(r'[\[ ]label="([^"]*)"', line).group(1)
        module = module_of[t.id]
        assert module and label in ("", module.removeprefix("model."))
        labelled += label != ""
    assert labelled  # the wide bars carry their module path, e.g. layers.26.self_attn


def test_collapsed_graph_does_not_tie_layer_0_to_every_layer(tmp_path, capsys, plan):
    code, err, out = run_dot(tmp_path, capsys, str(PLAN), "--view", "graph", "--phase", "prefill")
    assert code == 0, err
    source = out.read_text()
    # the rotary angles and the mask are computed once in layer 0 and read by every layer: noted
    # on layer 0, not drawn as 27 edges; consecutive layers stay joined by the residual stream
    assert not re.search(r"g_layer_0 -> g_layer_(?:[2-9]|\d\d) ", source)
    for i in range(plan.model.num_layers - 1):
        assert re.search(rf"g_layer_{i} -> g_layer_{i + 1} ", source)
    assert re.search(r'g_layer_0 \[label="layer 0\\n\d+ ops, \d+ memory-bound\\n\+ \d+ tensors '
                     r"shared with \d+ other groups \(not drawn\)", source)  # fmt: skip
