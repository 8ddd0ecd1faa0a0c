"""Speculative decoding: a draft and a target in one plan (dctms compile --draft, run --draft-model).

Two drafts of a tiny random-weight qwen2 target (3 layers): the target itself (every draft token
is accepted) and a draft that keeps the target's first layer (weights copied), which the target
rejects often. Either way the ids must be the target's own greedy ids, and the ids of mlx-lm's
``speculative_generate_step`` with the same K.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import msgspec
import pytest
from conftest import TINY_QWEN2

from dctms.runner.load import load_checked_plan
from dctms.runner.request import validate_request
from dctms.runner.session import Session
from dctms.runner.speculative import SpeculativeSession
from dctms.schema.draft import draft_view
from dctms.schema.errors import DctmsError
from dctms.schema.io import encode_plan, write_plan
from dctms.schema.model_folder import open_model, open_model_folder
from dctms.schema.verify import verify_plan
from dctms.toolkit.compiler import CompileOptions
from dctms.toolkit.kinds.speculative import compile_speculative
from dctms.toolkit.tiny_model import write_tiny_model

TARGET = {**TINY_QWEN2, "num_hidden_layers": 3}
N, M, CHUNK = 12, 12, 8
PROMPTS = ([7], [5, 17, 33, 200, 9, 41, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])


def write_first_layers_draft(target: Path, folder: Path, layers: int) -> Path:
    """A draft that is the target's first ``layers`` decoder layers, embedding and final norm
    (its weights copied from the target's file)."""
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    weights = mx.load(str(target / "model.safetensors"))
    kept = {
        k: v
        for k, v in weights.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    folder.mkdir(parents=True)
    mx.save_safetensors(str(folder / "model.safetensors"), kept, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    target = write_tiny_model(root / "target", TARGET, seed=3)
    return {
        "target": target,
        "first_layer": write_first_layers_draft(target, root / "first_layer", 1),
    }


def _compile(models, draft: str, k: int):
    drafted = models["target"] if draft == "self" else models[draft]
    return compile_speculative(
        open_model(models["target"]),
        open_model(drafted),
        CompileOptions(N, M, prefill_chunk=CHUNK, pack_seconds=0.2),
        k,
    )


@pytest.fixture(scope="module")
def plans(models, tmp_path_factory) -> dict[tuple[str, int], Path]:
    out = tmp_path_factory.mktemp("plans")
    found = {}
    for draft, k in (("self", 1), ("self", 3), ("first_layer", 2), ("first_layer", 4)):
        path = out / f"{draft}-{k}.plan"
        write_plan(_compile(models, draft, k), path)
        found[(draft, k)] = path
    return found


def _mlx_lm_ids(models, draft: str, prompt: list[int], k: int, max_tokens: int) -> list[int]:
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.utils import load_model

    target, _ = load_model(models["target"])
    drafted, _ = load_model(models["target"] if draft == "self" else models[draft])
    steps = speculative_generate_step(
        mx.array(prompt), target, drafted, num_draft_tokens=k, max_tokens=max_tokens
    )
    return [int(token) for token, _, _ in steps]


# ------------------------------------------------------------------------------------- compile


def test_the_plan_holds_both_models_and_one_envelope(plans):
    plan = load_checked_plan(plans[("first_layer", 2)])
    assert [p.name for p in plan.phases] == ["prefill", "decode", "verify"]
    assert [p.name for p in plan.draft.phases] == ["prefill", "decode"]
    assert plan.draft.num_draft == 2 and plan.draft.model.num_layers == 1
    verify = plan.phases[2]
    assert verify.tokens == 3
    assert [b.shape for b in verify.outputs if b.name == "next_token"] == [[1, 3]]
    # Both caches at capacity: the last verify call (start N + M - 2) writes K + 1 positions.
    assert plan.bounds.kv_capacity >= N + M + 2
    caches = [s for s in plan.state if s.kind == "kv"] + [
        s for s in plan.draft.state if s.kind == "kv"
    ]
    assert caches and all(s.shape[2] == plan.bounds.kv_capacity for s in caches)
    target, draft = plan.envelope.parts
    assert (target.model, draft.model) == ("target", "draft")
    env = plan.envelope
    assert env.weights == target.weights + draft.weights
    assert draft.weights < target.weights  # one layer of three
    assert env.kv == target.kv + draft.kv
    assert env.persistent == target.persistent + draft.persistent
    assert env.intermediate == max(target.intermediate, draft.intermediate)
    assert target.intermediate == max(p.arena_bytes + p.slack_bytes for p in plan.phases)
    assert draft.intermediate == max(p.arena_bytes + p.slack_bytes for p in plan.draft.phases)
    assert env.total == env.provable + env.runtime


def test_compiling_twice_gives_the_same_bytes(models, plans):
    again = encode_plan(_compile(models, "first_layer", 2))
    assert again == plans[("first_layer", 2)].read_bytes()


def test_a_pair_with_different_vocabularies_is_refused_in_one_line(models, tmp_path):
    other = write_tiny_model(tmp_path / "other", {**TARGET, "vocab_size": 300}, seed=1)
    with pytest.raises(DctmsError, match="vocabulary .300 tokens. differs from the target's .257"):
        compile_speculative(
            open_model(models["target"]), open_model(other), CompileOptions(N, M), 2
        )
    out = tmp_path / "x.plan"
    proc = _dctms(
        "compile",
        str(models["target"]),
        "--draft",
        str(other),
        "-N",
        "8",
        "-M",
        "8",
        "-o",
        str(out),
    )
    assert proc.returncode == 2 and not out.exists()
    assert len(proc.stderr.strip().splitlines()) == 1 and "vocabulary" in proc.stderr


def test_num_draft_without_a_draft_is_refused(models, tmp_path):
    proc = _dctms("compile", str(models["target"]), "-N", "8", "-M", "8", "--num-draft", "2",
                  "-o", "-")
    assert proc.returncode == 2 and "--num-draft needs --draft" in proc.stderr


# ------------------------------------------------------------------------------------- verifier


def _problems(plan) -> list[tuple[str, str]]:
    return [(p.rule, p.path) for p in verify_plan(plan)]


def test_the_verifier_accepts_the_plan_and_checks_the_draft_as_a_plan(plans):
    plan = load_checked_plan(plans[("self", 3)])
    assert verify_plan(plan) == []
    assert verify_plan(draft_view(plan)) == []
    # A draft arena shrunk below its tenants: found by the ordinary rules, under $.draft.
    phase = plan.draft.phases[1]
    broken = msgspec.structs.replace(phase, arena_bytes=phase.arena_bytes // 2)
    draft = msgspec.structs.replace(plan.draft, phases=[plan.draft.phases[0], broken])
    found = _problems(msgspec.structs.replace(plan, draft=draft))
    assert ("arena_bounds", "$.draft.phases[1]") in [(r, p.split(".tensors")[0]) for r, p in found]
    assert all(p.startswith(("$.draft", "$.envelope.parts")) for _, p in found), found


def test_the_verifier_rejects_broken_speculative_plans(plans):
    plan = load_checked_plan(plans[("self", 3)])
    target, draft = plan.envelope.parts
    # A verify phase for another K.
    draft_k = msgspec.structs.replace(plan.draft, num_draft=2)
    assert ("speculative", "$.phases[2].tokens") in _problems(
        msgspec.structs.replace(plan, draft=draft_k)
    )
    # A draft of another vocabulary.
    model = msgspec.structs.replace(plan.draft.model, vocab_size=300)
    other = msgspec.structs.replace(plan.draft, model=model)
    assert ("speculative", "$.draft.model.vocab_size") in _problems(
        msgspec.structs.replace(plan, draft=other)
    )
    # A cache too small for the last verify call's writes.
    bounds = msgspec.structs.replace(plan.bounds, kv_capacity=N + M)
    assert ("speculative", "$.bounds.kv_capacity") in _problems(
        msgspec.structs.replace(plan, bounds=bounds)
    )
    # The intermediate summed over the models instead of the larger one.
    env = msgspec.structs.replace(
        plan.envelope,
        intermediate=target.intermediate + draft.intermediate,
        total=plan.envelope.total + min(target.intermediate, draft.intermediate),
    )
    assert ("envelope_sum", "$.envelope.intermediate") in _problems(
        msgspec.structs.replace(plan, envelope=env)
    )
    # The draft's part understating its KV cache.
    low = msgspec.structs.replace(draft, kv=draft.kv - 1)
    env = msgspec.structs.replace(
        plan.envelope, parts=[target, low], kv=plan.envelope.kv - 1, total=plan.envelope.total - 1
    )
    assert ("envelope_sum", "$.envelope.parts[1].kv") in _problems(
        msgspec.structs.replace(plan, envelope=env)
    )
    # Without its draft the plan's verify phase and parts are refused.
    found = _problems(msgspec.structs.replace(plan, draft=None))
    assert ("speculative", "$.phases[2].name") in found
    assert ("speculative", "$.envelope.parts") in found


# ------------------------------------------------------------------------------------- run


@pytest.mark.parametrize(
    "draft,k", [("self", 1), ("self", 3), ("first_layer", 2), ("first_layer", 4)]
)
def test_ids_are_the_targets_greedy_ids_and_mlx_lms(models, plans, draft, k):
    plan = load_checked_plan(plans[(draft, k)])
    target = open_model_folder(models["target"])
    drafted = open_model_folder(models["target"] if draft == "self" else models[draft])
    plain = Session(plan, target)
    expected = {tuple(p): plain.generate(validate_request(plan, p, M)).tokens for p in PROMPTS}
    del plain
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    baseline = mx.get_active_memory()  # arrays other tests in this process still hold
    spec = SpeculativeSession(plan, target, drafted)
    # The memory limit covers them too, or MLX's throttle would hold back the plan's run-ahead.
    spec.target.apply_limits(baseline)
    gens = {tuple(p): spec.generate(validate_request(plan, p, M)) for p in PROMPTS}
    # Before mlx-lm loads its own copies of the models.
    peak = mx.get_peak_memory() - baseline
    print(f"{draft} k={k}: provable / observed = {plan.envelope.provable / peak:.4f}")
    assert peak <= plan.envelope.provable
    assert plan.envelope.provable / peak <= 1.05
    for prompt, gen in gens.items():
        assert gen.tokens == expected[prompt], prompt
        assert gen.tokens == _mlx_lm_ids(models, draft, list(prompt), k, M), prompt
        assert gen.proposed >= gen.accepted >= 0 and gen.rounds == len(gen.round_accepts)
        if draft == "self":
            assert gen.acceptance == 1.0
        # Each round emits its accepted drafts plus the target's own token.
        assert sum(gen.round_accepts) + gen.rounds >= len(gen.tokens)


def test_a_draft_that_rejects_makes_a_difference(models, plans):
    """The first-layer draft really is a different model: the target rejects some of its tokens."""
    plan = load_checked_plan(plans[("first_layer", 2)])
    spec = SpeculativeSession(
        plan, open_model_folder(models["target"]), open_model_folder(models["first_layer"])
    )
    gen = spec.generate(validate_request(plan, list(PROMPTS[1]), M))
    assert gen.accepted < gen.proposed


def test_a_stop_token_ends_the_generation_inside_a_round(models, plans):
    plan = load_checked_plan(plans[("self", 3)])
    target = open_model_folder(models["target"])
    spec = SpeculativeSession(plan, target, target)
    full = spec.generate(validate_request(plan, list(PROMPTS[1]), M)).tokens
    stop = full[4]
    cut = spec.generate(validate_request(plan, list(PROMPTS[1]), M, {stop})).tokens
    assert cut == full[: full.index(stop) + 1]


def test_the_wrong_draft_folder_is_refused_before_allocating(models, plans):
    plan = load_checked_plan(plans[("first_layer", 2)])
    target = open_model_folder(models["target"])
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    with pytest.raises(DctmsError, match="^--draft-model: .*config.json differs"):
        SpeculativeSession(plan, target, target)
    assert mx.get_active_memory() == before
    # A plan without a draft.
    plain = msgspec.structs.replace(plan, draft=None)
    with pytest.raises(DctmsError, match="the plan has no draft model"):
        SpeculativeSession(plain, target, target)


def test_the_run_command_reports_acceptance(models, plans, tmp_path):
    report = tmp_path / "report.json"
    args = ["run", str(plans[("self", 3)]), "--model", str(models["target"])]
    proc = _dctms(
        *args,
        "--draft-model",
        str(models["target"]),
        "--tokens",
        "5,17,33",
        "--report",
        str(report),
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(report.read_text())
    assert data["speculative"]["acceptance"] == 1.0 and data["within_envelope"]
    assert "draft tokens accepted (100.0%)" in proc.stderr
    bad = _dctms(*args, "--draft-model", str(models["first_layer"]), "--tokens", "5,17,33")
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1 and "--draft-model" in bad.stderr


def _dctms(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", *args], capture_output=True, text=True
    )


# ------------------------------------------------------------------------------------- views


def test_show_gives_each_models_part_of_the_envelope(plans):
    from dctms.views.show import show_text

    plan = load_checked_plan(plans[("first_layer", 2)])
    target, draft = plan.envelope.parts
    text = show_text(plan)
    assert "the draft proposes K = 2 tokens per verify call of 3" in text
    section = text.split("speculative decoding:")[1].split("\n\n")[0]
    rows = {line.split()[0]: line for line in section.splitlines() if line.startswith("  ")}
    assert f"{target.weights:,}" in rows["target"] and f"{draft.weights:,}" in rows["draft"]
    assert f"{draft.kv:,}" in rows["draft"] and "qwen2" in rows["draft"]
    assert f"{plan.envelope.weights:,}" in rows["plan"]
    assert "draft decode" in text and "one arena is live at a time" in text
    proc = _dctms("show", str(plans[("first_layer", 2)]), "--json")
    parts = json.loads(proc.stdout)["envelope"]["parts"]
    assert [p["model"] for p in parts] == ["target", "draft"] and parts[1]["kv"] == draft.kv


def test_diff_against_the_target_alone_shows_what_the_draft_adds(models, plans, tmp_path):
    alone = tmp_path / "alone.plan"
    assert _dctms("compile", str(models["target"]), "-N", str(N), "-M", str(M),
                  "--prefill-chunk", str(CHUNK), "-o", str(alone)).returncode == 0  # fmt: skip
    proc = _dctms("diff", str(alone), str(plans[("first_layer", 2)]), "--format", "json")
    assert proc.returncode in (0, 1), proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)["envelope"]}
    plan = load_checked_plan(plans[("first_layer", 2)])
    draft = plan.envelope.parts[1]
    assert rows["draft.weights"]["old"] is None and rows["draft.weights"]["new"] == draft.weights
    assert rows["target.weights"]["delta"] == 0
    assert rows["weights"]["delta"] == draft.weights


def test_fit_with_a_draft_searches_speculative_plans(models, tmp_path):
    capped = write_tiny_model(tmp_path / "capped", {**TARGET, "max_position_embeddings": 40}, 3)
    draft = write_first_layers_draft(capped, tmp_path / "capped-draft", 1)
    proc = _dctms("fit", str(capped), "--draft", str(draft), "--num-draft", "2", "-M", "8",
                  "--memory", "1GiB", "--prefill-chunk", "8", "--json", "-q")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    fit = json.loads(proc.stdout)
    assert [p["model"] for p in fit["parts"]] == ["target", "draft"]
    env = fit["envelope"]
    assert env["weights"] == sum(p["weights"] for p in fit["parts"])
    assert env["intermediate"] == max(p["intermediate"] for p in fit["parts"])


def test_the_inspector_overview_shows_both_models(plans):
    import asyncio

    from dctms.tui.app import InspectorApp
    from dctms.tui.state import Inspection

    plan = load_checked_plan(plans[("first_layer", 2)])
    app = InspectorApp(Inspection(plan, "spec.plan"))
    seen = {}

    async def main() -> None:
        async with app.run_test(size=(140, 60)) as pilot:
            await pilot.pause()
            widget = app.screen.query_one("#models")
            lines = widget.render_lines(widget.size.region)
            seen["text"] = "\n".join(s.text for s in lines)

    asyncio.run(main())
    assert "draft proposes K = 2" in seen["text"]
    assert "target" in seen["text"] and "draft" in seen["text"] and "qwen2" in seen["text"]


def test_a_quantised_kv_cache_is_refused_with_a_draft(models):
    opts = CompileOptions(N, M, prefill_chunk=CHUNK, kv_bits=8)
    with pytest.raises(DctmsError, match="--draft: not supported yet with --kv-bits"):
        compile_speculative(open_model(models["target"]), open_model(models["target"]), opts, 2)


def test_prerecord_leaves_nothing_to_record_during_generation(models, plans, monkeypatch):
    from dctms.runner.execute import PhaseProgram

    plan = load_checked_plan(plans[("first_layer", 4)])
    spec = SpeculativeSession(
        plan, open_model_folder(models["target"]), open_model_folder(models["first_layer"])
    )
    requests = [validate_request(plan, list(p), M) for p in PROMPTS]
    assert spec.prerecord(requests).points > 0
    recorded = []
    original = PhaseProgram._record
    monkeypatch.setattr(
        PhaseProgram, "_record", lambda self, *a: recorded.append(self.name) or original(self, *a)
    )
    for request in requests:
        spec.generate(request)
    assert recorded == []
