"""Target memory models (schema.targets): metal and cuda from MLX's allocator source, compiled on
this CPU-only machine, re-derived by the verifier, refused by the runner here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from msgspec.structs import replace

from dctms.schema.errors import DctmsError
from dctms.schema.model_folder import model_from_config
from dctms.schema.rules_derived import rounding_bytes
from dctms.schema.sizes import is_arena_tenant, slack_bytes
from dctms.schema.targets import (
    METAL_OPS,
    allocator_slack,
    counted,
    derive,
    rounded,
    run_ahead_budget,
    unsupported_mlx,
)
from dctms.schema.types import Plan
from dctms.schema.verify import verify_plan
from dctms.toolkit.compiler import CompileOptions, compile_plan
from dctms.toolkit.tiny_model import DEMO_CONFIG

ROOT = Path(__file__).resolve().parents[1]
KIB = 1024
PAGE = 16 * KIB


def _compile(target: str | None, **extra) -> Plan:
    opts = CompileOptions(
        input_tokens=32, output_tokens=8, target=target, pack_seconds=0.0, **extra
    )
    return compile_plan(model_from_config(DEMO_CONFIG), opts)


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {t: _compile(t) for t in ("metal", "cuda")} | {"cpu": _compile(None)}


# --- the models, against MLX's source --------------------------------------------------------


def test_metal_rounds_above_a_page_only() -> None:
    m = derive("metal", "apple-m4-16gb")
    # allocator.cpp:123-126: size > vm_page_size -> whole pages; at or below it, as asked
    assert [rounded(m, n) for n in (0, 1, 255, 256, PAGE, PAGE + 1, 3 * PAGE)] == [
        0,
        1,
        255,
        256,
        PAGE,
        2 * PAGE,
        3 * PAGE,
    ]


def test_cuda_rounds_small_pool_powers_of_two_and_pages() -> None:
    m = derive("cuda", "apple-m4-16gb")
    # allocator.cpp:171-176: <= 8 -> 8; < page -> next power of two; else pages
    assert [rounded(m, n) for n in (1, 8, 9, 100, 4097, PAGE - 1, PAGE, PAGE + 1)] == [
        8,
        8,
        16,
        128,
        8192,
        PAGE,
        PAGE,
        2 * PAGE,
    ]


@pytest.mark.parametrize("name", ["metal", "cuda"])
def test_counted_is_the_largest_cached_buffer_mlx_may_hand_out(name: str) -> None:
    m = derive(name, "apple-m4-16gb")
    for n in (1, 100, 300, 5000, PAGE, PAGE + 1, 10 * PAGE + 7):
        r = rounded(m, n)
        # buffer_cache.h:33-34 refuses a cached s >= min(2 r, r + 2 pages): the largest served is one less
        assert counted(m, n) == max(r, min(2 * r, r + 2 * PAGE) - 1)
        assert counted(m, n) - r < 2 * PAGE


def test_metal_ops_per_buffer_follow_the_profile_class() -> None:
    assert derive("metal", "apple-m4-16gb").ops_per_buffer == METAL_OPS["g"] == 40
    assert derive("metal", "apple-m4-max").ops_per_buffer == METAL_OPS["s"] == 50
    assert derive("metal", "cpu-x86-2core").ops_per_buffer == 50  # no class: the largest
    assert derive("cuda", "nvidia-h100-sxm").ops_per_buffer == 100
    assert derive("cuda", "nvidia-a100-sxm").ops_per_buffer == 20
    assert derive("cuda", "apple-m4-16gb").ops_per_buffer == 100  # no NVIDIA class: the largest
    m = derive("metal", "apple-m4-16gb")
    assert run_ahead_budget(m) == (10 + 1) * (40 + 1)
    assert allocator_slack(m) == 2 * PAGE


def test_unsupported_mlx_is_one_line() -> None:
    assert unsupported_mlx("0.32.4") is None
    why = unsupported_mlx("0.33.0")
    assert why is not None and "0.33.0" in why and "0.32.x" in why and "\n" not in why


# --- compiled plans ---------------------------------------------------------------------------


def test_gpu_plans_compile_here_and_verify(plans: dict[str, Plan]) -> None:
    for name in ("metal", "cuda"):
        plan = plans[name]
        assert verify_plan(plan) == []
        assert plan.target.backend == "gpu"
        assert plan.target.memory_model == derive(name, plan.target.profile.name)
        assert plan.target.run_ahead_dispatches == run_ahead_budget(plan.target.memory_model)
        assert not any("fused kernels" in n for n in plan.target.memory_model.not_modelled)
        # the CPU trace with MLX's fused kernels as single ops (toolkit.fused_kernels)
        prims = {o.primitive for p in plan.phases for o in p.ops}
        assert {"RMSNorm", "RoPE", "ScaledDotProductAttention"} <= prims
        assert [len(p.ops) for p in plan.phases] < [len(p.ops) for p in plans["cpu"].phases]
        assert plan.model.weights.fused == []


def test_gpu_plans_cover_rounding_reuse_and_command_buffers(plans: dict[str, Plan]) -> None:
    cpu = plans["cpu"]
    for name in ("metal", "cuda"):
        plan, model = plans[name], plans[name].target.memory_model
        block = {s.name: s.bytes for s in plan.state}["allocator.rounding"]
        assert block == rounding_bytes(model, plan) > 0
        for phase in plan.phases:
            want = slack_bytes(phase.tensors, len(phase.slots), 0, model)
            assert phase.slack_bytes == want > 0
        # command buffers hold tensors longer than the CPU's run-ahead: a larger arena
        assert plan.envelope.intermediate > cpu.envelope.intermediate


def test_cross_compile_is_deterministic() -> None:
    from dctms.schema.io import encode_plan

    assert encode_plan(_compile("cuda")) == encode_plan(_compile("cuda"))


@pytest.mark.parametrize(
    ("target", "extra", "says"),
    [
        ("tpu", {}, "expected cpu, metal[-PROFILE]"),
        ("cpu-apple-m1", {}, "expected cpu"),
        ("metal-nope", {}, "unknown target profile"),
        ("metal", {"backend": "cpu"}, "not --backend cpu"),
        ("cpu", {"backend": "gpu"}, "pick one"),
        ("metal-apple-m1", {"profile": "apple-m4-max"}, "two profiles"),
        ("cuda", {"ranks": 2, "parallel": "pipeline"}, "not supported with --ranks"),
        ("cuda-nvidia-a100-sxm", {"profile": "nvidia-h100-sxm"}, "two profiles"),
    ],
)
def test_bad_targets_are_refused(target: str, extra: dict, says: str) -> None:
    with pytest.raises(DctmsError, match=None) as err:
        _compile(target, **extra)
    assert says in str(err.value) and "\n" not in str(err.value)


# --- the verifier re-derives the model: every field it records, broken -----------------------


def _model(plan: Plan, **changes) -> Plan:
    target = replace(plan.target, memory_model=replace(plan.target.memory_model, **changes))
    return replace(plan, target=target)


def _target(plan: Plan, **changes) -> Plan:
    return replace(plan, target=replace(plan.target, **changes))


BREAKS = [
    ("memory_model", "ops per buffer lowered", lambda p: _model(p, ops_per_buffer=20)),
    ("memory_model", "page shrunk", lambda p: _model(p, page_bytes=4096)),
    ("memory_model", "small bound changed", lambda p: _model(p, small_bytes=8)),
    ("memory_model", "outstanding buffers lowered", lambda p: _model(p, active_tasks=2)),
    ("memory_model", "a caveat dropped", lambda p: _model(p, not_modelled=[])),
    ("memory_model", "an MLX it was not written from", lambda p: _model(p, mlx="0.31")),
    ("memory_model", "on the cpu backend", lambda p: _target(p, backend="cpu")),
    ("memory_model", "slack lowered", lambda p: _target(p, allocator_slack=16384)),
    (
        "memory_model",
        "the request names another target",
        lambda p: replace(p, compile=replace(p.compile, target="cuda")),
    ),
    (
        "memory_model",
        "the model dropped while the request asks for metal",
        lambda p: _target(p, memory_model=None),
    ),
    (
        "slack_bytes",
        "rounding slack lowered",
        lambda p: replace(
            p, phases=[replace(p.phases[0], slack_bytes=p.phases[0].slack_bytes - 1), *p.phases[1:]]
        ),
    ),
    (
        "persistent_state",
        "the rounding block dropped",
        lambda p: replace(
            p,
            state=[s for s in p.state if s.name != "allocator.rounding"],
            envelope=replace(
                p.envelope,
                persistent=p.envelope.persistent
                - {s.name: s.bytes for s in p.state}["allocator.rounding"],
            ),
        ),
    ),
    ("run_ahead", "lifetimes cut to the CPU's throttled run-ahead", lambda p: _short(p)),
]


def _short(plan: Plan) -> Plan:
    """Every arena tenant of prefill ends at its producer's slot (no command-buffer widening)."""
    phase = plan.phases[0]
    tensors = [
        replace(t, interval=[t.interval[0], t.interval[0]])
        if is_arena_tenant(t) and t.kind != "output"
        else t
        for t in phase.tensors
    ]
    return replace(plan, phases=[replace(phase, tensors=tensors), *plan.phases[1:]])


