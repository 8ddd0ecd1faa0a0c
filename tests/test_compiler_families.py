"""The compiler over several mlx-lm families: exact M_KV and M_weights, refusals, determinism."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map

from dctms.schema.errors import DctmsError
from dctms.schema.model_folder import open_model
from dctms.schema.verify import verify_plan
from dctms.toolkit.compiler import CompileOptions, compile_plan

BASE = {
    "hidden_size": 128,
    "num_hidden_layers": 3,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
}

FAMILIES = {
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True},
    "llama": {"model_type": "llama", "head_dim": 32},
    "llama3-rope": {
        "model_type": "llama",
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    },
    "mistral": {"model_type": "mistral"},
    "qwen3": {"model_type": "qwen3", "head_dim": 48},
    "phi3": {"model_type": "phi3"},
    "starcoder2": {"model_type": "starcoder2", "norm_epsilon": 1e-5, "use_bias": True},
    "olmo2": {"model_type": "olmo2"},
}
QUANT = {"group_size": 32, "bits": 4}


def _config(family: str, dtype: str, quantized: bool) -> dict:
    cfg = {**BASE, **FAMILIES[family], "torch_dtype": dtype}
    if quantized:
        cfg["quantization"] = dict(QUANT)
    return cfg


def _write(tmp_path: Path, cfg: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def _reference_weight_bytes(cfg: dict, dtype: str) -> int:
    """What mlx-lm's convert writes: its own model instance cast to dtype, quantised by its rules."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    target = getattr(mx, dtype)
    model.update(
        tree_map(
            lambda v: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters(),
        )
    )
    if "quantization" in cfg:
        import mlx.nn as nn

        q = cfg["quantization"]
        predicate = getattr(model, "quant_predicate", None)

        def convert_rule(path, module):  # mlx_lm.utils.quantize_model's predicate
            if not hasattr(module, "to_quantized") or module.weight.shape[-1] % q["group_size"]:
                return False
            return predicate(path, module) if predicate else True

        nn.quantize(model, q["group_size"], q["bits"], class_predicate=convert_rule)
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def _kv_bytes(cfg: dict, capacity: int, itemsize: int, batch: int = 1) -> int:
    heads = cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * capacity * heads * head_dim * itemsize * batch


CASES = [(f, "bfloat16", False) for f in FAMILIES] + [
    ("qwen2", "float32", False),
    ("llama", "float16", True),
    ("qwen2", "bfloat16", True),
    ("mistral", "bfloat16", True),
]


# The quick loop (-m "not slow") keeps the first case; `make test` runs them all.
@pytest.mark.parametrize(
    ("family", "dtype", "quantized"),
    [
        pytest.param(
            f, d, q, id=f"{f}-{d}{'-q4' if q else ''}", marks=() if i == 0 else pytest.mark.slow
        )
        for i, (f, d, q) in enumerate(CASES)
    ],
)
def test_envelope_is_exact(tmp_path: Path, family: str, dtype: str, quantized: bool) -> None:
    cfg = _config(family, dtype, quantized)
    n, m, chunk, batch = 100, 60, 32, 1
    plan = compile_plan(
        open_model(_write(tmp_path, cfg)), CompileOptions(n, m, batch=batch, prefill_chunk=chunk)
    )
    assert verify_plan(plan) == []
    # N + M (or the padded prompt) plus the spare position that keeps every window a proper slice
    capacity = max(n + m, math.ceil(n / chunk) * chunk) + 1
    assert plan.bounds.kv_capacity == capacity == n + m + 1
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    assert plan.envelope.kv == _kv_bytes(cfg, capacity, itemsize, batch)
    assert plan.envelope.weights == _reference_weight_bytes(cfg, dtype)
    assert plan.envelope.total == (
        plan.envelope.weights
        + plan.envelope.kv
        + plan.envelope.persistent
        + plan.envelope.intermediate
        + plan.envelope.runtime
    )
    assert plan.envelope.intermediate == max(p.arena_bytes + p.slack_bytes for p in plan.phases)
    # the runner disables MLX's buffer cache on the CPU, so no cache-reuse slack is counted
    assert plan.target.allocator_slack == 0
    assert all(p.arena_bytes > 0 and p.slack_bytes == 0 for p in plan.phases)
    assert {p.name for p in plan.phases} == {"prefill", "decode"}
    assert plan.model.architecture == cfg["model_type"]


