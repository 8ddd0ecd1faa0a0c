"""MLX's fused kernels as plan ops (toolkit.fused_kernels, schema.fast_ops, rule fused_kernels).

The pass finds each ``mx.fast`` composite of the CPU trace by structure and substitutes it only where
MLX's own composite for the arguments it read matches op for op; the runner re-creates the op with
``mx.fast.*`` (on the CPU: that same composite, so its result is bit-equal); the verifier knows the
ops' shapes and refuses one with wrong arguments, shapes or less scratch than its fallback holds."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import replace as dc_replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from msgspec.structs import replace
from test_compiler_families import FAMILIES as COMPILER_FAMILIES

from dctms.runner.primitives import apply_op
from dctms.schema.fast_ops import FUSED, RMS_NORM, ROPE, SDPA, scratch_buffers, scratch_bytes
from dctms.schema.model_folder import model_from_config
from dctms.schema.targets import derive
from dctms.schema.types import Plan
from dctms.schema.verify import verify_plan
from dctms.toolkit.compiler import CompileOptions, compile_plan
from dctms.toolkit.fused_kernels import fuse_kernels
from dctms.toolkit.tiny_model import DEMO_CONFIG, write_tiny_model
from dctms.toolkit.trace import PhaseTracer, build_model

LAYERS = DEMO_CONFIG["num_hidden_layers"]
# per phase: two norms a layer and the final one, rotary queries and keys, one attention a layer
EXPECTED = {RMS_NORM: 2 * LAYERS + 1, ROPE: 2 * LAYERS, SDPA: LAYERS}


def _compile(**extra) -> Plan:
    opts = CompileOptions(input_tokens=32, output_tokens=8, pack_seconds=0.0, **extra)
    return compile_plan(model_from_config(DEMO_CONFIG), opts)


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {
        "cpu": _compile(),
        "fused": _compile(fused=True),
        "metal": _compile(target="metal"),
        "cuda": _compile(target="cuda"),
    }


def _fast(phase) -> Counter:
    return Counter(o.primitive for o in phase.ops if o.primitive in FUSED)


def test_every_composite_becomes_one_op_and_the_plan_verifies(plans: dict[str, Plan]) -> None:
    assert all(not _fast(p) for p in plans["cpu"].phases)
    for name in ("fused", "metal", "cuda"):
        plan = plans[name]
        assert verify_plan(plan) == []
        for phase in plan.phases:
            assert _fast(phase) == EXPECTED, (name, phase.name)
        fewer = [len(p.ops) for p in plan.phases]
        assert fewer < [len(p.ops) for p in plans["cpu"].phases]
    op = next(o for o in plans["fused"].phases[0].ops if o.primitive == ROPE)
    assert op.args == [32, False, 10000.0, 1.0, True]  # dims, traditional, base, scale, forward
    norm = next(o for o in plans["fused"].phases[0].ops if o.primitive == RMS_NORM)
    assert norm.args == [float(np.float32(1e-6))]


def test_fused_ops_are_charged_their_fallback_or_kernel_scratch(plans: dict[str, Plan]) -> None:
    for name, model in (("fused", None), ("metal", "metal"), ("cuda", "cuda")):
        plan = plans[name]
        mm = derive(model, plan.target.profile.name) if model else None
        for phase in plan.phases:
            known = {t.id: (tuple(t.shape), t.dtype) for t in phase.tensors}
            known |= {b.id: (tuple(b.shape), b.dtype) for b in phase.inputs}
            for o in phase.ops:
                if o.primitive in FUSED:
                    shapes = [known[t][0] for t in o.inputs]
                    dtypes = [known[t][1] for t in o.inputs]
                    need = scratch_bytes(mm, o.primitive, shapes, dtypes, o.args)
                    assert o.scratch >= need
                    # on Metal rms_norm and rope hold nothing of their own; elsewhere all do
                    assert need > 0 or (name == "metal" and o.primitive != SDPA)


def test_default_cpu_plans_hold_no_fused_op_and_are_deterministic() -> None:
    from dctms.schema.io import encode_plan

    assert encode_plan(_compile()) == encode_plan(_compile(fused=False))
    assert encode_plan(_compile(fused=True)) == encode_plan(_compile(fused=True))


def test_half_precision_composites_are_fused_too() -> None:
    plan = _compile(fused=True, dtype="bfloat16")
    assert verify_plan(plan) == []
    assert all(_fast(p) == EXPECTED for p in plan.phases)


def _decode_trace():
    model = build_model(DEMO_CONFIG, "float32")
    tracer = PhaseTracer(model, LAYERS, batch=1, capacity=40, kv_quant=None, rings=[None] * LAYERS)
    return tracer.decode(40)


def test_a_composite_that_differs_from_mlx_s_is_left_alone() -> None:
    phase = _decode_trace()
    fused, _, found = fuse_kernels(phase)
    assert Counter(f.op.primitive for f in found) == EXPECTED
    # break the first norm: its mean divides by another count (the 1/N constant changed)
    first = found[0]
    assert first.op.primitive == RMS_NORM
    reduce_ = next(o for o in first.composite if o.primitive == "Reduce")
    mean = next(
        o for o in first.composite if o.primitive == "Multiply" and reduce_.outputs[0] in o.inputs
    )
    scalar = next(t for t in mean.inputs if t != reduce_.outputs[0])
    bcast = next(o for o in phase.ops if scalar in o.outputs)
    const = bcast.inputs[0]
    other = dc_replace(phase, constants=[
        dc_replace(c, value=[c.value[0] * 2]) if c.id == const else c for c in phase.constants
    ])  # fmt: skip
    _, _, found2 = fuse_kernels(other)
    lost = EXPECTED[RMS_NORM] - Counter(f.op.primitive for f in found2)[RMS_NORM]
    assert lost >= 1  # every norm sharing that constant stays a composite
    assert first.op.outputs not in [f.op.outputs for f in found2]
    # an intermediate of another dtype: the attention's softmax recorded as float16
    sdpa = next(f for f in found if f.op.primitive == SDPA)
    soft = next(o for o in sdpa.composite if o.primitive == "Softmax").outputs[0]
    t = phase.tensors[soft]
    typed = dc_replace(phase, tensors={**phase.tensors, soft: dc_replace(t, dtype="float16")})
    _, _, found3 = fuse_kernels(typed)
    assert sdpa.op.outputs not in [f.op.outputs for f in found3]
    assert len(found3) == len(found) - 1


def test_the_fused_phase_keeps_every_other_op_and_output(plans: dict[str, Plan]) -> None:
    phase = _decode_trace()
    fused, _, found = fuse_kernels(phase)
    made = {t for o in fused.ops for t in o.outputs}
    assert {b.id for b in phase.outputs} <= made
    removed = {t for f in found for o in f.composite for t in o.outputs} - made
    assert not removed & {t for o in fused.ops for t in o.inputs}  # nothing reads a removed one


# ------------------------------------------------------------------------------- the runner


def test_runner_handlers_equal_the_composite_on_the_cpu() -> None:
    mx.random.seed(1)
    x = mx.random.normal((1, 4, 3, 32))
    w = mx.random.normal((32,))
    off = mx.array(5, dtype=mx.int32)
    got = apply_op(RMS_NORM, [1e-6], [x, w], [x.shape], ["float32"])[0]
    assert mx.array_equal(got, mx.fast.rms_norm(x, w, 1e-6)).item()
    got = apply_op(ROPE, [32, False, 10000.0, 1.0, True], [x, off], [x.shape], ["float32"])[0]
    want = mx.fast.rope(x, 32, traditional=False, base=10000.0, scale=1.0, offset=off)
    assert mx.array_equal(got, want).item()
    freqs = mx.random.uniform(1.0, 1e4, (16,))  # llama3 scaling: given frequencies, base unused
    got = apply_op(ROPE, [32, False, 1.0, 1.0, True], [x, off, freqs], [x.shape], ["float32"])[0]
    want = mx.fast.rope(x, 32, traditional=False, base=None, scale=1.0, offset=off, freqs=freqs)
    assert mx.array_equal(got, want).item()
    assert not mx.array_equal(got, apply_op(ROPE, [32, False, 1.0, 1.0, True], [x, off], [x.shape],
                                            ["float32"])[0]).item()  # fmt: skip
    q, k = mx.random.normal((1, 4, 3, 32)), mx.random.normal((1, 2, 7, 32))
    mask = mx.broadcast_to(mx.array([True] * 7), (1, 4, 3, 7))
    got = apply_op(SDPA, [0.25, False, False, False], [q, k, k, mask], [q.shape], ["float32"])[0]
    want = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.25, mask=mask)
    assert mx.array_equal(got, want).item()


def test_runner_refuses_an_unsupported_fused_op_in_one_line() -> None:
    from dctms.schema.errors import DctmsError

    x = mx.zeros((1, 1, 2, 8))
    with pytest.raises(DctmsError, match="inverse rotation"):
        apply_op(ROPE, [8, False, 1e4, 1.0, False], [x, mx.array(0)], [x.shape], ["float32"])
    with pytest.raises(DctmsError, match="ScaledDotProductAttention"):
        apply_op(SDPA, [1.0, False, True, False], [x, x, x], [x.shape], ["float32"])


@pytest.mark.parametrize("family", ["qwen2", "llama3-rope"])
def test_a_fused_plan_runs_with_ids_equal_to_the_plain_plan(tmp_path: Path, family: str) -> None:
    # llama3-rope: its RoPE ops take the scaled frequencies as a third input (mx.fast.rope freqs)
    config = DEMO_CONFIG if family == "qwen2" else {**DEMO_CONFIG, **COMPILER_FAMILIES[family]}
    folder = write_tiny_model(tmp_path / "m", config)
    reports = {}
    for name, extra in (("plain", []), ("fused", ["--fused"])):
        plan = tmp_path / f"{name}.plan"
        c = _dctms("compile", str(folder), "-N", "24", "-M", "6", "--pack-seconds", "0",
                   "-o", str(plan), *extra)  # fmt: skip
        assert c.returncode == 0, c.stderr
        report = tmp_path / f"{name}.json"
        r = _dctms("run", str(plan), "--model", str(folder), "--prompt", "hello there",
                   "--report", str(report))  # fmt: skip
        assert r.returncode == 0, r.stderr
        reports[name] = json.loads(report.read_text())
    assert reports["fused"]["tokens"] == reports["plain"]["tokens"]
    assert reports["fused"]["within_envelope"]


def _dctms(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", *args], capture_output=True, text=True
    )


# ----------------------------------------------------------------------------- the verifier


def _fused_op(plan: Plan, prim: str) -> int:
    return next(k for k, o in enumerate(plan.phases[0].ops) if o.primitive == prim)


def _op(plan: Plan, k: int, **changes) -> Plan:
    ph = plan.phases[0]
    ops = [replace(o, **changes) if i == k else o for i, o in enumerate(ph.ops)]
    return replace(plan, phases=[replace(ph, ops=ops), *plan.phases[1:]])


def _broken(plan: Plan, prim: str, **changes) -> Plan:
    return _op(plan, _fused_op(plan, prim), **changes)


BREAKS = [
    ("eps as an int", lambda p: _broken(p, RMS_NORM, args=[1])),
    ("eps negative", lambda p: _broken(p, RMS_NORM, args=[-1e-6])),
    ("odd rotary dims", lambda p: _broken(p, ROPE, args=[31, False, 1e4, 1.0, True])),
    ("rotary dims beyond the head", lambda p: _broken(p, ROPE, args=[64, False, 1e4, 1.0, True])),
    ("rope base as a string", lambda p: _broken(p, ROPE, args=[32, False, "1e4", 1.0, True])),
    ("attention with sinks", lambda p: _broken(p, SDPA, args=[0.5, False, True, False])),
    ("a norm's scratch below its fallback", lambda p: _broken(p, RMS_NORM, scratch=8)),
    ("attention's scratch below its fallback", lambda p: _broken(p, SDPA, scratch=0)),
    (
        "attention reading keys as its queries",
        lambda p: _broken(
            p,
            SDPA,
            inputs=[
                p.phases[0].ops[_fused_op(p, SDPA)].inputs[1],
                *p.phases[0].ops[_fused_op(p, SDPA)].inputs[1:],
            ],
        ),
    ),  # fmt: skip
    (
        "a norm's weight of another width",
        lambda p: _broken(
            p,
            RMS_NORM,
            inputs=[
                p.phases[0].ops[_fused_op(p, RMS_NORM)].inputs[0],
                p.phases[0].ops[_fused_op(p, RMS_NORM)].inputs[0],
            ],
        ),
    ),  # fmt: skip
]


@pytest.mark.parametrize(("how", "breaker"), BREAKS, ids=[h for h, _ in BREAKS])
def test_a_broken_fused_op_is_refused(plans: dict[str, Plan], how, breaker) -> None:
    problems = verify_plan(breaker(plans["fused"]))
    assert "fused_kernels" in {p.rule for p in problems}, f"{how}: {[str(p) for p in problems]}"


def test_a_rope_whose_freqs_do_not_fit_is_refused() -> None:
    from tiny_configs import BASE

    config = {**BASE, **FAMILIES["llama3-rope"], "torch_dtype": "float32"}
    plan = compile_plan(model_from_config(config), CompileOptions(24, 8, pack_seconds=0.0, fused=True))
    assert verify_plan(plan) == []
    k = _fused_op(plan, ROPE)
    x, offset, _ = plan.phases[0].ops[k].inputs
    broken = _op(plan, k, inputs=[x, offset, offset])  # an int32 scalar as the frequencies
    problems = [p for p in verify_plan(broken) if p.rule == "fused_kernels"]
    assert problems and "freqs" in problems[0].message


def test_the_metal_two_pass_attention_partials_are_charged() -> None:
    # one query row over 4096 keys, 8 query heads on 2 key heads, head dim 128 (the vector kernel)
    q, k = (1, 8, 1, 128), (1, 2, 4096, 128)
    buffers = scratch_buffers("metal", SDPA, [q, k, k], ["float16"] * 3, [0.1, False, False, False])
    rows, blocks = 8, 128  # an Ultra's 128 blocks (n_simds = 4 < 6) is the most for 4096 keys
    assert buffers == [rows * blocks * 128 * 2, rows * blocks * 4, rows * blocks * 4]
    # under 1024 keys the one-pass kernel allocates nothing of its own
    assert scratch_buffers("metal", SDPA, [q, (1, 2, 512, 128)] + [(1, 2, 512, 128)],
                           ["float16"] * 3, [0.1, False, False, False]) == []  # fmt: skip
    # a head dim the kernels do not take runs the composite on the GPU too
    odd = (1, 8, 1, 40)
    assert scratch_buffers("metal", SDPA, [odd, (1, 2, 64, 40), (1, 2, 64, 40)], ["float32"] * 3,
                           [0.1, False, False, False]) == scratch_buffers(
        "cpu", SDPA, [odd, (1, 2, 64, 40), (1, 2, 64, 40)], ["float32"] * 3, [0.1, False, False, False]
    )  # fmt: skip


def test_a_cpu_plan_charging_less_than_the_composites_is_refused() -> None:
    # The phase as MLX's CPU runs it (each composite expanded, scheduled in MLX's order) holds more
    # than an arena that claims too little: the compile refuses.
    from types import SimpleNamespace

    from dctms.schema.errors import DctmsError
    from dctms.toolkit.compiler import check_fallback
    from dctms.toolkit.profiles import get_profile, ridge_point

    tp, _, _ = fuse_kernels(_decode_trace())
    opts = CompileOptions(input_tokens=32, output_tokens=8, fused=True)
    ridge = ridge_point(get_profile("cpu-x86-2core"))
    said: list[str] = []
    check_fallback(tp, SimpleNamespace(arena_bytes=2**30, slack_bytes=0), ridge, opts, said.append)
    need = int(said[0].split("at most ")[1].split(" bytes")[0])
    assert need > 0
    with pytest.raises(DctmsError, match="--fused: the composites MLX's CPU runs"):
        check_fallback(tp, SimpleNamespace(arena_bytes=need - 1, slack_bytes=0), ridge, opts, print)


def test_the_expanded_phase_is_mlx_s_composite_of_every_fused_op() -> None:
    from dctms.toolkit.fused_kernels import expanded

    phase = _decode_trace()
    fused, _, found = fuse_kernels(phase)
    full = expanded(fused)
    assert not any(o.primitive in FUSED for o in full.ops)
    assert len(full.ops) == len(fused.ops) - len(found) + sum(len(f.composite) for f in found)
    made = {t for o in full.ops for t in o.outputs}
    leaves = {b.id for b in full.inputs} | {c.id for c in full.constants}
    assert all(t in made or t in leaves for o in full.ops for t in o.inputs)


def test_a_composite_holding_more_than_its_charge_is_left_alone(monkeypatch) -> None:
    from dctms.schema import fast_ops

    real = fast_ops.scratch_buffers
    monkeypatch.setattr(
        fast_ops,
        "scratch_buffers",
        lambda target, prim, *a: [0] if prim == RMS_NORM else real(target, prim, *a),
    )
    _, _, found = fuse_kernels(_decode_trace())
    assert Counter(f.op.primitive for f in found) == {ROPE: EXPECTED[ROPE], SDPA: EXPECTED[SDPA]}


FAMILIES = {
    "llama": {"model_type": "llama", "head_dim": 32},
    "qwen3": {"model_type": "qwen3", "head_dim": 48, "tie_word_embeddings": False},  # q/k norms
    "phi3": {"model_type": "phi3"},
    "olmo2": {"model_type": "olmo2"},
    # llama3's rope scaling passes freqs to mx.fast.rope: a RoPE op with a third input
    "llama3-rope": COMPILER_FAMILIES["llama3-rope"],
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("target", [None, "metal"])
def test_families_compile_with_their_kernels_fused(family: str, target: str | None) -> None:
    from tiny_configs import BASE

    config = {**BASE, **FAMILIES[family], "torch_dtype": "bfloat16"}
    opts = CompileOptions(24, 8, pack_seconds=0.0, target=target, fused=target is None)
    plan = compile_plan(model_from_config(config), opts)  # the verifier's self-check passed
    layers = config["num_hidden_layers"]
    for phase in plan.phases:
        found = _fast(phase)
        assert found[SDPA] == layers
        assert found[ROPE] == 2 * layers
        ropes = [op for op in phase.ops if op.primitive == ROPE]
        assert {len(op.inputs) for op in ropes} == {3 if family == "llama3-rope" else 2}
        norms = 2 * layers + 1 + (2 * layers if family in ("qwen3", "olmo2") else 0)
        assert found[RMS_NORM] == norms
