"""Caches other than a float KV cache: the quantised KV cache (``--kv-bits``).

Against mlx-lm itself, on tiny random-weight models: the plan's M_KV is mlx-lm's own
``QuantizedKVCache`` bytes per position times the plan's capacity (packed words, scales and biases
to the byte); the runner's greedy ids equal ``generate_step``'s with the same ``kv_bits``,
``kv_group_size``, ``quantized_kv_start=0`` and ``prefill_step_size`` = the plan's chunk; the
observed MLX peak stays within the provable envelope. Bad settings are one line, exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from tiny_configs import BASE, QWEN2_F32

from dctms.schema.errors import DctmsError
from dctms.schema.model_folder import open_model
from dctms.schema.verify import verify_plan
from dctms.toolkit.compiler import CompileOptions, compile_plan

N, M, CHUNK = 64, 32, 16
K = 24  # generated tokens per run

MODELS = {
    "qwen2-f32": QWEN2_F32,
    "llama-bf16": {
        "model_type": "llama",
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "head_dim": 64,
    },
}
# (model, kv_bits, kv_group_size)
SETTINGS = [("qwen2-f32", 4, 32), ("qwen2-f32", 8, 32), ("llama-bf16", 4, 64)]


def prompt_ids(length: int) -> list[int]:
    return [(i * 37 + length * 11 + 3) % 256 for i in range(length)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(model, bits, group) -> (folder, plan, plan path, mlx-lm model), each made once."""
    from dctms.schema.io import write_plan
    from dctms.toolkit.tiny_model import write_tiny_model

    folders: dict[str, Path] = {}
    cache: dict[tuple, tuple] = {}

    def get(name: str, bits: int, group: int):
        from mlx_lm.utils import load_model

        if name not in folders:
            folders[name] = tmp_path_factory.mktemp(f"kv-{name}")
            write_tiny_model(folders[name], {**BASE, **MODELS[name]}, seed=7)
        key = (name, bits, group)
        if key not in cache:
            folder = folders[name]
            opts = CompileOptions(N, M, prefill_chunk=CHUNK, kv_bits=bits, kv_group_size=group)
            plan = compile_plan(open_model(folder), opts)
            path = folder / f"kv{bits}g{group}.plan"
            write_plan(plan, path)
            cache[key] = (folder, plan, path, load_model(folder)[0])
        return cache[key]

    return get


