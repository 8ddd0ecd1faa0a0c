"""Per-rank plans (issue 18): mlx-lm's own pipeline(group) / shard(group), collectives as ops, and
runs of two local ring ranks under mlx.launch.

The compile tests trace a 3-layer random qwen2 in this process (a fraction of a second per rank);
the run tests start two ranks with ``dctms run --ranks 2`` and are marked slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import TINY_QWEN2

from dctms.schema.errors import DctmsError, InternalError
from dctms.schema.io import read_plan
from dctms.schema.model_folder import open_model_folder
from dctms.toolkit.compiler import CompileOptions, compile_plan
from dctms.toolkit.kinds.distributed import balanced_split, compile_ranks, layer_costs, predict
from dctms.toolkit.kinds.rank import Call, rewrite_collectives
from dctms.toolkit.tiny_model import write_tiny_model
from dctms.toolkit.trace import TracedBinding, TracedOp, TracedPhase, TracedTensor

N, M = 12, 6
PROMPT = "5,17,99,3,250,42,7"
COLLECTIVE = ("AllReduce", "AllGather", "Send", "Recv")


@pytest.fixture(scope="module")
def model3(tmp_path_factory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("q3") / "m", dict(TINY_QWEN2, num_hidden_layers=3)
    )


def _opts(**kw) -> CompileOptions:
    return CompileOptions(input_tokens=N, output_tokens=M, pack_seconds=0.0, **kw)


@pytest.fixture(scope="module")
def single(model3):
    return compile_plan(open_model_folder(model3), _opts())


@pytest.fixture(scope="module")
def pipeline(model3):
    return compile_ranks(open_model_folder(model3), _opts(ranks=2, parallel="pipeline"))


@pytest.fixture(scope="module")
def tensor(model3):
    return compile_ranks(open_model_folder(model3), _opts(ranks=2, parallel="tensor"))


def _collectives(phase) -> list[tuple[str, list]]:
    return [(op.primitive, op.args) for op in phase.ops if op.primitive in COLLECTIVE]


def _layer_weight_bytes(plan) -> int:
    return sum(w.bytes for w in plan.model.weights.tensors if ".layers." in w.name)


def test_pipeline_ranks_hold_their_layers_and_pass_h_along(pipeline, single) -> None:
    r0, r1 = pipeline
    # mlx-lm splits in reverse: 3 layers over 2 ranks -> rank 0 runs layers 1-2, rank 1 layer 0.
    assert (r0.distributed.layers, r1.distributed.layers) == ([1, 3], [0, 1])
    assert r0.distributed.split == r1.distributed.split == [2, 1]
    assert r0.model.num_layers == 3 and len([s for s in r0.state if s.kind == "kv"]) == 4
    for phase in r0.phases:  # the last stage receives h from rank 1, then shares its result
        assert sorted(_collectives(phase)) == [("AllGather", []), ("Recv", [1])]
    for phase in r1.phases:
        assert sorted(_collectives(phase)) == [("AllGather", []), ("Send", [0])]
    # Together the ranks hold every layer's weights exactly once; each skips the other's.
    assert _layer_weight_bytes(r0) + _layer_weight_bytes(r1) == _layer_weight_bytes(single)
    held0 = {w.name for w in r0.model.weights.tensors}
    assert set(r0.distributed.skipped_weights) == (
        {w.name for w in r1.model.weights.tensors} - held0
    )
    assert all(".layers.0." in n for n in r0.distributed.skipped_weights)


def test_tensor_ranks_hold_shards_and_all_sum_twice_per_layer(tensor, single) -> None:
    for r, plan in enumerate(tensor):
        assert plan.distributed.rank == r and plan.distributed.layers == [0, 3]
        for phase in plan.phases:  # o_proj and down_proj of each of the 3 layers
            assert _collectives(phase) == [("AllReduce", ["sum"])] * 6
        shards = {w.name: w.shard for w in plan.model.weights.tensors if w.shard is not None}
        q = shards["model.layers.0.self_attn.q_proj.weight"]
        o = shards["model.layers.0.self_attn.o_proj.weight"]
        assert (q.axis, o.axis, q.parts, q.index) == (0, 1, 2, r)  # all-to-sharded / sharded-to-all
        assert "model.layers.0.self_attn.o_proj.bias" not in shards  # replicated
        assert "model.embed_tokens.weight" not in shards
    # The sharded projections are halved, the rest replicated; the KV cache halves (kv heads / 2).
    assert tensor[0].envelope.kv * 2 == single.envelope.kv
    assert tensor[0].envelope.weights < single.envelope.weights
    assert tensor[0].model.weights.layout_sha256 == tensor[1].model.weights.layout_sha256


def test_rank_plans_roundtrip_and_show_every_rank(tmp_path, pipeline) -> None:
    from dctms.schema.io import write_plan
    from dctms.schema.ranks import read_rank_plans

    for plan in pipeline:
        write_plan(plan, tmp_path / f"rank{plan.distributed.rank}.plan")
    assert read_rank_plans(tmp_path) == [read_plan(tmp_path / f"rank{r}.plan") for r in (0, 1)]
    out = _dctms("show", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "rank 0 of 2, pipeline parallel: layers 1-2 of 3" in out.stdout
    assert "rank 1 of 2, pipeline parallel: layers 0 of 3" in out.stdout
    assert "collectives in decode    1 AllGather, 1 Send" in out.stdout
    # A folder whose rank 1 is missing is one line, exit 2.
    (tmp_path / "rank1.plan").unlink()
    out = _dctms("show", str(tmp_path))
    assert out.returncode == 2 and "rank1.plan: missing" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_the_verifier_rejects_broken_rank_plans(pipeline, tensor) -> None:
    from msgspec.structs import replace

    from dctms.schema.verify import verify_plan

    def rules(plan) -> set[str]:
        return {p.rule for p in verify_plan(plan)}

    assert rules(pipeline[1]) == rules(tensor[0]) == set()
    r1 = pipeline[1]
    decode = next(p for p in r1.phases if p.name == "decode")
    k = next(i for i, op in enumerate(decode.ops) if op.primitive == "Send")
    ops = list(decode.ops)
    ops[k] = replace(ops[k], args=[1])  # rank 1 sending to itself
    broken = replace(r1, phases=[p if p is not decode else replace(p, ops=ops) for p in r1.phases])
    assert "distributed" in rules(broken)
    assert "distributed" in rules(replace(r1, distributed=replace(r1.distributed, layers=[0, 2])))
    t0 = tensor[0]
    ws = t0.model.weights
    i = next(i for i, w in enumerate(ws.tensors) if w.shard is not None)
    bad = list(ws.tensors)
    bad[i] = replace(bad[i], shard=replace(bad[i].shard, index=2))
    broken = replace(t0, model=replace(t0.model, weights=replace(ws, tensors=bad)))
    assert "distributed" in rules(broken)


def test_a_marker_that_is_not_its_collective_is_an_internal_error() -> None:
    t = {i: TracedTensor(i, (1, 4), "float32") for i in ("x", "tag", "y")}
    phase = TracedPhase(
        "decode",
        1,
        [
            TracedBinding("x", "input", "tokens", (1, 4), "float32"),
            TracedBinding("tag", "weight", "collective.00000", (), "float32"),
        ],
        [TracedBinding("y", "output", "next_token", (1, 4), "float32")],
        [],
        [TracedOp("Multiply", [], ("x", "tag"), ("y",))],  # an all_sum marker is an Add
        t,
    )
    import mlx.core as mx

    with pytest.raises(InternalError, match="collective 0 \\(all_sum\\) traced as Multiply"):
        rewrite_collectives(phase, [Call("all_sum", None, mx.float32)])
    good = TracedPhase(
        *[getattr(phase, f) for f in ("name", "tokens", "inputs", "outputs")],
        [],
        [TracedOp("Add", [], ("x", "tag"), ("y",))],
        t,
    )
    out = rewrite_collectives(good, [Call("all_sum", None, mx.float32)])
    assert [(o.primitive, o.inputs) for o in out.ops] == [("AllReduce", ("x",))]
    assert [b.name for b in out.inputs] == ["tokens"] and "tag" not in out.tensors
    with pytest.raises(InternalError, match="made 1 of the 2 collectives"):
        rewrite_collectives(good, [Call("all_sum", None, mx.float32)] * 2)


def test_balanced_split_minimises_the_largest_rank() -> None:
    # Rank 0 carries 100 fixed bytes more: it gets fewer layers than mlx-lm's count split.
    split, worst = balanced_split([10, 10, 10, 10], [100, 0])
    assert split == (1, 3) and worst == 110
    assert predict((1, 3), [10, 10, 10, 10], [100, 0]) == (110, 30)
    assert max(predict((2, 2), [10, 10, 10, 10], [100, 0])) == 120
    # Heavy first layers: rank 1 (the first layers) takes fewer of them.
    assert balanced_split([50, 10, 10, 10, 10], [0, 0])[0] == (4, 1)


def test_layer_costs_are_read_from_the_plans(pipeline) -> None:
    per_layer, fixed = layer_costs(pipeline)
    r0, r1 = pipeline
    assert per_layer[0] == _layer_weight_bytes(r1) + r1.envelope.kv
    assert fixed[0] + per_layer[1] + per_layer[2] == r0.envelope.total


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--parallel", "tensor"], "--parallel needs --ranks of 2 or more"),
        (["--ranks", "2"], "--ranks 2 needs --parallel pipeline or tensor"),
        (
            ["--ranks", "2", "--parallel", "pipeline", "--split", "1,1,1"],
            "--split needs 2 positive",
        ),
        (["--ranks", "2", "--parallel", "tensor", "--split", "memory"], "pipeline only"),
        (["--ranks", "3", "--parallel", "tensor"], "Cannot shard"),
    ],
)
def test_bad_rank_options_are_one_line(model3, tmp_path, extra, message) -> None:
    out = _dctms("compile", str(model3), "-N", "8", "-M", "4", "-o", str(tmp_path / "o"), *extra)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o" / "rank0.plan").exists()


def test_a_model_without_pipeline_is_refused(tmp_path) -> None:
    config = dict(TINY_QWEN2, model_type="llama", num_hidden_layers=2)
    config.pop("eos_token_id")
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = _dctms(
        "compile",
        str(tmp_path),
        "-N",
        "8",
        "-M",
        "4",
        "--ranks",
        "2",
        "--parallel",
        "pipeline",
        "-o",
        str(tmp_path / "o"),
    )
    assert out.returncode == 2 and "does not support pipelining" in out.stderr


# ------------------------------------------------------------------------------------ runs


def _dctms(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    return subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _compile_two_ranks(model: Path, mode: str, plans: Path) -> subprocess.CompletedProcess:
    """``dctms compile MODEL -N N -M M --ranks 2 --parallel MODE -o PLANS``."""
    return _dctms(
        "compile", str(model), "-N", str(N), "-M", str(M), "-q",
        "--ranks", "2", "--parallel", mode, "-o", str(plans),
    )  # fmt: skip


@pytest.fixture(scope="module")
def single_ids(model3, tmp_path_factory) -> list[int]:
    folder = tmp_path_factory.mktemp("single")
    assert (
        _dctms(
            "compile", str(model3), "-N", str(N), "-M", str(M), "-q", "-o", str(folder / "p.plan")
        ).returncode
        == 0
    )
    out = _dctms("run", str(folder / "p.plan"), "--model", str(model3), "--tokens", PROMPT)
    assert out.returncode == 0, out.stderr
    return [int(t) for t in out.stdout.strip().split(",")]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_two_ranks_give_the_single_process_ids_within_their_envelopes(
    mode, model3, single_ids, tmp_path
) -> None:
    plans = tmp_path / "plans"
    out = _compile_two_ranks(model3, mode, plans)
    assert out.returncode == 0, out.stderr
    report = tmp_path / "report.json"
    out = _dctms(
        "run",
        str(plans),
        "--ranks",
        "2",
        "--model",
        str(model3),
        "--tokens",
        PROMPT,
        "--rank-timeout",
        "60",
        "--report",
        str(report),
    )
    assert out.returncode == 0, out.stderr
    assert [int(t) for t in out.stdout.strip().split(",")] == single_ids
    doc = json.loads(report.read_text())
    for r in (0, 1):
        rank = doc["per_rank"][str(r)]
        assert rank["status"] == "ok" and rank["tokens"] == single_ids
        plan = read_plan(plans / f"rank{r}.plan")
        assert 0 < rank["observed"]["mlx_peak_bytes"] <= plan.envelope.provable


@pytest.mark.slow
def test_quantised_tensor_ranks_cut_packed_weights_scales_and_biases(tmp_path) -> None:
    config = dict(TINY_QWEN2, quantization={"group_size": 32, "bits": 4})
    model = write_tiny_model(tmp_path / "q", config)
    plans = tmp_path / "plans"
    assert (
        _dctms(
            "compile", str(model), "-N", "8", "-M", "4", "-q", "-o", str(tmp_path / "p.plan")
        ).returncode
        == 0
    )
    single = _dctms("run", str(tmp_path / "p.plan"), "--model", str(model), "--tokens", "1,2,3")
    assert single.returncode == 0, single.stderr
    out = _dctms("compile", str(model), "-N", "8", "-M", "4", "-q", "--ranks", "2",
                 "--parallel", "tensor", "-o", str(plans))  # fmt: skip
    assert out.returncode == 0, out.stderr
    shards = {w.name: w.shard for w in read_plan(plans / "rank1.plan").model.weights.tensors}
    down = "model.layers.0.mlp.down_proj"
    assert {shards[f"{down}.{p}"].axis for p in ("weight", "scales", "biases")} == {1}
    out = _dctms("run", str(plans), "--ranks", "2", "--model", str(model), "--tokens", "1,2,3",
                 "--rank-timeout", "60")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout == single.stdout


@pytest.mark.slow
def test_a_rank_whose_weights_differ_refuses_and_the_other_stops(model3, tmp_path) -> None:
    import mlx.core as mx

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in model3.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    weights = mx.load(str(bad / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"  # rank 1's layer (pipeline)
    weights[name] = weights[name][:-8]
    mx.save_safetensors(str(bad / "model.safetensors"), weights, metadata={"format": "mlx"})
    plans = tmp_path / "plans"
    assert _compile_two_ranks(model3, "pipeline", plans).returncode == 0
    out = _dctms(
        "run",
        str(plans),
        "--ranks",
        "2",
        "--model",
        str(bad),
        "--tokens",
        PROMPT,
        "--rank-timeout",
        "60",
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert f"rank 1 refused: {bad}: weight {name} is float32[120, 64]" in out.stderr
    # rank 0 stops after the exchange of checks, before allocating; it says so itself unless
    # mlx.launch ends it first (once rank 1 has exited), so the wrapper's line is what is sure
    assert "; the other ranks stopped before allocating" in out.stderr
    assert out.stdout == ""


@pytest.mark.slow
def test_a_rank_left_alone_stops_after_its_bounded_wait(pipeline, tmp_path, model3) -> None:
    from dctms.schema.io import write_plan

    for plan in pipeline:
        write_plan(plan, tmp_path / f"rank{plan.distributed.rank}.plan")
    hostfile = tmp_path / "hosts.json"
    from dctms.cli.distributed import free_ports

    port = free_ports(2)
    # Rank 1 never starts: rank 0 cannot join the ring.
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    env = dict(os.environ, MLX_RANK="0", MLX_HOSTFILE=str(hostfile))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dctms.cli.main",
            "run",
            str(tmp_path),
            "--model",
            str(model3),
            "--tokens",
            PROMPT,
            "--launched",
            "--rank-reports",
            str(tmp_path),
            "--rank-timeout",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode != 0
    assert "no answer from the other ranks within 3 s while joining the group" in out.stderr
    assert json.loads((tmp_path / "rank0.json").read_text())["status"] == "no_answer"


def test_judge_needs_every_rank_ok_and_the_same_tokens() -> None:
    from dctms.cli.distributed import judge

    ok = {"status": "ok", "tokens": [1, 2], "within_envelope": True}
    assert judge({0: ok, 1: ok}, 2) == (0, "")
    assert judge({0: ok}, 2)[0] == 4
    assert judge({0: ok, 1: dict(ok, tokens=[1, 3])}, 2) == (
        1,
        "the ranks generated different tokens",
    )
    over = dict(ok, within_envelope=False, observed={"mlx_peak_bytes": 9}, provable_bytes=8)
    assert judge({0: ok, 1: over}, 2)[0] == 3
    assert judge({0: {"status": "refused", "message": "m"}, 1: ok}, 2)[0] == 2
    assert Counter(judge({0: ok}, 3)[1].split())["report"] == 1
    with pytest.raises(KeyError):
        judge({0: {"status": "ok"}}, 1)  # a malformed report is a bug, not a verdict


def test_compile_refuses_a_split_that_does_not_sum(model3) -> None:
    with pytest.raises(DctmsError, match="--split"):
        compile_plan(open_model_folder(model3), _opts(ranks=2, parallel="pipeline", split=(1, 1)))


@pytest.fixture(scope="module")
def short_bound(model3, tmp_path_factory) -> Path:
    """A single-process plan and per-rank pipeline plans of model3 at N 32 (chunk 16)."""
    root = tmp_path_factory.mktemp("short")
    argv = ["compile", str(model3), "-N", "32", "-M", "4", "--prefill-chunk", "16", "-q"]
    assert _dctms(*argv, "-o", str(root / "single.plan")).returncode == 0
    extra = ["--ranks", "2", "--parallel", "pipeline", "-o", str(root / "pipeline")]
    assert _dctms(*argv, *extra).returncode == 0
    return root


@pytest.mark.parametrize("length", [3, 16, 25])
def test_pipeline_ranks_run_prompts_shorter_than_the_bound(model3, short_bound, length) -> None:
    """Issue 35: per-rank pipeline plans (N 32) with a 3- or 16-token prompt stopped with "Shapes
    (1,32,1) and (1,16,1) cannot be broadcast": the rank that receives the activations made its
    Recv at the bound's shape at every length point. Its shape now follows the lengths (an affine
    place on the Recv output), and the ranks give the single-process ids at several lengths."""
    prompt = ",".join(str((7 * i + 3) % 250) for i in range(length))
    ids = {}
    for name, ranks in (
        ("single.plan", []),
        ("pipeline", ["--ranks", "2", "--rank-timeout", "60"]),
    ):
        run = ["run", str(short_bound / name), "--model", str(model3), "--tokens", prompt]
        proc = _dctms(*run, "--max-tokens", "4", *ranks)
        assert proc.returncode == 0, proc.stderr
        ids[name] = proc.stdout.strip()
    assert ids["pipeline"] == ids["single.plan"] and ids["pipeline"]
    rank0 = read_plan(short_bound / "pipeline" / "rank0.plan")  # runs the last layers: receives
    recv = [t for p in rank0.phases for op in p.ops if op.primitive == "Recv" for t in op.outputs]
    placed = {a for p in rank0.phases if p.lengths for f in p.lengths.affine for a in f.at}
    assert recv and all(any(a.startswith(f"t{t}/") for a in placed) for t in recv[:1])
