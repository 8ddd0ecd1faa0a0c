"""Every op of a plan allocates, in MLX, at most what the plan says it does.

The runner's memory limit is the envelope less the largest single op's allocation (its outputs and
scratch, ``runner.session.op_allocations``, whose largest ``throttle_limit`` takes): an op that allocates more than the plan's memory model
counts lets a run end above M_max whenever MLX's host starts it just under the limit. Here each
op of each phase runs alone (its inputs evaluated first, MLX's buffer cache off), and MLX's peak
above what was held before, is compared with the plan's bytes for that op. Two such misses were
found this way: the transposed weight copy of a grouped 1-D convolution (Mamba's conv1d) and a
broadcast's stride 0 on a size-1 axis that stays size 1 (a Mamba2 matmul copies its operand).
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest

from dctms.schema.model_folder import open_model
from dctms.schema.types import Plan, Scratch
from dctms.toolkit.compiler import CompileOptions, compile_plan
from dctms.toolkit.tiny_model import write_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from test_caches import BASE as CACHE_BASE  # noqa: E402
from test_caches import RECURRENT_MODELS, RING_MODELS  # noqa: E402
from test_compiler_families import BASE as FAMILY_BASE  # noqa: E402
from test_compiler_families import FAMILIES  # noqa: E402

CASES = {
    **{
        f"{f}-f32": ({**FAMILY_BASE, **c, "torch_dtype": "float32"}, {})
        for f, c in FAMILIES.items()
    },
    "llama-bf16": ({**FAMILY_BASE, **FAMILIES["llama"], "torch_dtype": "bfloat16"}, {}),
    "qwen2-4bit-weights": (
        {
            **FAMILY_BASE,
            **FAMILIES["qwen2"],
            "torch_dtype": "float32",
            "quantization": {"group_size": 32, "bits": 4},
        },
        {},
    ),  # fmt: skip
    "qwen2-4bit-kv": (
        {**FAMILY_BASE, **FAMILIES["qwen2"], "torch_dtype": "float32"},
        {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 24},
    ),
    "qwen2-max-kv-size": (
        {**FAMILY_BASE, **FAMILIES["qwen2"], "torch_dtype": "float32"},
        {"max_kv_size": 24},
    ),
    **{
        name: ({**CACHE_BASE, **cfg}, {})
        for name, cfg in {**RING_MODELS, **RECURRENT_MODELS}.items()
    },
}


def under_counted_ops(plan: Plan, folder: Path) -> list[str]:
    """Each op whose MLX allocation, run alone at the phase's bound, exceeds the plan's."""
    from dctms.runner.session import Session, op_allocations
    from dctms.runner.vision_session import VisionSession

    session = (Session if plan.vision is None else VisionSession)(plan, open_model(folder))
    programs = [session.prefill, session.decode, session.prefill_start, session.decode_start]
    programs += getattr(session, "encoders", {}).values()
    by_name = {p.name: p for p in programs if p is not None}
    found = []
    old = mx.set_cache_limit(0)
    try:
        for phase in plan.phases:
            program, made = by_name[phase.name], op_allocations(phase)
            env = dict(program._static_env(session.weights))
            state = {tid for tid, _ in program._state_inputs}
            env.update((tid, session.state[name]) for tid, name in program._state_inputs)
            env.update((tid, mx.zeros(s, dtype=d)) for tid, (s, d) in program._feeds.items())
            donors = donated_inputs(phase)
            for segment in program.variant(program.lengths.bound).steps:
                for step in segment:
                    inputs = [env[t] for t in step.inputs]
                    mx.eval(inputs)
                    mx.synchronize()
                    before = mx.get_active_memory()
                    mx.reset_peak_memory()
                    # A donated input is held by its op alone, as when the runner runs the plan
                    # (its only reader; the runner has dropped it): MLX then reuses its buffer.
                    if step.index in donors:
                        del env[donors[step.index]]
                    outputs = step.direct(inputs)
                    del inputs
                    mx.eval(outputs)
                    mx.synchronize()
                    real = mx.get_peak_memory() - before
                    env.update(zip(step.outputs, outputs, strict=True))
                    # A state update copies here only because this loop holds the state too
                    # (the runner moves it in, and MLX updates it in place).
                    in_place = bool(step.inputs) and step.inputs[0] in state
                    if real > made[step.index] and not in_place:
                        found.append(
                            f"{phase.name} op {step.index} {step.primitive}: MLX {real} B, "
                            f"plan {made[step.index]} B"
                        )
    finally:
        mx.set_cache_limit(old)
    return found


def donated_inputs(phase) -> dict[int, str]:
    """Op index -> the input the plan says it writes its output into (``view_of`` made by a
    donating primitive)."""
    from dctms.schema.aliasing import DONATING

    tensors = {t.id: t for t in phase.tensors}
    found = {}
    for k, op in enumerate(phase.ops):
        out = tensors.get(op.outputs[0]) if len(op.outputs) == 1 else None
        if op.primitive in DONATING and out is not None and out.view_of is not None:
            found[k] = next(
                x
                for x in op.inputs
                if x == out.view_of or (x in tensors and tensors[x].view_of == out.view_of)
            )
    return found


@pytest.mark.parametrize("name", list(CASES))
def test_no_op_allocates_more_than_its_plan_says(name, tmp_path) -> None:
    config, options = CASES[name]
    write_tiny_model(tmp_path, config, seed=3)
    plan = compile_plan(open_model(tmp_path), CompileOptions(48, 16, prefill_chunk=16, **options))
    assert under_counted_ops(plan, tmp_path) == []


def test_the_audit_sees_an_under_counted_op(tmp_path) -> None:
    """A plan whose memory model misses an op's scratch fails the audit (the check can fail)."""
    from msgspec.structs import replace

    config, _ = CASES["mamba-f32"]
    write_tiny_model(tmp_path, config, seed=3)
    plan = compile_plan(open_model(tmp_path), CompileOptions(48, 16, prefill_chunk=16))
    phase = plan.phases[0]
    conv = next(k for k, op in enumerate(phase.ops) if op.primitive == "Convolution")
    tensors = [
        replace(t, bytes=t.bytes - 2048, shape=[t.bytes - 2048])
        if isinstance(t, Scratch) and t.op == conv
        else t
        for t in phase.tensors
    ]
    broken = replace(plan, phases=[replace(phase, tensors=tensors), *plan.phases[1:]])
    found = under_counted_ops(broken, tmp_path)
    assert any(f"prefill op {conv} Convolution" in f for f in found), found


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "qwen2_vl"])
def test_no_vision_op_allocates_more_than_its_plan_says(family, tmp_path) -> None:
    """The vision phases too (a SigLIP tower; qwen2_vl's tower at each image size)."""
    from dctms.toolkit.vision.compiler import VisionOptions, compile_vlm_plan
    from dctms.toolkit.vision.tiny import write_tiny_vlm

    folder = write_tiny_vlm(tmp_path / "model", family)
    h, w = (32, 32) if family == "gemma3" else (56, 84)
    plan = compile_vlm_plan(
        open_model(folder), CompileOptions(64, 6, prefill_chunk=16), VisionOptions(2, h, w)
    )
    assert under_counted_ops(plan, folder) == []