def mlx_lm_generate(model, prompt: list[int], k: int, **kv) -> tuple[list[int], list]:
    """mlx-lm's greedy tokens and its cache objects after generating them."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=k,
        sampler=lambda x: mx.argmax(x, axis=-1),
        prefill_step_size=CHUNK,
        prompt_cache=cache,
        **kv,
    )
    return [int(t) for t, _ in steps], cache


def run_plan(plan: Path, folder: Path, prompt: list[int], k: int, report: Path):
    cmd = [sys.executable, "-m", "dctms.cli.main", "run", str(plan), "--model", str(folder)]
    cmd += ["--tokens", ",".join(map(str, prompt)), "--max-tokens", str(k), "--ignore-eos"]
    cmd += ["--report", str(report)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def kv_settings(bits: int, group: int) -> dict:
    return {"kv_bits": bits, "kv_group_size": group, "quantized_kv_start": 0}


@pytest.mark.parametrize(
    ("name", "bits", "group"),
    [pytest.param(*s, marks=() if i == 0 else pytest.mark.slow) for i, s in enumerate(SETTINGS)],
)
def test_quantised_cache_is_mlx_lms_to_the_byte(built, name, bits, group) -> None:
    _, plan, _, model = built(name, bits, group)
    assert verify_plan(plan) == []
    assert (plan.bounds.kv.bits, plan.bounds.kv.group_size) == (bits, group)
    _, cache = mlx_lm_generate(model, prompt_ids(20), 4, **kv_settings(bits, group))
    assert {type(c).__name__ for c in cache} == {"QuantizedKVCache"}
    # mlx-lm allocates its cache in steps of 256 positions: compare bytes per position.
    per_position = sum(c.nbytes // c.keys[0].shape[2] for c in cache)
    assert plan.envelope.kv == per_position * plan.bounds.kv_capacity
    # packed words, scales and biases for keys and for values of every layer
    kv = [s for s in plan.state if s.kind == "kv"]
    assert len(kv) == 6 * plan.model.num_layers
    assert {s.dtype for s in kv} == {"uint32", MODELS[name]["torch_dtype"]}


def test_phases_use_mlx_lms_quantised_attention(built) -> None:
    _, plan, _, _ = built(*SETTINGS[0])
    phases = {p.name: p for p in plan.phases}
    assert set(phases) == {"prefill_start", "prefill", "decode"}
    layers = plan.model.num_layers
    for name, phase in phases.items():
        state = {b.id for b in phase.inputs if b.kind == "state"}
        quantize = [op for op in phase.ops if op.primitive == "Quantize"]
        assert len(quantize) == 2 * layers  # keys and values of every layer, as mlx-lm writes
        assert all(op.args[:2] == [SETTINGS[0][2], SETTINGS[0][1]] for op in quantize)
        views = _views_of(phase, state)
        reads = [
            op for op in phase.ops if op.primitive == "QuantizedMatmul" and set(op.inputs) & views
        ]
        # the first call attends in float (mlx-lm's cache is quantised after it); the others
        # compute scores and outputs with quantised matmuls over the cache, per layer
        assert len(reads) == (0 if name == "prefill_start" else 2 * layers), name


def _views_of(phase, roots: set[str]) -> set[str]:
    views = {t.id for t in phase.tensors if t.view_of in roots}
    grew = True
    while grew:
        more = {t.id for t in phase.tensors if t.view_of in views} - views
        grew = bool(more)
        views |= more
    return views | roots


PROMPTS = [1, 5, CHUNK, 50, N]  # one token, short, one chunk, several chunks (padded), exactly N
CASES = [(s, p) for s in SETTINGS for p in PROMPTS]


@pytest.mark.parametrize(
    ("setting", "length"),
    [
        pytest.param(
            s,
            p,
            id=f"{s[0]}-kv{s[1]}g{s[2]}-{p}",
            marks=() if (s, p) == CASES[3] else pytest.mark.slow,
        )
        for s, p in CASES
    ],
)
def test_runner_matches_mlx_lm_with_a_quantised_cache(built, setting, length, tmp_path) -> None:
    folder, plan, path, model = built(*setting)
    prompt = prompt_ids(length)
    expected, _ = mlx_lm_generate(model, prompt, K, **kv_settings(*setting[1:]))
    assert len(set(expected)) >= 4, f"degenerate reference: {expected}"
    proc = run_plan(path, folder, prompt, K, tmp_path / "report.json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["tokens"] == expected
    assert report["within_envelope"], report["observed"]
    print(f"{setting} L={length}: provable/observed {report['envelope_over_observed']:.4f}")


START = 40  # --quantized-kv-start: calls starting below 40 attend in float, as in mlx-lm


@pytest.fixture(scope="module")
def later_start_built(built):
    from dctms.schema.io import write_plan

    folder, _, _, model = built(*SETTINGS[0])
    bits, group = SETTINGS[0][1:]
    opts = CompileOptions(
        N, M, prefill_chunk=CHUNK, kv_bits=bits, kv_group_size=group, quantized_kv_start=START
    )
    plan = compile_plan(open_model(folder), opts)
    write_plan(plan, folder / "later-start.plan")
    return folder, plan, folder / "later-start.plan", model


def test_a_later_start_keeps_a_float_cache_until_the_switch(built, later_start_built) -> None:
    _, plan, _, model = later_start_built
    assert verify_plan(plan) == []
    assert plan.bounds.kv.quantized_start == START
    assert {p.name for p in plan.phases} == {"prefill_start", "decode_start", "prefill", "decode"}
    floats = [s for s in plan.state if s.name.endswith(".float")]
    # the chunks starting below 40 write up to 48 = ceil(40 / 16) * 16, plus the spare position
    assert len(floats) == 2 * plan.model.num_layers and {s.shape[2] for s in floats} == {49}
    _, cache = mlx_lm_generate(model, prompt_ids(20), 4)  # no quantisation yet: float KVCache
    float_per_position = sum(c.nbytes // c.keys.shape[2] for c in cache)
    assert sum(s.bytes for s in floats) == float_per_position * 49
    quantised = [s for s in plan.state if s.kind == "kv" and not s.name.endswith(".float")]
    # beside it, the same quantised cache as a start-0 plan's
    assert sum(s.bytes for s in quantised) == built(*SETTINGS[0])[1].envelope.kv


@pytest.mark.parametrize(
    "length",
    [pytest.param(p, marks=() if p == 33 else pytest.mark.slow) for p in (1, 16, 33, 41, N)],
)
def test_runner_matches_mlx_lm_with_a_later_start(later_start_built, length, tmp_path) -> None:
    """Prompts ending before, at and after the switch at 40 (and generations crossing it)."""
    folder, _, path, model = later_start_built
    bits, group = SETTINGS[0][1:]
    settings = {"kv_bits": bits, "kv_group_size": group, "quantized_kv_start": START}
    expected, _ = mlx_lm_generate(model, prompt_ids(length), K, **settings)
    proc = run_plan(path, folder, prompt_ids(length), K, tmp_path / "report.json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["tokens"] == expected
    assert report["within_envelope"], report["observed"]
    if length == 33:  # not vacuous: the start changes mlx-lm's ids (against 0 and no quantisation)
        assert (
            expected != mlx_lm_generate(model, prompt_ids(length), K, **kv_settings(bits, group))[0]
        )
        assert expected != mlx_lm_generate(model, prompt_ids(length), K)[0]
    print(f"start {START} L={length}: provable/observed {report['envelope_over_observed']:.4f}")


def test_quantisation_changes_the_reference(built) -> None:
    """Not vacuous: the quantised cache changes mlx-lm's own greedy ids on this model."""
    *_, model = built(*SETTINGS[0])
    plain, _ = mlx_lm_generate(model, prompt_ids(50), K)
    quantised, _ = mlx_lm_generate(model, prompt_ids(50), K, **kv_settings(*SETTINGS[0][1:]))
    assert plain != quantised


