"""``dctms simulate``: every plan's simulated active-memory peak stays within its provable envelope
(random plans of every target, every checked-in plan), and the simulator catches a plan that is not
(it does not reuse the compiler's lifetimes)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from msgspec.structs import replace

from dctms.schema.io import read_plan
from dctms.schema.model_folder import model_from_config
from dctms.schema.targets import derive
from dctms.toolkit import compiler
from dctms.toolkit.compiler import CompileOptions, compile_plan
from dctms.toolkit.simulate import Allocator, simulate

ROOT = Path(__file__).resolve().parents[1]
CHECKED_IN = sorted((ROOT / "plans").glob("*.plan"))


def _random_config(rng: random.Random) -> dict:
    heads = rng.choice([2, 4])
    kv_heads = rng.choice([h for h in (1, 2) if heads % h == 0])
    return {
        "model_type": rng.choice(["qwen2", "llama"]),
        "hidden_size": heads * rng.choice([8, 16, 32]),
        "num_hidden_layers": rng.randint(1, 3),
        "intermediate_size": rng.choice([48, 96, 200]),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": rng.choice([97, 257, 1000]),
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": rng.random() < 0.5,
        "torch_dtype": rng.choice(["float32", "bfloat16"]),
    }


def _random_plan(seed: int, target: str | None):
    rng = random.Random(seed)
    config = _random_config(rng)
    n = rng.randint(1, 40)
    opts = CompileOptions(
        input_tokens=n,
        output_tokens=rng.randint(1, 16),
        prefill_chunk=rng.choice([None, max(1, n // 2)]),
        sync_every=rng.choice([0, 0, 1]),
        run_ahead=rng.choice(["free", "throttled"]) if target is None else "free",
        target=target,
        alignment=rng.choice([16, 64, 256]),
        pack_seconds=0.0,
        real_lengths=False,
    )
    return compile_plan(model_from_config(config), opts)


@pytest.mark.parametrize("target", [None, "metal", "metal-apple-m4-max", "cuda"])
@pytest.mark.parametrize("seed", range(6))
def test_random_plans_stay_within_their_envelope(seed: int, target: str | None) -> None:
    plan = _random_plan(seed, target)
    sim = simulate(plan)
    assert sim.ok, (sim.peak, sim.provable, sim.phases)
    assert sim.peak >= sim.static > 0
    if target is not None:  # the worst reuse bounds the replay
        assert all(p.worst >= p.replay for p in sim.phases)


@pytest.mark.parametrize("path", CHECKED_IN, ids=[p.name for p in CHECKED_IN])
def test_checked_in_plans_stay_within_their_envelope(path: Path) -> None:
    sim = simulate(read_plan(path))
    assert sim.ok, (sim.peak, sim.provable)
    # the CPU plans' arenas are tight: the simulated peak is within 1 % of the envelope
    assert sim.peak > 0.99 * sim.provable


def test_the_checked_in_plans_are_found() -> None:
    assert len(CHECKED_IN) >= 2


def test_a_plan_under_its_command_buffers_is_caught(monkeypatch) -> None:
    """A metal plan whose lifetimes are widened by 10 kernel ops only (as if each command buffer
    completed at once): its envelope is too small, and the simulator, which plays MLX's command
    buffers itself, says so."""
    monkeypatch.setattr(compiler, "run_ahead_budget", lambda model: 10)
    monkeypatch.setattr(compiler, "self_check", lambda plan: None)  # the verifier would refuse it
    config = _random_config(random.Random(1)) | {"num_hidden_layers": 3}
    opts = CompileOptions(input_tokens=32, output_tokens=4, target="metal", pack_seconds=0.0)
    plan = compile_plan(model_from_config(config), opts)
    assert not simulate(plan).ok


def test_a_smaller_envelope_is_caught() -> None:
    plan = _random_plan(0, "cuda")
    sim = simulate(plan)
    env = plan.envelope
    short = env.intermediate - (sim.provable - sim.peak) - 1
    smaller = replace(plan, envelope=replace(env, intermediate=short))
    assert not simulate(smaller).ok


def test_the_cache_serves_as_mlx_does() -> None:
    page = 16384
    a = Allocator(derive("metal", "apple-m4-16gb"), cache=True)
    a.free(a.malloc(3 * page))  # a 3-page buffer cached
    assert a.malloc(2 * page) == 3 * page  # 2p <= 3p < min(4p, 4p): reused, counted whole
    a.free(3 * page)
    assert a.malloc(page) == page  # 3p >= min(2p, 3p): not reused, a new 1-page buffer
    assert a.malloc(100) == 100  # small: as asked
    c = Allocator(derive("cuda", "apple-m4-16gb"), cache=False)
    assert c.malloc(100) == 128 and c.malloc(3) == 8


def _dctms(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", *args], capture_output=True, text=True, timeout=120
    )


def test_command_line(tmp_path: Path) -> None:
    from dctms.schema.io import write_plan

    path = tmp_path / "metal.plan"
    write_plan(_random_plan(2, "metal"), path)
    out = _dctms("simulate", str(path))
    assert out.returncode == 0, out.stderr
    assert "modelled from MLX's allocator source, not measured" in out.stdout
    assert "within the provable envelope" in out.stdout
    doc = json.loads(_dctms("simulate", str(path), "--json").stdout)
    assert doc["ok"] and doc["peak"] <= doc["provable"] and doc["target"] == "metal"
    bad = _dctms("simulate", str(tmp_path / "missing.plan"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_speculative_and_vision_plans_stay_within_their_envelope() -> None:
    from dctms.toolkit.kinds.dispatch import Images, PlanKind, compile_kind
    from dctms.toolkit.tiny_model import DEMO_CONFIG
    from dctms.toolkit.vision.tiny import gemma3_config

    opts = CompileOptions(input_tokens=24, output_tokens=4, pack_seconds=0.0)
    draft = compile_kind(
        model_from_config(DEMO_CONFIG), opts, PlanKind(draft=model_from_config(DEMO_CONFIG))
    )
    sim = simulate(draft)
    assert sim.ok and [p.name for p in sim.phases][-2:] == ["draft prefill", "draft decode"]
    # both models' weights are allocated: the static part is above the target's own weights
    assert sim.static > draft.envelope.parts[0].weights + draft.envelope.parts[1].weights
    vision = compile_kind(
        model_from_config(gemma3_config()), opts, PlanKind(images=Images(1, 32, 32))
    )
    assert simulate(vision).ok
