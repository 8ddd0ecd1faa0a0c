"""``dctms run`` refusals: one line on stderr, exit 2, no traceback, nothing run, no report written.

And exit 3 for a run whose observed MLX peak exceeds the provable part of M_max: the check is
unit-tested on ``build_report`` and end-to-end in-process through ``dctms.cli.main.main`` with
``mx.get_peak_memory`` monkeypatched (a real plan cannot be made too small and still verify).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import msgspec
import pytest
from conftest import TINY_QWEN2

from dctms.runner.session import Session
from dctms.schema.io import read_plan, write_plan

N, M, CHUNK = 32, 8, 16

CONFIG = dict(TINY_QWEN2)


def _build(folder: Path, config: dict, *, hash_weights: bool = False) -> Path:
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions, compile_plan
    from dctms.toolkit.tiny_model import write_tiny_model

    write_tiny_model(folder, config)
    plan = compile_plan(
        open_model(folder),
        CompileOptions(N, M, prefill_chunk=CHUNK, hash_weights=hash_weights),
    )
    write_plan(plan, folder / "model.plan")
    return folder / "model.plan"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, Path]:
    """(plan, folder) of a tiny qwen2 compiled with --hash-weights, N=32, M=8."""
    folder = tmp_path_factory.mktemp("refusal-model")
    return _build(folder, CONFIG, hash_weights=True), folder


@pytest.fixture
def copy_of(model, tmp_path):
    """A fresh copy of the model folder to damage."""

    def make(name: str = "copy") -> Path:
        dest = tmp_path / name
        shutil.copytree(model[1], dest)
        return dest

    return make


def dctms_run(*args: str, report: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dctms.cli.main", "run", *args]
    if report is not None:
        cmd += ["--report", str(report)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def assert_refused(proc: subprocess.CompletedProcess, *needles: str, report: Path | None = None):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("dctms run: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert proc.stdout == ""  # nothing was generated
    if report is not None:
        assert not report.exists()
    return lines[0]


def tokens(n: int) -> str:
    return ",".join(str((7 * i + 1) % 256) for i in range(n))


def test_a_good_run_works(model, tmp_path):
    plan, folder = model
    proc = dctms_run(
        str(plan), "--model", str(folder), "--tokens", tokens(5), "--max-tokens", str(M),
        "--ignore-eos", "--verify-weights", report=tmp_path / "r.json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().split(",")) == M
    assert json.loads((tmp_path / "r.json").read_text())["within_envelope"]


# ------------------------------------------------------------------------------- request bounds


def test_prompt_longer_than_n_is_refused_before_any_allocation(model, copy_of, tmp_path):
    plan, _ = model
    # The weights are garbage: had the runner read them (or allocated anything for them) the
    # refusal would be about the weights. It names both numbers.
    broken = copy_of()
    (broken / "model.safetensors").write_bytes(b"\xff" * 64)
    report = tmp_path / "r.json"
    proc = dctms_run(str(plan), "--model", str(broken), "--tokens", tokens(N + 1), report=report)
    line = assert_refused(proc, f"{N + 1} tokens", f"N = {N}", report=report)
    assert "-N" in line


def test_prompt_of_exactly_n_is_accepted(model):
    plan, folder = model
    proc = dctms_run(str(plan), "--model", str(folder), "--tokens", tokens(N), "--max-tokens", "2")
    assert proc.returncode == 0, proc.stderr


def test_max_tokens_above_m_is_refused(model, tmp_path):
    plan, folder = model
    report = tmp_path / "r.json"
    proc = dctms_run(
        str(plan), "--model", str(folder), "--tokens", tokens(3), "--max-tokens", str(M + 1),
        report=report,
    )  # fmt: skip
    assert_refused(proc, f"--max-tokens {M + 1}", f"M = {M}", report=report)


@pytest.mark.parametrize(("max_tokens", "needle"), [("0", "at least 1"), ("-3", "at least 1")])
def test_max_tokens_below_one_is_refused(model, max_tokens, needle):
    plan, folder = model
    proc = dctms_run(
        str(plan), "--model", str(folder), "--tokens", "1", f"--max-tokens={max_tokens}"
    )
    assert_refused(proc, needle)


@pytest.mark.parametrize(
    ("ids", "needle"),
    [("1,2,257", "token 2 is 257"), ("5,-1", "token 1 is -1"), ("1,x", "comma-separated")],
)
def test_bad_token_ids_are_refused(model, ids, needle):
    plan, folder = model
    proc = dctms_run(str(plan), "--model", str(folder), f"--tokens={ids}")
    assert_refused(proc, needle)


# ------------------------------------------------------------------------------- weights folder


def test_missing_weights_folder(model, tmp_path):
    plan, _ = model
    missing = tmp_path / "nowhere"
    proc = dctms_run(str(plan), "--model", str(missing), "--tokens", "1")
    assert_refused(proc, str(missing), "not found")


def test_folder_without_safetensors(model, copy_of):
    plan, _ = model
    folder = copy_of()
    (folder / "model.safetensors").unlink()
    proc = dctms_run(str(plan), "--model", str(folder), "--tokens", "1")
    assert_refused(proc, "no model*.safetensors")


def test_folder_without_config(model, copy_of):
    plan, _ = model
    folder = copy_of()
    (folder / "config.json").unlink()
    proc = dctms_run(str(plan), "--model", str(folder), "--tokens", "1")
    assert_refused(proc, "no config.json")


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        ("garbage", "not a safetensors file"),
        ("empty", "too short"),
        ("directory", "cannot read"),
        ("truncated", "truncated or bad offsets"),
        ("config-json", "config.json: not valid JSON"),  # the compiler's wording too
    ],
)
def test_unreadable_weights_or_config(model, copy_of, damage, needle):
    plan, _ = model
    folder = copy_of()
    weights = folder / "model.safetensors"
    if damage == "garbage":
        weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    elif damage == "empty":
        weights.write_bytes(b"")
    elif damage == "directory":  # unreadable even for root
        weights.unlink()
        weights.mkdir()
    elif damage == "truncated":  # header intact, data cut: found from the header and the file size
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) - 1000])
    elif damage == "config-json":
        (folder / "config.json").write_text("{ not json")
    proc = dctms_run(str(plan), "--model", str(folder), "--tokens", "1", "--max-tokens", "2")
    assert_refused(proc, needle)


def test_changed_config_is_refused(model, copy_of):
    plan, _ = model
    folder = copy_of()
    config = json.loads((folder / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5  # same weights, different model
    (folder / "config.json").write_text(json.dumps(config))
    proc = dctms_run(str(plan), "--model", str(folder), "--tokens", "1")
    assert_refused(proc, "config.json", "differs from the config the plan was compiled for")


def test_reordered_config_is_the_same_config(model, copy_of):
    plan, _ = model
    folder = copy_of()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(reversed(config.items())), indent=4))
    proc = dctms_run(str(plan), "--model", str(folder), "--tokens", "1", "--max-tokens", "2")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("change", "first_differing"),
    [
        # sorted weight names: embed_tokens, layers.0.input_layernorm, layers.0.mlp.down_proj, ...
        (
            {"intermediate_size": 192},
            "weight model.layers.0.mlp.down_proj.weight is float32[64, 192]",
        ),
        ({"torch_dtype": "bfloat16"}, "weight model.embed_tokens.weight is bfloat16[257, 64]"),
        ({"tie_word_embeddings": False}, "weight lm_head.weight is not in the plan"),
    ],
)
def test_weights_of_another_shape_or_dtype(model, tmp_path, change, first_differing):
    """A second tiny model whose config.json is replaced by the plan's: only the weights differ."""
    from dctms.toolkit.tiny_model import write_tiny_model

    plan, folder = model
    other = tmp_path / "other"
    write_tiny_model(other, {**CONFIG, **change})
    shutil.copy(folder / "config.json", other / "config.json")
    proc = dctms_run(str(plan), "--model", str(other), "--tokens", "1")
    line = assert_refused(proc, first_differing)
    assert "the plan has" in line or "not in the plan" in line