def test_bad_kv_settings_are_refused(tmp_path: Path) -> None:
    cfg = {**BASE, **MODELS["qwen2-f32"]}  # head_dim 32
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    src = open_model(tmp_path)
    for opts, needle in [
        (dict(kv_bits=3), "--kv-bits must be one of 4, 8"),
        (dict(kv_bits=4, kv_group_size=48), "--kv-group-size must be one of"),
        (dict(kv_bits=4, kv_group_size=64), "does not divide the model's head dimension 32"),
        (dict(kv_bits=4, kv_group_size=32, quantized_kv_start=-1), "must be 0 or more"),
        (dict(kv_bits=4, kv_group_size=32, max_kv_size=12), "quantised sliding-window"),
    ]:
        with pytest.raises(DctmsError, match=needle):
            compile_plan(src, CompileOptions(16, 8, **opts))
    proc = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "compile", str(tmp_path), "-N", "16", "-M", "8"]
        + ["--kv-bits", "8", "-o", str(tmp_path / "x.plan")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--kv-group-size 64 does not divide" in lines[0], proc.stderr
    assert not (tmp_path / "x.plan").exists()


def test_the_docs_list_every_mlx_lm_cache_class() -> None:
    """The cache table of the docs (docs/how-to/caches.md) is toolkit.caches.CACHE_SUPPORT, which
    names every cache class mlx-lm's cache module defines (batched variants aside)."""
    import inspect

    import mlx_lm.models.cache as mlx_cache

    from dctms.toolkit.caches import CACHE_SUPPORT

    classes = {
        name
        for name, cls in inspect.getmembers(mlx_cache, inspect.isclass)
        if issubclass(cls, mlx_cache._BaseCache)
        and cls is not mlx_cache._BaseCache
        and not name.startswith("Batch")
    }
    assert classes == set(CACHE_SUPPORT)
    page = (Path(__file__).resolve().parents[1] / "docs" / "how-to" / "caches.md").read_text()
    rows = [f"| `{name}` | {status} |" for name, status in CACHE_SUPPORT.items()]
    assert all(row in page for row in rows), [r for r in rows if r not in page]


def test_a_refused_cache_says_which_and_why() -> None:
    from types import SimpleNamespace

    from mlx_lm.models.cache import CacheList, ChunkedKVCache, KVCache

    from dctms.toolkit.caches import check_cache_support

    for caches, needle in [
        ([KVCache(), CacheList(KVCache())], "CacheList: a per-layer list of caches"),
        ([ChunkedKVCache(8)], "ChunkedKVCache: chunked attention"),
    ]:
        model = SimpleNamespace(make_cache=lambda c=caches: c, model_type="toy")
        with pytest.raises(DctmsError, match=f"not supported yet: toy .*{needle}"):
            check_cache_support(model)


# ------------------------------------------------------------------ sliding-window (rotating) caches

WINDOW = 16
RING_MODELS = {
    "gemma3-f32": {
        "model_type": "gemma3_text",
        "torch_dtype": "float32",
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
        "num_hidden_layers": 4,
    },
    "olmo3-bf16": {
        "model_type": "olmo3",
        "torch_dtype": "bfloat16",
        "sliding_window": WINDOW,
        "num_hidden_layers": 4,
    },
}


@pytest.fixture(scope="module")
def ring_built(tmp_path_factory):
    from mlx_lm.utils import load_model

    from dctms.schema.io import write_plan
    from dctms.toolkit.tiny_model import write_tiny_model

    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            folder = tmp_path_factory.mktemp(f"ring-{name}")
            write_tiny_model(folder, {**BASE, **RING_MODELS[name]}, seed=7)
            plan = compile_plan(open_model(folder), CompileOptions(N, M, prefill_chunk=CHUNK))
            write_plan(plan, folder / "model.plan")
            cache[name] = (folder, plan, folder / "model.plan", load_model(folder)[0])
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(RING_MODELS))
def test_ring_plans_run_at_real_lengths(ring_built, name) -> None:
    """A window equal to the ring's slots is not sampled for the fit (the trace there lacks one
    broadcast), so both phases follow the lengths; the ids tests above run through those points."""
    _, plan, _, _ = ring_built(name)
    slots = {s.window.slots for s in plan.state if s.window is not None}
    for phase in plan.phases:
        assert phase.lengths is not None and len(phase.lengths.points) > 1, phase.name
    decode = next(p for p in plan.phases if p.name == "decode")
    assert slots & {p[0] for p in decode.lengths.points}  # the special window is still run at