def test_batch_scales_the_cache(tmp_path: Path) -> None:
    cfg = _config("qwen2", "bfloat16", False)
    src = open_model(_write(tmp_path, cfg))
    one = compile_plan(src, CompileOptions(64, 32, batch=1, prefill_chunk=32))
    two = compile_plan(src, CompileOptions(64, 32, batch=2, prefill_chunk=32))
    assert two.envelope.kv == 2 * one.envelope.kv == _kv_bytes(cfg, 97, 2, batch=2)
    assert two.envelope.weights == one.envelope.weights


def test_padded_last_chunk_widens_the_cache(tmp_path: Path) -> None:
    # N = 100 in chunks of 64 pads to 128 positions, more than N + M = 110 (+ 1 spare).
    plan = compile_plan(
        open_model(_write(tmp_path, _config("qwen2", "float32", False))),
        CompileOptions(100, 10, prefill_chunk=64),
    )
    assert plan.bounds.kv_capacity == 129
    assert verify_plan(plan) == []


def test_weights_from_safetensors_headers(tmp_path: Path) -> None:
    from dctms.toolkit.tiny_model import write_tiny_model

    cfg = _config("llama", "float16", True)
    folder = write_tiny_model(tmp_path / "m", cfg)
    plan = compile_plan(open_model(folder), CompileOptions(32, 16, prefill_chunk=16))
    stored = 0
    for f in folder.glob("model*.safetensors"):
        raw = f.read_bytes()
        header = int.from_bytes(raw[:8], "little")
        stored += len(raw) - 8 - header
    assert plan.envelope.weights == stored == _reference_weight_bytes(cfg, "float16")
    assert plan.model.weights.count == len(json.loads(raw[8 : 8 + header])) - 1  # minus metadata


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"model_type": "no-such-architecture"}, "not supported yet"),
    ],
    ids=["unknown"],  # sliding-window and recurrent models are planned now (tests/test_caches.py)
)
def test_unsupported_families_exit_2(tmp_path: Path, config: dict, needle: str) -> None:
    cfg = {**BASE, **config}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dctms.cli.main",
            "compile",
            str(_write(tmp_path, cfg)),
            "-N",
            "16",
            "-M",
            "8",
            "-o",
            str(tmp_path / "x.plan"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.plan").exists()


def test_bad_options_are_refused(tmp_path: Path) -> None:
    src = open_model(_write(tmp_path, _config("qwen2", "float32", False)))
    for opts, needle in [
        (CompileOptions(0, 8), "input tokens"),
        (CompileOptions(8, 0), "output tokens"),
        (CompileOptions(8, 8, prefill_chunk=0), "prefill chunk"),
        (CompileOptions(8, 8, alignment=48), "power of two"),
    ]:
        with pytest.raises(DctmsError, match=needle):
            compile_plan(src, opts)


def test_missing_and_malformed_models(tmp_path: Path) -> None:
    with pytest.raises(DctmsError, match="no such file"):
        open_model(tmp_path / "absent")
    with pytest.raises(DctmsError, match="no config.json"):
        open_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DctmsError, match="not valid JSON"):
        open_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(DctmsError, match="model_type"):
        open_model(tmp_path)


def test_weights_that_do_not_match_the_config_are_refused(tmp_path: Path) -> None:
    from dctms.toolkit.tiny_model import write_tiny_model

    cfg = _config("qwen2", "float32", False)
    folder = write_tiny_model(tmp_path / "m", cfg, tokenizer=False)
    (folder / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 384}))
    with pytest.raises(DctmsError, match="mlp"):
        compile_plan(open_model(folder), CompileOptions(16, 8))


def test_bad_memory_size_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dctms.cli.main",
            "compile",
            str(_write(tmp_path, _config("qwen2", "float32", False))),
            "-N",
            "8",
            "-M",
            "8",
            "--memory",
            "lots",
            "-o",
            str(tmp_path / "x.plan"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "not a size" in proc.stderr
    assert not (tmp_path / "x.plan").exists()


@pytest.mark.skipif(mx.is_available(mx.gpu), reason="this machine's MLX has a GPU")
def test_gpu_backend_without_a_gpu_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dctms.cli.main",
            "compile",
            str(_write(tmp_path, _config("qwen2", "float32", False))),
            "-N",
            "8",
            "-M",
            "8",
            "--backend",
            "gpu",
            "-o",
            str(tmp_path / "x.plan"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "no GPU" in proc.stderr and proc.stderr.count("\n") == 1