def test_missing_weight_is_named(model, copy_of):
    plan, _ = model
    folder = copy_of()
    weights = mx.load(str(folder / "model.safetensors"))
    del weights["model.norm.weight"]
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    proc = dctms_run(str(plan), "--model", str(folder), "--tokens", "1")
    assert_refused(proc, "weight model.norm.weight is missing")


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # inside the last tensor's data: the header (and so the fingerprint) is intact
    path.write_bytes(bytes(data))


def test_verify_weights_catches_a_tampered_byte(model, copy_of):
    plan, _ = model
    folder = copy_of()
    _flip_last_byte(folder / "model.safetensors")
    proc = dctms_run(str(plan), "--model", str(folder), "--tokens", "1", "--verify-weights")
    assert_refused(proc, "model.safetensors: sha256", "differs from the plan's")
    # without --verify-weights only the layout is checked, and the run goes ahead
    proc = dctms_run(str(plan), "--model", str(folder), "--tokens", "1", "--max-tokens", "2")
    assert proc.returncode == 0, proc.stderr


def test_verify_weights_needs_a_plan_with_hashes(tmp_path):
    folder = tmp_path / "nohash"
    plan = _build(folder, CONFIG, hash_weights=False)
    proc = dctms_run(str(plan), "--model", str(folder), "--tokens", "1", "--verify-weights")
    assert_refused(proc, "--hash-weights")