def test_show_diff_and_bench_see_the_rings(ring_built) -> None:
    """gemma3_text: every other layer a ring of the window's slots; the others grow with the
    position. ``dctms show`` names the window, ``dctms diff`` a changed one."""
    from msgspec.structs import replace

    from dctms.figures.cache_layout import cache_layout
    from dctms.figures.comparison import plan_diff
    from dctms.views.show import show_text

    _, plan, _, _ = ring_built("gemma3-f32")
    layout = cache_layout(plan)
    assert layout.ring_layers == (0, 2) and layout.windows == ((WINDOW, 32, 0),)
    full = plan.envelope.kv - layout.ring_bytes
    assert layout.bytes_per_position * plan.bounds.kv_capacity == full > 0
    assert f"window {WINDOW}, ring of 32 slots in 2 of 4 layers" in show_text(plan)
    wider = [
        replace(s, window=replace(s.window, window=WINDOW + 8)) if s.window else s
        for s in plan.state
    ]
    rows = {r.key: r for r in plan_diff(plan, replace(plan, state=wider)).bounds}
    assert rows["cache_layers"].changed and f"window {WINDOW + 8}" in str(rows["cache_layers"].new)


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=() if i == 0 else pytest.mark.slow) for i, n in enumerate(RING_MODELS)],
)
def test_sliding_window_layers_are_rings_of_mlx_lms_bytes(ring_built, name) -> None:
    from dctms.toolkit.caches import ring_slots

    _, plan, _, model = ring_built(name)
    assert verify_plan(plan) == []
    _, cache = mlx_lm_generate(model, prompt_ids(20), 4)
    kinds = [type(c).__name__ for c in cache]
    assert set(kinds) == {"KVCache", "RotatingKVCache"}
    slots = ring_slots(WINDOW, CHUNK)
    assert slots == 32 < plan.bounds.kv_capacity
    expected = 0
    for i, c in enumerate(cache):
        per_position = c.nbytes // c.keys.shape[2]  # mlx-lm's own bytes per cached position
        ring = kinds[i] == "RotatingKVCache"
        expected += per_position * (slots if ring else plan.bounds.kv_capacity)
        keys = next(s for s in plan.state if s.name == f"kv.{i}.keys")
        assert (keys.window is not None) == ring
        if ring:
            assert (keys.window.window, keys.window.slots, keys.shape[2]) == (WINDOW, slots, slots)
            assert c.max_size == WINDOW and c.keep == 0
    assert plan.envelope.kv == expected