def _rule_name(rule: str) -> str:
    # slack_bytes is checked inside the arena_bounds rule
    return {"slack_bytes": "arena_bounds"}.get(rule, rule)


@pytest.mark.parametrize(
    ("rule", "how", "breaker"), BREAKS, ids=[f"{r}: {h}" for r, h, _ in BREAKS]
)
def test_a_broken_gpu_model_is_refused(plans: dict[str, Plan], rule, how, breaker) -> None:
    problems = verify_plan(breaker(plans["metal"]))
    assert _rule_name(rule) in {p.rule for p in problems}, f"{how}: {[str(p) for p in problems]}"


# --- command line -----------------------------------------------------------------------------


def _dctms(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    from dctms.toolkit.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", DEMO_CONFIG)


def test_compile_metal_here_says_compiled_only_and_run_refuses(tiny_folder: Path, tmp_path) -> None:
    plan = tmp_path / "metal.plan"
    out = _dctms(
        "compile",
        str(tiny_folder),
        "-N",
        "16",
        "-M",
        "4",
        "--target",
        "metal",
        "--pack-seconds",
        "0",
        "-o",
        str(plan),
    )
    assert out.returncode == 0, out.stderr
    assert "modelled from MLX's metal allocator source (not measured)" in out.stderr
    assert "this machine's MLX has no metal: compiled only" in out.stderr
    shown = _dctms("show", str(plan))
    assert "target metal (gpu backend" in shown.stdout
    assert "modelled from MLX 0.32's allocator source, not measured" in shown.stdout
    assert "not modelled: temporaries the GPU kernels allocate themselves" in shown.stdout
    ran = _dctms("run", str(plan), "--model", str(tiny_folder), "--prompt", "hi")
    assert ran.returncode == 2
    lines = ran.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and "plan targets metal" in lines[0]
        and "has no GPU (it runs on cpu)" in lines[0]
    )