# ------------------------------------------------------------------------------- plan compatibility


def test_plan_from_another_mlx_minor_version(model, tmp_path):
    plan_path, folder = model
    plan = read_plan(plan_path)
    old = msgspec.structs.replace(
        plan, generator=msgspec.structs.replace(plan.generator, mlx="0.31.2")
    )
    other = tmp_path / "old-mlx.plan"
    write_plan(old, other)
    read_plan(other)  # still a valid plan: the refusal is the runner's, not the verifier's
    proc = dctms_run(str(other), "--model", str(folder), "--tokens", "1")
    assert_refused(proc, "mlx 0.31.2", f"mlx {mx.__version__}")


def test_plan_from_another_mlx_patch_version_runs(model, tmp_path):
    plan_path, folder = model
    plan = read_plan(plan_path)
    major, minor, *_ = mx.__version__.split(".")
    patched = msgspec.structs.replace(
        plan, generator=msgspec.structs.replace(plan.generator, mlx=f"{major}.{minor}.999")
    )
    other = tmp_path / "patch.plan"
    write_plan(patched, other)
    proc = dctms_run(str(other), "--model", str(folder), "--tokens", "1", "--max-tokens", "2")
    assert proc.returncode == 0, proc.stderr


def test_invalid_plan_is_refused(model, tmp_path):
    _, folder = model
    bad = tmp_path / "bad.plan"
    bad.write_text("{}")
    proc = dctms_run(str(bad), "--model", str(folder), "--tokens", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("dctms run: ")


# ------------------------------------------------------------------------------- exit 3


def _fake_generation():
    from dctms.runner.session import Generation

    return Generation(tokens=[1, 2, 3], ttft_s=0.01, token_latencies_s=[0.005, 0.005])


def test_report_flags_a_peak_above_the_provable_envelope(model):
    from dctms.runner.report import build_report

    plan = read_plan(model[0])
    provable = plan.envelope.provable
    at = build_report(plan, _fake_generation(), provable, 10, [(0.0, 10)], None)
    over = build_report(plan, _fake_generation(), provable + 1, 10, [(0.0, 10)], None)
    assert at["within_envelope"] and at["envelope_over_observed"] == 1.0
    assert not over["within_envelope"] and over["envelope_over_observed"] < 1.0
    assert over["provable_bytes"] == provable
    # RSS is compared with the whole of M_max (runtime allowance included)
    total = plan.envelope.total
    assert build_report(plan, _fake_generation(), 1, total, [], None)["rss_within_m_max"]
    assert not build_report(plan, _fake_generation(), 1, total + 1, [], None)["rss_within_m_max"]


def test_summary_survives_a_zero_peak(model):
    from dctms.cli.run_summary import summary
    from dctms.runner.report import build_report

    plan = read_plan(model[0])
    text = summary(build_report(plan, _fake_generation(), 0, 10, [], None))
    assert "n/a" in text


@pytest.fixture
def restore_mlx_limits():
    """In-process sessions set MLX's memory and cache limits from the plan: put them back."""
    memory = mx.get_memory_limit()
    cache = mx.set_cache_limit(0)
    mx.set_cache_limit(cache)
    yield
    mx.set_memory_limit(memory)
    mx.set_cache_limit(cache)


@pytest.mark.parametrize("excess", [0, 1])
def test_exit_3_when_observed_peak_exceeds_the_envelope(
    model, tmp_path, monkeypatch, capsys, restore_mlx_limits, excess
):
    from dctms.cli.main import main
    from dctms.cli.run_summary import EXIT_OVER_ENVELOPE

    plan_path, folder = model
    provable = read_plan(plan_path).envelope.provable
    # The session's own peak (MLX's peak above what the process held before it) is the figure.
    monkeypatch.setattr(Session, "observed_peak", lambda self: provable + excess)
    report = tmp_path / "r.json"
    argv = [
        "run", str(plan_path), "--model", str(folder), "--tokens", tokens(4),
        "--max-tokens", "3", "--ignore-eos", "--report", str(report),
    ]  # fmt: skip
    rc = main(argv)
    err = capsys.readouterr().err
    data = json.loads(report.read_text())
    assert data["observed"]["mlx_peak_bytes"] == provable + excess
    if excess:
        assert rc == EXIT_OVER_ENVELOPE == 3
        assert not data["within_envelope"]
        assert f"observed MLX peak {provable + 1} bytes exceeds" in err
        assert f"provable peak {provable} bytes" in err
        assert "within envelope: NO" in err
    else:  # exactly at the envelope is within it
        assert rc == 0
        assert data["within_envelope"]
        assert "exceeds" not in err


def test_text_prompt_needs_a_tokenizer(model, copy_of):
    plan, _ = model
    folder = copy_of()
    (folder / "tokenizer.json").unlink()
    proc = dctms_run(str(plan), "--model", str(folder), "--prompt", "hello")
    assert_refused(proc, "no tokenizer.json", "--tokens")


@pytest.mark.parametrize(
    "header",
    [
        b"[1, 2]",
        b'{"w": {"dtype": "F32"}}',
        b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": "x"}}',
    ],
    ids=["list", "no-offsets", "bad-offsets"],
)
def test_malformed_safetensors_header_is_one_line(model, copy_of, header):
    import struct

    plan, _ = model
    folder = copy_of()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    proc = dctms_run(str(plan), "--model", str(folder), "--tokens", "1")
    assert_refused(proc, "model.safetensors")


@pytest.mark.skipif(mx.is_available(mx.gpu), reason="this machine's MLX has a GPU")
def test_gpu_plan_without_a_gpu_is_refused(model, tmp_path):
    plan_path, folder = model
    plan = read_plan(plan_path)
    # a GPU plan records no run-ahead (it is not modelled there)
    target = msgspec.structs.replace(plan.target, backend="gpu", run_ahead_dispatches=0)
    gpu = msgspec.structs.replace(plan, target=target)
    # the GPU runner process's baseline is larger (the verifier's runtime_floor re-derives it)
    extra = 128 * 2**20
    env = gpu.envelope
    gpu = msgspec.structs.replace(gpu, envelope=msgspec.structs.replace(
        env, runtime=env.runtime + extra, total=env.total + extra,
        free=None if env.free is None else env.free - extra))  # fmt: skip
    other = tmp_path / "gpu.plan"
    write_plan(gpu, other)
    proc = dctms_run(str(other), "--model", str(folder), "--tokens", "1")
    assert_refused(proc, "gpu backend", "no GPU")
