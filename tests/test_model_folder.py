"""Model folders as people have them, read by the one reader (dctms.schema.model_folder).

Sharded safetensors with an index, tied and untied embeddings, an eos list in
generation_config.json, weights stored in another dtype than the config says: each compiles and
runs unchanged, with mlx-lm's greedy tokens. Broken folders (a missing shard, a tensor stored
twice, data offsets outside the file) are one-line exit-2 errors.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import msgspec
import pytest

from dctms.runner.load import load_checked_plan
from dctms.runner.request import validate_request
from dctms.runner.session import Session
from dctms.runner.tokenize import eos_ids
from dctms.schema.errors import DctmsError
from dctms.schema.io import write_plan
from dctms.schema.model_folder import INDEX_NAME, open_model, open_model_folder
from dctms.toolkit.compiler import CompileOptions, compile_plan
from dctms.toolkit.tiny_model import write_tiny_model

CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 257,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "torch_dtype": "float32",
}
PROMPT = [(i * 31 + 7) % 256 for i in range(20)]
N, M, CHUNK = 32, 8, 8


def mlx_lm_greedy(folder: Path, prompt: list[int], max_tokens: int, stop: set[int]) -> list[int]:
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        out.append(int(token))
        if int(token) in stop:
            break
    return out


def run_plan(folder: Path, tmp: Path, prompt: list[int], stop: set[int] | None = None, **kw):
    plan = compile_plan(open_model(folder), CompileOptions(N, M, prefill_chunk=CHUNK, **kw))
    path = tmp / f"{folder.name}.plan"
    write_plan(plan, path)
    checked = load_checked_plan(path)
    session = Session(checked, open_model_folder(folder))
    return plan, session.generate(validate_request(checked, prompt, M, stop or set())).tokens


def shard(folder: Path, parts: int = 2, index: bool = True) -> None:
    """Split model.safetensors into ``parts`` HF-style shards (+ the index)."""
    weights = mx.load(str(folder / "model.safetensors"))
    names = sorted(weights)
    weight_map = {}
    for k in range(parts):
        file = f"model-{k + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {n: weights[n] for n in names[k::parts]}
        mx.save_safetensors(str(folder / file), chunk, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(chunk, file))
    (folder / "model.safetensors").unlink()
    if index:
        (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("tied", [True, False])
def test_sharded_folder_compiles_and_runs_like_one_file(tmp_path: Path, tied: bool) -> None:
    cfg = {**CONFIG, "tie_word_embeddings": tied}
    one = write_tiny_model(tmp_path / "one", cfg, tokenizer=False)
    sharded = write_tiny_model(tmp_path / "sharded", cfg, tokenizer=False)
    shard(sharded, parts=3)
    assert len(open_model_folder(sharded).weight_files) == 3
    plan_one, tokens_one = run_plan(one, tmp_path, PROMPT)
    plan_sharded, tokens_sharded = run_plan(sharded, tmp_path, PROMPT)
    names = {w.name for w in plan_sharded.model.weights.tensors}
    assert ("lm_head.weight" in names) is (not tied)
    assert plan_sharded.model.weights.layout_sha256 == plan_one.model.weights.layout_sha256
    assert tokens_sharded == tokens_one == mlx_lm_greedy(sharded, PROMPT, M, set())


def test_eos_list_in_generation_config_stops_generation(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "m", {**CONFIG, "tie_word_embeddings": True},
                              tokenizer=False)
    _, free = run_plan(folder, tmp_path, PROMPT)
    assert len(free) == M
    stop_at = free[3]
    # config.json says something else; generation_config.json's list wins (mlx-lm's rule).
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 255}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [999, stop_at]}))
    stop = eos_ids(folder)
    assert stop == {999, stop_at}
    _, stopped = run_plan(folder, tmp_path, PROMPT, stop)
    assert stopped == free[: free.index(stop_at) + 1]
    assert stopped == mlx_lm_greedy(folder, PROMPT, M, stop)


def test_eos_ids_from_config_and_tokenizer(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "m", {**CONFIG, "eos_token_id": 256}, tokenizer=True)
    assert eos_ids(folder) == {256}
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_ids(folder) == {7}
    from dctms.runner.tokenize import Tokenizer

    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert eos_ids(folder, Tokenizer(folder)) == {7, 256}


def test_run_with_tokens_stops_at_the_configs_eos(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "m", {**CONFIG, "tie_word_embeddings": True},
                              tokenizer=False)
    _, free = run_plan(folder, tmp_path, PROMPT)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "eos_token_id": free[2]}))
    plan = compile_plan(open_model(folder), CompileOptions(N, M, prefill_chunk=CHUNK))
    write_plan(plan, tmp_path / "eos.plan")
    argv = [sys.executable, "-m", "dctms.cli.main", "run", str(tmp_path / "eos.plan"),
            "--model", str(folder), "--tokens", ",".join(map(str, PROMPT))]
    proc = subprocess.run(argv, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ",".join(map(str, free[: free.index(free[2]) + 1]))
    proc = subprocess.run([*argv, "--ignore-eos"], capture_output=True, text=True)
    assert proc.stdout.strip() == ",".join(map(str, free))


def test_dtype_follows_the_weights(tmp_path: Path) -> None:
    """float32 weights under a config without a dtype (mlx-lm runs them as stored): compiled as
    float32, the runner's tokens equal mlx-lm's."""
    cfg = {**CONFIG, "tie_word_embeddings": True}
    folder = write_tiny_model(tmp_path / "m", cfg, tokenizer=False)
    del cfg["torch_dtype"]
    (folder / "config.json").write_text(json.dumps(cfg))
    plan, tokens = run_plan(folder, tmp_path, PROMPT)
    assert plan.bounds.dtype == "float32"
    assert {w.dtype for w in plan.model.weights.tensors} == {"float32"}
    assert all(w.stored_dtype is None for w in plan.model.weights.tensors)
    assert tokens == mlx_lm_greedy(folder, PROMPT, M, set())
    # A config alone keeps today's rule.
    assert compile_plan(open_model(folder / "config.json"), CompileOptions(N, M)).bounds.dtype == (
        "bfloat16"
    )


def test_mixed_dtypes_are_kept_per_tensor(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "m", {**CONFIG, "tie_word_embeddings": True},
                              tokenizer=False)
    weights = mx.load(str(folder / "model.safetensors"))
    weights = {k: v.astype(mx.float16) if "norm" in k else v for k, v in weights.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    plan, tokens = run_plan(folder, tmp_path, PROMPT)
    dtypes = {w.name: w.dtype for w in plan.model.weights.tensors}
    assert dtypes["model.norm.weight"] == "float16"
    assert dtypes["model.embed_tokens.weight"] == "float32"
    assert tokens == mlx_lm_greedy(folder, PROMPT, M, set())


def test_dtype_option_casts_and_counts_what_is_resident(tmp_path: Path) -> None:
    cfg = {**CONFIG, "torch_dtype": "bfloat16", "tie_word_embeddings": True}
    folder = write_tiny_model(tmp_path / "m", cfg, tokenizer=False)
    stored = compile_plan(open_model(folder), CompileOptions(N, M, prefill_chunk=CHUNK))
    plan, tokens = run_plan(folder, tmp_path, PROMPT, dtype="float32")
    assert plan.bounds.dtype == "float32"
    assert {(w.dtype, w.stored_dtype) for w in plan.model.weights.tensors} == {
        ("float32", "bfloat16")
    }
    assert plan.envelope.weights == 2 * stored.envelope.weights
    # mlx-lm on a float32 copy of the same weights gives the same greedy tokens.
    copy = tmp_path / "f32"
    copy.mkdir()
    (copy / "config.json").write_text((folder / "config.json").read_text())
    w = mx.load(str(folder / "model.safetensors"))
    mx.save_safetensors(str(copy / "model.safetensors"), {k: v.astype(mx.float32)
                                                          for k, v in w.items()})
    assert tokens == mlx_lm_greedy(copy, PROMPT, M, set())


# ---------------------------------------------------------------------------------- refusals


def _one_line_exit_2(tmp_path: Path, folder: Path, needle: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "compile", str(folder), "-N", "8", "-M", "8",
         "-o", str(tmp_path / "x.plan")],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert needle in proc.stderr, proc.stderr
    assert not (tmp_path / "x.plan").exists()


def test_missing_shard_is_refused(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "m", CONFIG, tokenizer=False)
    shard(folder, parts=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(DctmsError, match="names shard model-00002-of-00002.safetensors"):
        open_model(folder)
    _one_line_exit_2(tmp_path, folder, "which is not in")


def test_tensor_in_two_shards_is_refused(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "m", CONFIG, tokenizer=False)
    shard(folder, parts=2, index=False)
    first = mx.load(str(folder / "model-00001-of-00002.safetensors"))
    name = sorted(first)[0]
    second = mx.load(str(folder / "model-00002-of-00002.safetensors"))
    mx.save_safetensors(str(folder / "model-00002-of-00002.safetensors"),
                        {**second, name: first[name]})
    with pytest.raises(DctmsError, match=f"tensor {name} is stored twice"):
        open_model(folder).headers()
    _one_line_exit_2(tmp_path, folder, "stored twice")


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda e: e.update(data_offsets=[e["data_offsets"][0], e["data_offsets"][1] + 10**9]),
         "bytes of data"),
        (lambda e: e.update(data_offsets=[e["data_offsets"][0] + 10**9,
                                          e["data_offsets"][1] + 10**9]),
         "truncated or bad offsets"),
        (lambda e: e.update(shape=[e["shape"][0] + 1, *e["shape"][1:]]), "need"),
    ],
    ids=["length", "outside-file", "shape"],
)
def test_bad_header_offsets_are_refused(tmp_path: Path, edit, needle: str) -> None:
    folder = write_tiny_model(tmp_path / "m", CONFIG, tokenizer=False)

    def damage(header: dict) -> None:
        edit(header["model.norm.weight"])

    _rewrite_header(folder / "model.safetensors", damage)
    with pytest.raises(DctmsError, match="model.norm.weight"):
        open_model(folder).headers()
    _one_line_exit_2(tmp_path, folder, needle)


@pytest.mark.parametrize(("stored", "cast"), [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_a_cast_run_stays_within_the_envelope(tmp_path: Path, stored: str, cast: str) -> None:
    folder = write_tiny_model(tmp_path / "m", {**CONFIG, "torch_dtype": stored,
                                               "tie_word_embeddings": False}, tokenizer=False)
    plan = compile_plan(open_model(folder), CompileOptions(N, M, prefill_chunk=CHUNK, dtype=cast))
    write_plan(plan, tmp_path / "cast.plan")
    report = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "run", str(tmp_path / "cast.plan"), "--model",
         str(folder), "--tokens", ",".join(map(str, PROMPT)), "--report", str(report)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(report.read_text())["within_envelope"]


def test_cast_overshoot_is_what_one_stored_copy_in_flight_costs() -> None:
    from dctms.schema.sizes import cast_order, cast_overshoot
    from dctms.schema.types import WeightTensor

    big = WeightTensor("big", [1000], "bfloat16", 2000, stored_dtype="float32")  # stored 4000
    small = WeightTensor("small", [10], "bfloat16", 20, stored_dtype="float32")  # stored 40
    plain = WeightTensor("plain", [100], "float32", 400)
    assert [w.name for w in cast_order([small, plain, big])] == ["big", "small"]
    # big first: 2000 + 4000 of 2420 resident -> 3580 over; then small: 2020 + 40 -> none.
    assert cast_overshoot([small, plain, big]) == 3580
    assert cast_overshoot([plain]) == 0
    upcast = [WeightTensor(n, [1000], "float32", 4000, stored_dtype="bfloat16") for n in "ab"]
    # a: 4000 + 2000 <= 8000; b: 4000 + 4000 + 2000 (b's stored copy) -> 2000 over
    assert cast_overshoot(upcast) == 2000
    assert cast_overshoot(upcast[:1]) == 2000


def test_compile_refuses_a_cast_the_envelope_does_not_cover(tmp_path: Path) -> None:
    from dctms.schema.types import Envelope, Weights, WeightTensor
    from dctms.toolkit.compiler import check_cast_overshoot

    big = WeightTensor("big", [1000], "bfloat16", 2000, stored_dtype="float32")
    weights = Weights(1, 2000, "0" * 64, [big])
    env = Envelope(weights=2000, kv=1000, persistent=0, intermediate=1000, runtime=0, total=4000)
    with pytest.raises(DctmsError, match="exceed the resident weights by 4000 bytes"):
        check_cast_overshoot(weights, env)
    check_cast_overshoot(weights, msgspec.structs.replace(env, kv=3000))