RING_CASES = [(m, p) for m in RING_MODELS for p in (5, CHUNK, 50, N)]


@pytest.mark.parametrize(
    ("name", "length"),
    [
        pytest.param(m, p, id=f"{m}-{p}", marks=() if (m, p) == RING_CASES[3] else pytest.mark.slow)
        for m, p in RING_CASES
    ],
)
def test_runner_matches_mlx_lm_past_the_window(ring_built, name, length, tmp_path) -> None:
    """Prompts shorter and longer than the window; N + K positions wrap the 32-slot ring twice."""
    folder, _, path, model = ring_built(name)
    prompt = prompt_ids(length)
    expected, _ = mlx_lm_generate(model, prompt, K)
    assert len(set(expected)) >= 4, f"degenerate reference: {expected}"
    proc = run_plan(path, folder, prompt, K, tmp_path / "report.json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["tokens"] == expected
    assert report["within_envelope"], report["observed"]
    print(f"{name} L={length}: provable/observed {report['envelope_over_observed']:.4f}")


def test_a_ring_plan_synced_every_layer_runs_within_its_envelope(ring_built, tmp_path) -> None:
    """--sync-every 1 on a model with rings: an output a sync point evaluates is never planned in
    a donated buffer (it was, and the verifier refused the compiler's own plan)."""
    from dctms.schema.io import write_plan

    folder, _, _, model = ring_built("gemma3-f32")
    plan = compile_plan(open_model(folder), CompileOptions(N, M, prefill_chunk=CHUNK, sync_every=1))
    assert verify_plan(plan) == []
    assert all(len(p.sync_points) > 1 for p in plan.phases)
    path = tmp_path / "synced.plan"
    write_plan(plan, path)
    prompt = prompt_ids(50)
    expected, _ = mlx_lm_generate(model, prompt, K)
    proc = run_plan(path, folder, prompt, K, tmp_path / "report.json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["tokens"] == expected and report["within_envelope"], report["observed"]


MAX_KV = 24  # --max-kv-size: mlx-lm's RotatingKVCache(24, keep=4) on every layer of a plain model


@pytest.fixture(scope="module")
def max_kv_built(built):
    from dctms.schema.io import write_plan

    folder, _, _, model = built(*SETTINGS[0])
    plan = compile_plan(
        open_model(folder), CompileOptions(N, M, prefill_chunk=CHUNK, max_kv_size=MAX_KV)
    )
    write_plan(plan, folder / "max-kv.plan")
    return folder, plan, folder / "max-kv.plan", model


def mlx_lm_rotating(model, prompt: list[int], k: int):
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model, max_kv_size=MAX_KV)
    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=k,
        sampler=lambda x: mx.argmax(x, axis=-1),
        prefill_step_size=CHUNK,
        prompt_cache=cache,
    )
    return [int(t) for t, _ in steps], cache


