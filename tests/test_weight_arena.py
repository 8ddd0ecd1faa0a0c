"""The weights in one arena (``runner.weight_arena``): the stored bytes exactly, M_weights exactly,
never a stored copy beside it, the same tokens, and the cases that keep one buffer per weight."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from dctms.runner import weight_arena
from dctms.runner.load import load_weights
from dctms.runner.request import validate_request
from dctms.runner.session import Session
from dctms.schema.errors import DctmsError
from dctms.schema.fingerprint import HeaderTensor, read_safetensors_header
from dctms.schema.io import write_plan
from dctms.schema.model_folder import open_model
from dctms.toolkit.compiler import CompileOptions, compile_plan
from dctms.toolkit.tiny_model import write_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from test_compiler_families import BASE, FAMILIES  # noqa: E402

CASES = {
    "qwen2-f32": {**BASE, **FAMILIES["qwen2"], "torch_dtype": "float32"},
    "llama-bf16": {**BASE, **FAMILIES["llama"], "torch_dtype": "bfloat16"},
    "qwen2-4bit": {
        **BASE,
        **FAMILIES["qwen2"],
        "torch_dtype": "float32",
        "quantization": {"group_size": 32, "bits": 4},
    },
}


def _compiled(tmp_path: Path, config: dict, **opts):
    folder = write_tiny_model(tmp_path / "model", dict(config))
    model = open_model(folder)
    return model, compile_plan(model, CompileOptions(32, 8, prefill_chunk=16, **opts))


def _stored(model) -> dict[str, mx.array]:
    stored: dict[str, mx.array] = {}
    for f in model.weight_files:
        stored.update(mx.load(str(f)))
    return stored


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_arena_holds_the_stored_bytes_in_exactly_m_weights(name, tmp_path) -> None:
    model, plan = _compiled(tmp_path, CASES[name])
    mx.set_cache_limit(0)
    mx.eval(mx.zeros((1,)))
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    weights, info = load_weights(model, plan)
    m_weights = sum(w.nbytes for w in weights.values())
    assert info.arena_bytes == m_weights == plan.envelope.weights
    assert plan.model.weights.fused or name == "qwen2-4bit"  # projections fused, not quantised
    # one allocation of M_weights, and never a stored copy beside it (only the zero that fills it)
    assert mx.get_active_memory() - before == m_weights
    assert m_weights <= mx.get_peak_memory() - before <= m_weights + 16
    _assert_stored(weights, _stored(model), plan)


def _assert_stored(weights: dict, stored: dict, plan) -> None:
    """``weights`` hold exactly the stored tensors: each fused weight its parts end to end."""
    for fw in plan.model.weights.fused:
        stored[fw.name] = mx.concatenate([stored.pop(p) for p in fw.parts], axis=0)
    assert set(weights) == set(stored)
    for key, w in weights.items():
        assert (w.dtype, w.shape) == (stored[key].dtype, stored[key].shape), key
        assert mx.array_equal(w, stored[key]).item(), key


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_buffer_per_weight_holds_the_same_weights(name, tmp_path, monkeypatch) -> None:
    model, plan = _compiled(tmp_path, CASES[name])
    monkeypatch.setenv(weight_arena.SWITCH, "off")
    mx.set_cache_limit(0)
    mx.eval(mx.zeros((1,)))
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    weights, info = load_weights(model, plan)
    assert info.arena_bytes == 0
    # fused weights concatenated first: the load never held more than M_weights
    assert mx.get_active_memory() - before == plan.envelope.weights
    assert mx.get_peak_memory() - before <= plan.envelope.weights
    _assert_stored(weights, _stored(model), plan)


def test_generation_is_the_same_with_and_without_the_arena(tmp_path, monkeypatch) -> None:
    model, plan = _compiled(tmp_path, CASES["qwen2-f32"])
    request = validate_request(plan, [3, 1, 4, 1, 5, 9, 2, 6], 8)
    runs = {}
    for switch in ("on", "off"):
        monkeypatch.setenv(weight_arena.SWITCH, switch)
        session = Session(plan, model)
        runs[switch] = (session.generate(request).tokens, session.weight_allocation)
        assert session.observed_peak() <= plan.envelope.provable
        del session
    assert runs["on"][0] == runs["off"][0]
    assert runs["on"][1].arena_bytes == plan.envelope.weights
    assert runs["off"][1].arena_bytes == 0
    assert runs["off"][1].reason == "DCTMS_WEIGHT_ARENA=off"


def test_a_bad_switch_value_is_an_error(tmp_path, monkeypatch) -> None:
    model, plan = _compiled(tmp_path, CASES["qwen2-f32"])
    monkeypatch.setenv(weight_arena.SWITCH, "maybe")
    with pytest.raises(DctmsError, match="DCTMS_WEIGHT_ARENA must be on or off"):
        load_weights(model, plan)


def test_weights_cast_at_load_keep_one_buffer_each(tmp_path) -> None:
    model, plan = _compiled(tmp_path, CASES["qwen2-f32"], dtype="bfloat16")
    weights, info = load_weights(model, plan)
    assert (info.arena_bytes, info.reason) == (0, "weights cast at load")
    assert all(w.dtype == mx.bfloat16 for w in weights.values() if w.dtype != mx.uint32)


def test_layout_refuses_an_offset_that_would_need_padding() -> None:
    half = HeaderTensor("h", (3,), "float16", 6, "f.safetensors", 8)
    full = HeaderTensor("f", (2,), "float32", 8, "f.safetensors", 14)
    sources = {"h": half, "f": full}
    assert weight_arena.layout(["h", "f"], sources) is None  # f would start at byte 6
    placed = weight_arena.layout(["f", "h"], sources)
    assert [(p.name, p.offset) for p in placed] == [("f", 0), ("h", 8)]


def test_a_file_that_ends_early_is_a_one_line_error(tmp_path) -> None:
    path = tmp_path / "w.safetensors"
    mx.save_safetensors(str(path), {"w": mx.arange(64, dtype=mx.float32)})
    (src,) = read_safetensors_header(path)
    beyond = HeaderTensor(src.name, src.shape, src.dtype, src.bytes, src.file, src.start + 100)
    with pytest.raises(DctmsError, match="tensor w ends early.*truncated"):
        weight_arena.read_arena(weight_arena.layout(["w"], {"w": beyond}), {path.name: path})


def _vmstat(key: str) -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        name, value = line.split()
        if name == key:
            return int(value)
    return 0


@pytest.mark.skipif(
    platform.system() != "Linux"
    or not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
    reason="no transparent huge pages here",
)
def test_a_large_arena_is_asked_for_and_given_huge_pages(tmp_path) -> None:
    path = tmp_path / "w.safetensors"
    size = 6 * 2**20 // 4  # 6 MiB of float32: at least two whole 2 MiB pages inside
    mx.save_safetensors(str(path), {"w": mx.arange(size, dtype=mx.float32)})
    (src,) = read_safetensors_header(path)
    fallback = _vmstat("thp_fault_fallback")
    weights, info = weight_arena.read_arena(
        weight_arena.layout(["w"], {"w": src}), {path.name: path}
    )
    assert info.reason == "transparent huge pages asked for (MADV_HUGEPAGE)"
    # the kernel gives them, or counts that it could not (fragmented memory)
    assert info.huge_page_bytes >= 2 * 2**20 or _vmstat("thp_fault_fallback") > fallback
    assert info.huge_page_bytes <= info.arena_bytes
    assert mx.array_equal(weights["w"], mx.arange(size, dtype=mx.float32)).item()


def test_dctms_run_says_how_the_weights_were_allocated(tmp_path) -> None:
    model, plan = _compiled(tmp_path, CASES["qwen2-f32"])
    plan_path, report = tmp_path / "m.plan", tmp_path / "r.json"
    write_plan(plan, plan_path)
    proc = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "run", str(plan_path), "--model",
         str(model.path), "--tokens", "1,2,3", "--max-tokens", "2", "--report", str(report)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(report.read_text())["weights"]["arena_bytes"] == plan.envelope.weights
    line = next(x for x in proc.stderr.splitlines() if x.startswith("weights: "))
    assert line.startswith(f"weights: one arena of {plan.envelope.weights:,} bytes")