def test_compile_refuses_a_bad_target_in_one_line(tiny_folder: Path, tmp_path) -> None:
    out = _dctms(
        "compile",
        str(tiny_folder),
        "-N",
        "16",
        "-M",
        "4",
        "--target",
        "rocm",
        "-o",
        str(tmp_path / "x.plan"),
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "--target 'rocm'" in out.stderr


# --- the supported MLX ------------------------------------------------------------------------


def test_an_unknown_mlx_is_refused_at_start_in_one_line(monkeypatch, capsys, tmp_path) -> None:
    import importlib.metadata

    from dctms.cli.main import main

    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "0.33.0" if name == "mlx" else real(name)
    )
    status = main(["compile", str(tmp_path / "none.json"), "-N", "4", "-M", "4", "-o", "-"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1
    assert "mlx 0.33.0 is not supported" in err[0] and "0.32.x" in err[0]
    # a command that does not run MLX reads plans whatever MLX is installed
    assert main(["validate", str(ROOT / "plans" / "qwen1.5b.plan")]) == 0


def test_a_missing_mlx_is_refused_with_the_extras_to_install(monkeypatch) -> None:
    import importlib.metadata

    from dctms.schema import targets

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    why = targets.mlx_refusal()
    assert why is not None and "dctms[cpu]" in why and "dctms[cuda]" in why


def test_pyproject_states_the_supported_range_and_backend_extras() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "mlx>=0.32,<0.33" in project["dependencies"]
    extras = project["optional-dependencies"]
    assert extras["cpu"] == ["mlx[cpu]>=0.32,<0.33; platform_system == 'Linux'"]
    assert extras["cuda"] == ["mlx[cuda]>=0.32,<0.33; platform_system == 'Linux'"]
    from dctms.schema.targets import SUPPORTED_MLX

    assert SUPPORTED_MLX == ("0.32",)


def test_a_gpu_plan_runs_only_on_its_own_gpu(plans: dict[str, Plan], monkeypatch) -> None:
    from dctms.runner import load

    for device, metal, cuda in (
        ("cpu", "has no GPU (it runs on cpu)", "has no GPU (it runs on cpu)"),
        ("cuda", "runs on cuda", None),
        ("metal", None, "runs on metal"),
    ):
        monkeypatch.setattr(load, "runner_device", lambda device=device: device)
        for name, says in (("metal", metal), ("cuda", cuda)):
            why = load.device_refusal(plans[name])
            if says is None:
                assert why is None, (device, name)
            else:
                assert why is not None and f"plan targets {name}" in why and says in why
                assert "\n" not in why
        assert load.device_refusal(plans["cpu"]) is None  # the CPU runs everywhere


def test_kernel_ops_count_what_may_encode_no_kernel_as_none(plans: dict[str, Plan]) -> None:
    from dctms.schema.rules_derived import op_dispatches
    from dctms.schema.targets import kernel_ops

    assert kernel_ops("Reshape", False, False) == 0  # MLX may reshape as a view
    assert kernel_ops("AsType", False, False) == 0  # to its own dtype it returns early
    assert kernel_ops("Matmul", False, True) == 0  # an empty output encodes nothing
    assert kernel_ops("Matmul", False, False) == 1
    phase = plans["metal"].phases[0]
    counts = op_dispatches(phase, list(range(len(phase.ops))), kernels=True)
    by = {op.primitive: c for op, c in zip(phase.ops, counts, strict=True)}
    assert by["Matmul"] == 1 and by["Reshape"] == 0 and by["Transpose"] == 0