def test_max_kv_size_is_a_ring_keeping_four_tokens(max_kv_built) -> None:
    from dctms.toolkit.caches import ring_slots

    _, plan, _, model = max_kv_built
    assert verify_plan(plan) == []
    _, cache = mlx_lm_rotating(model, prompt_ids(40), 4)
    assert {(type(c).__name__, c.max_size, c.keep) for c in cache} == {
        ("RotatingKVCache", MAX_KV, 4)
    }
    slots = ring_slots(MAX_KV, CHUNK, 4)
    assert slots == 48
    per_position = sum(c.nbytes // c.keys.shape[2] for c in cache)
    assert plan.envelope.kv == per_position * (slots + 2 * 4)  # ring + kept tokens and sinks
    kept = [s for s in plan.state if s.name.endswith(".keep")]
    assert len(kept) == 2 * plan.model.num_layers and all(s.shape[2] == 8 for s in kept)
    assert all(s.window.keep == 4 for s in plan.state if s.kind == "kv")


@pytest.mark.parametrize(
    "length",
    [pytest.param(p, marks=() if p == 50 else pytest.mark.slow) for p in (1, CHUNK, 30, 50)],
)
def test_runner_matches_mlx_lm_with_max_kv_size(max_kv_built, length, tmp_path) -> None:
    """Prompts inside and beyond the window (chunks at p0 >= W see mlx-lm's trimmed buffer)."""
    folder, _, path, model = max_kv_built
    prompt = prompt_ids(length)
    expected, _ = mlx_lm_rotating(model, prompt, K)
    plain, _ = mlx_lm_generate(model, prompt, K)
    if length >= MAX_KV:
        assert expected != plain  # not vacuous: the window changes mlx-lm's ids here
    proc = run_plan(path, folder, prompt, K, tmp_path / "report.json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["tokens"] == expected
    assert report["within_envelope"], report["observed"]
    print(
        f"max-kv-size {MAX_KV} L={length}: provable/observed {report['envelope_over_observed']:.4f}"
    )


def test_bad_max_kv_sizes_are_refused(ring_built, max_kv_built) -> None:
    folder, *_ = ring_built("gemma3-f32")
    with pytest.raises(DctmsError, match="mlx-lm ignores max_kv_size"):
        compile_plan(open_model(folder), CompileOptions(N, M, prefill_chunk=CHUNK, max_kv_size=20))
    plain = open_model(max_kv_built[0])
    for opts, needle in [
        (dict(prefill_chunk=2, max_kv_size=20), "a prefill chunk of at least 4"),
        (dict(prefill_chunk=CHUNK, max_kv_size=4), "a window above the kept tokens"),
    ]:
        with pytest.raises(DctmsError, match=needle):
            compile_plan(plain, CompileOptions(N, M, **opts))


def test_the_window_changes_the_reference(ring_built) -> None:
    """Not vacuous: the same weights with a window wider than N + M give other ids."""
    from mlx_lm.utils import load_model

    folder, *_, model = ring_built("gemma3-f32")
    wide = {**BASE, **RING_MODELS["gemma3-f32"], "sliding_window": 512}
    other = folder.parent / "wide"
    other.mkdir(exist_ok=True)
    (other / "config.json").write_text(json.dumps(wide))
    (other / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    windowed, _ = mlx_lm_generate(model, prompt_ids(N), K)
    full, _ = mlx_lm_generate(load_model(other)[0], prompt_ids(N), K)
    assert windowed != full


def test_a_ring_written_off_its_slots_is_rejected(ring_built) -> None:
    from msgspec.structs import replace

    _, plan, _, _ = ring_built("gemma3-f32")
    state = [
        replace(s, window=replace(s.window, slots=48)) if s.window is not None else s
        for s in plan.state
    ]
    problems = verify_plan(replace(plan, state=state))
    assert any(
        p.rule == "state_capacity" and "not modulo its 48 slots" in p.message for p in problems
    )


# ------------------------------------------------------------------ recurrent state (ArraysCache)

RECURRENT_MODELS = {
    "mamba-f32": {
        "model_type": "mamba",
        "torch_dtype": "float32",
        "hidden_size": 64,
        "intermediate_size": 128,
        "state_size": 8,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 8,
        "tie_word_embeddings": True,
    },
    "mamba2-f32": {
        "model_type": "mamba2",
        "torch_dtype": "float32",
        "num_heads": 4,
        "head_dim": 32,
        "hidden_size": 64,
        "intermediate_size": 128,
        "state_size": 16,
        "layer_norm_epsilon": 1e-5,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_limit": [0.0, 1000.0],
        "time_step_rank": "auto",
        "tie_word_embeddings": True,
    },
    # a hybrid: short-convolution layers (ArraysCache) between attention layers (KVCache)
    "lfm2-f32": {
        "model_type": "lfm2",
        "torch_dtype": "float32",
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 128,
        "block_multiple_of": 32,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "num_hidden_layers": 4,
        "full_attn_idxs": [1, 3],
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "tie_word_embeddings": True,
    },
}


@pytest.fixture(scope="module")
def recurrent_built(tmp_path_factory):
    from mlx_lm.utils import load_model

    from dctms.schema.io import write_plan
    from dctms.toolkit.tiny_model import write_tiny_model

    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            folder = tmp_path_factory.mktemp(f"recurrent-{name}")
            write_tiny_model(folder, {**BASE, **RECURRENT_MODELS[name]}, seed=7)
            plan = compile_plan(open_model(folder), CompileOptions(N, M, prefill_chunk=CHUNK))
            write_plan(plan, folder / "model.plan")
            cache[name] = (folder, plan, folder / "model.plan", load_model(folder)[0])
        return cache[name]

    return get


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=() if i == 0 else pytest.mark.slow)
        for i, n in enumerate(RECURRENT_MODELS)
    ],
)
def test_recurrent_state_is_mlx_lms_to_the_byte(recurrent_built, name) -> None:
    _, plan, _, model = recurrent_built(name)
    assert verify_plan(plan) == []
    _, cache = mlx_lm_generate(model, prompt_ids(20), 4)
    expected = 0
    for i, c in enumerate(cache):
        if type(c).__name__ == "ArraysCache":
            expected += c.nbytes  # fixed-size arrays: mlx-lm's own bytes, whatever the prompt
            for j, a in enumerate(c.cache):
                s = next(s for s in plan.state if s.name == f"kv.{i}.state{j}")
                assert (s.shape, s.dtype, s.recurrent) == (list(a.shape), MODELS_DTYPE, True)
        else:  # an attention layer of a hybrid: bytes per position x the plan's capacity
            expected += c.nbytes // c.keys.shape[2] * plan.bounds.kv_capacity
    assert plan.envelope.kv == expected


