"""Module paths in every plan kind: a speculative plan's draft phases and verify phase, a rank
plan's phases (collectives included), a vision-language plan's vision and text phases."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
from conftest import TINY_QWEN2

from dctms.schema.draft import draft_view
from dctms.schema.errors import DctmsError
from dctms.schema.model_folder import ModelFolder, model_from_config
from dctms.schema.modules import node_paths, op_modules
from dctms.schema.types import ModuleRuns
from dctms.schema.verify import verify_plan
from dctms.toolkit.compiler import CompileOptions

OPTS = CompileOptions(12, 8, prefill_chunk=8, pack_seconds=0.1, real_lengths=False)


def _folder(config: dict) -> ModelFolder:
    return model_from_config(config)


def _ops_under(plan, phase, prefix: str) -> list[str]:
    return [
        op.primitive
        for op, path in zip(phase.ops, op_modules(plan, phase), strict=True)
        if path is not None and (path == prefix or path.startswith(prefix + "."))
    ]


# ------------------------------------------------------------------------------ speculative


@pytest.fixture(scope="module")
def spec_plan():
    from dctms.toolkit.kinds.speculative import compile_speculative

    target = _folder({**TINY_QWEN2, "num_hidden_layers": 3})
    draft = _folder({**TINY_QWEN2, "num_hidden_layers": 1})
    return compile_speculative(target, draft, OPTS, 2)


def test_draft_phases_name_the_drafts_own_modules(spec_plan):
    draft = spec_plan.draft
    assert draft.modules is not None
    paths = set(node_paths(draft.modules))
    # The draft has one layer: its tree names layer 0 only, the target's names all three.
    assert "model.layers.0.self_attn" in paths and "model.layers.1" not in paths
    assert "model.layers.2.self_attn" in node_paths(spec_plan.modules)
    view = draft_view(spec_plan)
    for phase in view.phases:
        assert None not in op_modules(view, phase)
        attention = _ops_under(view, phase, "model.layers.0.self_attn")
        assert ("Matmul" in attention and "Softmax" in attention) or (
            "ScaledDotProductAttention" in attention
        )


def test_verify_phase_names_every_layers_attention(spec_plan):
    verify = next(p for p in spec_plan.phases if p.name == "verify")
    modules = op_modules(spec_plan, verify)
    assert None not in modules
    for i in range(3):
        assert f"model.layers.{i}.self_attn" in modules
        assert f"model.layers.{i}.mlp" in modules or f"model.layers.{i}.mlp.down_proj" in modules
    assert verify_plan(spec_plan) == []


def test_verifier_rejects_draft_runs_beyond_the_drafts_tree(spec_plan):
    draft = spec_plan.draft
    phase = draft.phases[0]
    nodes = len(draft.modules.names)
    runs = phase.modules
    broken_runs = ModuleRuns(runs.lengths, [nodes, *runs.modules[1:]])
    phases = [msgspec.structs.replace(phase, modules=broken_runs), *draft.phases[1:]]
    broken = msgspec.structs.replace(
        spec_plan, draft=msgspec.structs.replace(draft, phases=phases)
    )
    problems = verify_plan(broken)
    assert any(
        p.path == "$.draft.phases[0].modules.modules[0]" and "draft:" in p.message for p in problems
    ), problems


# ------------------------------------------------------------------------------ distributed


def _rank_plan(mode: str, rank: int):
    from dctms.toolkit.compiler import compile_plan

    opts = dataclasses.replace(OPTS, ranks=2, rank=rank, parallel=mode)
    return compile_plan(_folder({**TINY_QWEN2, "num_hidden_layers": 3}), opts)


def _collective_paths(plan) -> list[tuple[str, str, str]]:
    return [
        (phase.name, op.primitive, path)
        for phase in plan.phases
        for op, path in zip(phase.ops, op_modules(plan, phase), strict=True)
        if op.primitive in ("AllReduce", "AllGather", "Send", "Recv")
    ]


def test_tensor_rank_all_sums_sit_in_the_attention_and_mlp_that_issued_them():
    plan = _rank_plan("tensor", 1)
    for phase in plan.phases:
        assert None not in op_modules(plan, phase)
    found = _collective_paths(plan)
    for name in ("prefill", "decode"):
        # One all_sum per layer after the attention's o_proj, one after the MLP's down_proj.
        assert [path for phase, kind, path in found if phase == name and kind == "AllReduce"] == [
            f"model.layers.{i}.{part}" for i in range(3) for part in ("self_attn.o_proj", "mlp.down_proj")
        ]
    assert verify_plan(plan) == []


def test_pipeline_rank_names_only_its_own_layers():
    plan = _rank_plan("pipeline", 0)  # rank 0 runs the last layers
    start, end = plan.distributed.layers
    layers = {
        int(path.split(".")[2])
        for phase in plan.phases
        for path in op_modules(plan, phase)
        if path and path.startswith("model.layers.")
    }
    assert layers == set(range(start, end)) and start > 0
    # The hidden state arrives from the previous rank inside the model's own __call__.
    assert {(kind, path) for _, kind, path in _collective_paths(plan)} >= {("Recv", "model")}
    assert verify_plan(plan) == []
    # A path naming a layer of another rank is rejected.
    names = list(plan.modules.names)
    names[node_paths(plan.modules).index(f"model.layers.{start}")] = "0"
    broken = msgspec.structs.replace(
        plan, modules=msgspec.structs.replace(plan.modules, names=names)
    )
    problems = [p for p in verify_plan(broken) if p.rule == "module_layer"]
    assert problems and all(
        f"layer 0, but this rank runs layers {start}..{end - 1}" in p.message for p in problems
    ), problems


# ------------------------------------------------------------------------------ vision-language

VLM_BOUNDS = {"gemma3": (40, (32, 32)), "qwen2_vl": (64, (56, 84))}  # as tests/test_vision.py


@pytest.fixture(scope="module", params=sorted(VLM_BOUNDS))
def vlm_plan(request, tmp_path_factory):
    pytest.importorskip("mlx_vlm")
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.vision.compiler import VisionOptions, compile_vlm_plan
    from dctms.toolkit.vision.tiny import write_tiny_vlm

    n, (h, w) = VLM_BOUNDS[request.param]
    folder = write_tiny_vlm(tmp_path_factory.mktemp(request.param) / "model", request.param)
    opts = dataclasses.replace(OPTS, input_tokens=n, output_tokens=4, prefill_chunk=16)
    return compile_vlm_plan(open_model(folder), opts, VisionOptions(2, h, w))


def test_vision_phases_sit_under_the_tower_and_projector(vlm_plan):
    assert verify_plan(vlm_plan) == []
    encoders = {v.phase for v in vlm_plan.vision.variants}
    for phase in vlm_plan.phases:
        modules = op_modules(vlm_plan, phase)
        assert None not in modules
        tops = {m.split(".")[0] for m in modules}
        if phase.name in encoders:
            # The tower's attention and the projection into the text width are there.
            assert "vision_tower" in tops and "language_model" not in tops
            assert any(".attn" in m or ".self_attn" in m for m in modules)
            projector = "multi_modal_projector" if "multi_modal_projector" in tops else (
                "vision_tower.merger"
            )
            assert _ops_under(vlm_plan, phase, projector)
        else:
            assert "vision_tower" not in tops
            attention = _ops_under(vlm_plan, phase, "language_model.model.layers.0.self_attn")
            assert "Matmul" in attention or "ScaledDotProductAttention" in attention


def test_verifier_rejects_a_text_module_beyond_the_language_models_layers(vlm_plan):
    paths = node_paths(vlm_plan.modules)
    node = paths.index("language_model.model.layers.1")
    names = list(vlm_plan.modules.names)
    names[node] = "9"
    broken = msgspec.structs.replace(
        vlm_plan, modules=msgspec.structs.replace(vlm_plan.modules, names=names)
    )
    problems = [p for p in verify_plan(broken) if p.rule == "module_layer"]
    assert problems and all("language_model.model.layers.9" in p.message for p in problems)


# ------------------------------------------------------------------------------ explain's knobs


def test_knobs_recompile_a_speculative_plan_with_its_draft(spec_plan):
    from dctms.toolkit.knobs import compile_knobs

    baseline, [chunk] = compile_knobs(spec_plan, ("chunk",))
    assert baseline.envelope == spec_plan.envelope  # the same request, compiled the same way
    assert chunk.plan.draft is not None and chunk.plan.bounds.prefill_chunk == 4
    assert {p.name for p in chunk.plan.phases} == {"prefill", "decode", "verify"}
    assert chunk.plan.envelope.intermediate <= baseline.envelope.intermediate
    # A knob the speculative compiler refuses is named in one line, with the compiler's reason.
    with pytest.raises(DctmsError, match=r"--knobs batch: 1 -> 2 does not compile: .*batch 1"):
        compile_knobs(spec_plan, ("batch",))


def test_knobs_recompile_a_vision_plan_with_its_image_bounds(vlm_plan):
    from dctms.toolkit.knobs import compile_knobs

    baseline, [chunk] = compile_knobs(vlm_plan, ("chunk",))
    assert baseline.envelope == vlm_plan.envelope
    assert chunk.plan.vision == vlm_plan.vision and chunk.plan.bounds.prefill_chunk == 8

    def prefill_arena(plan) -> int:
        return next(p.arena_bytes for p in plan.phases if p.name == "prefill")

    assert prefill_arena(chunk.plan) < prefill_arena(baseline)  # half the tokens per call