def test_show_and_bench_see_the_recurrent_state(recurrent_built) -> None:
    """The state is fixed bytes a decode step reads whole; nothing grows with the position."""
    from dctms.figures.cache_layout import cache_layout
    from dctms.views.show import show_text

    _, plan, _, _ = recurrent_built("mamba-f32")
    layout = cache_layout(plan)
    assert (layout.recurrent_bytes, layout.ring_bytes) == (plan.envelope.kv, 0)
    assert layout.bytes_per_position == 0 and layout.recurrent_layers == (0, 1)
    assert "recurrent state      2 of 2 layers, 11,264 bytes whatever the length" in show_text(plan)


MODELS_DTYPE = "float32"
RECURRENT_CASES = [(m, p) for m in RECURRENT_MODELS for p in (1, CHUNK + 1, 50)]


@pytest.mark.parametrize(
    ("name", "length"),
    [
        pytest.param(
            m, p, id=f"{m}-{p}", marks=() if (m, p) == RECURRENT_CASES[1] else pytest.mark.slow
        )
        for m, p in RECURRENT_CASES
    ],
)
def test_runner_matches_mlx_lm_with_recurrent_state(
    recurrent_built, name, length, tmp_path
) -> None:
    """Whole chunks through prefill, the rest and the last prompt token through decode."""
    folder, _, path, model = recurrent_built(name)
    prompt = prompt_ids(length)
    expected, _ = mlx_lm_generate(model, prompt, K)
    assert len(set(expected)) >= 4, f"degenerate reference: {expected}"
    proc = run_plan(path, folder, prompt, K, tmp_path / "report.json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["tokens"] == expected
    assert report["within_envelope"], report["observed"]
    print(f"{name} L={length}: provable/observed {report['envelope_over_observed']:.4f}")


def test_a_new_prompt_starts_from_an_empty_state(recurrent_built) -> None:
    """One session, two generations: the second is mlx-lm's with a fresh cache (the state reads as
    zeros at position 0), not a continuation of the first."""
    from dctms.runner.request import validate_request
    from dctms.runner.session import Session

    folder, plan, _, model = recurrent_built("mamba-f32")
    session = Session(plan, open_model(folder))
    for length in (40, 23):
        expected, _ = mlx_lm_generate(model, prompt_ids(length), 12)
        gen = session.generate(validate_request(plan, prompt_ids(length), 12))
        assert gen.tokens == expected, length


def test_a_fresh_state_not_marked_recurrent_is_rejected(recurrent_built) -> None:
    from msgspec.structs import replace

    _, plan, _, _ = recurrent_built("mamba-f32")
    state = [replace(s, recurrent=False) for s in plan.state]
    problems = verify_plan(replace(plan, state=state))
    assert any(
        p.rule == "bindings" and "of kind 'output' as 'state'" in p.message for p in problems
    )


@pytest.mark.slow
def test_fit_counts_the_quantised_cache(tmp_path: Path) -> None:
    """dctms fit with --kv-bits: the same budget holds more prompt tokens with a 4-bit cache,
    and the plan at the answer is a quantised one."""
    import dctms

    cfg = {**BASE, **MODELS["llama-bf16"], "num_key_value_heads": 4, "num_hidden_layers": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    plain = dctms.fit(tmp_path, "162.5MiB", output_tokens=16, prefill_chunk=CHUNK)
    quantised = dctms.fit(
        tmp_path, "162.5MiB", output_tokens=16, prefill_chunk=CHUNK, kv_bits=4, kv_group_size=64
    )
    assert plain.value is not None and quantised.value is not None
    assert quantised.value > plain.value
    assert quantised.plan.bounds.kv.bits == 4 and plain.plan.bounds.kv.bits is None
    assert quantised.plan.envelope.total <= quantised.budget


def test_speculative_decoding_over_a_ring_is_refused_in_one_line(ring_built, tmp_path) -> None:
    folder, *_ = ring_built("gemma3-f32")
    cmd = [sys.executable, "-m", "dctms.cli.main", "compile", str(folder), "-N", str(N), "-M"]
    cmd += [str(M), "--prefill-chunk", str(CHUNK), "--draft", str(folder), "--num-draft", "2"]
    cmd += ["-o", str(tmp_path / "x.plan")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "sliding-window or recurrent cache" in lines[0], proc.stderr
    assert not (tmp_path / "x.plan").exists()
