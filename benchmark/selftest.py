"""``dctms selftest [--backend cpu|gpu]``: on the user's own machine, compile a tiny model there,
run it, and compare the provable peak with MLX's observed peak and the generated ids with mlx-lm's.

This is how a user confirms a target memory model on their hardware: on a Mac's GPU or an NVIDIA
GPU the plan is compiled with ``--target metal`` or ``--target cuda``, whose envelope is modelled
from MLX's source (``schema.targets``); the self-test puts the measured peak beside it and beside
the simulator's figure (``toolkit.simulate``), and writes a JSON report to attach to an issue.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

import dctms
from dctms.runner.load import runner_device
from dctms.schema.errors import DctmsError
from dctms.schema.io import write_plan
from dctms.schema.model_folder import open_model
from dctms.toolkit.compiler import CompileOptions, compile_plan
from dctms.toolkit.simulate import simulate
from dctms.toolkit.tiny_model import DEMO_CONFIG, write_tiny_model

PROMPT = list(range(40, 64))  # 24 byte tokens of the tiny model's byte-level vocabulary
INPUT_TOKENS, OUTPUT_TOKENS = 32, 16


@dataclass(frozen=True)
class SelftestReport:
    dctms: str
    mlx: str
    machine: str
    device: str  # cpu | metal | cuda
    target: str  # the plan's target memory model
    modelled: bool  # the target's memory model is modelled from source (not yet measured)
    provable_bytes: int
    observed_mlx_peak_bytes: int
    simulated_peak_bytes: int
    within_envelope: bool
    ids_equal: bool
    runner_ids: list[int]
    mlx_lm_ids: list[int]

    @property
    def ok(self) -> bool:
        return self.within_envelope and self.ids_equal


def target_for(backend: str) -> str:
    """The target a self-test of ``backend`` compiles for on this machine (refused in one line)."""
    if backend == "cpu":
        return "cpu"
    device = runner_device()
    if device == "cpu":
        raise DctmsError(
            "--backend gpu: this machine's MLX has no GPU (it runs on cpu); run the self-test on a "
            "Mac or an NVIDIA machine with mlx[cuda], or without --backend gpu"
        )
    return device


def run_selftest(backend: str, work: Path | None = None, say=print) -> SelftestReport:
    target = target_for(backend)
    with tempfile.TemporaryDirectory() as tmp:
        root = work or Path(tmp)
        folder = root / "tiny-qwen2"
        say(f"selftest: a tiny random-weight qwen2 model in {folder}")
        write_tiny_model(folder, DEMO_CONFIG)
        opts = CompileOptions(INPUT_TOKENS, OUTPUT_TOKENS, target=target, pack_seconds=0.0)
        plan = compile_plan(open_model(folder), opts)
        plan_path = root / f"selftest-{target}.plan"
        write_plan(plan, plan_path)
        say(f"selftest: compiled {plan_path.name} (target {target}); running it in a fresh process")
        run = _run_plan(plan_path, folder)
        reference = mlx_lm_ids(folder, PROMPT, OUTPUT_TOKENS, backend)
        sim = simulate(plan)
    model = plan.target.memory_model
    return SelftestReport(
        dctms=dctms.__version__,
        mlx=mx.__version__,
        machine=f"{platform.system()} {platform.machine()}",
        device=runner_device() if backend == "gpu" else "cpu",
        target=target,
        modelled=model is not None,
        provable_bytes=plan.envelope.provable,
        observed_mlx_peak_bytes=run["observed"]["mlx_peak_bytes"],
        simulated_peak_bytes=sim.peak,
        within_envelope=bool(run["within_envelope"]),
        ids_equal=run["tokens"] == reference,
        runner_ids=list(run["tokens"]),
        mlx_lm_ids=reference,
    )


def _run_plan(plan_path: Path, folder: Path) -> dict:
    """``dctms run`` in a fresh process (its MLX peak is its own), its JSON report."""
    report = plan_path.with_suffix(".run.json")
    ids = ",".join(map(str, PROMPT))
    cmd = [sys.executable, "-m", "dctms.cli.main", "run", str(plan_path), "--model", str(folder)]
    cmd += ["--tokens", ids, "--ignore-eos", "--max-tokens", str(OUTPUT_TOKENS)]
    cmd += ["--report", str(report)]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode not in (0, 3) or not report.exists():
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise DctmsError(f"selftest: dctms run failed (exit {proc.returncode}): {why}")
    return json.loads(report.read_text())


def mlx_lm_ids(folder: Path, prompt: list[int], max_tokens: int, backend: str) -> list[int]:
    """mlx-lm's own greedy ids for ``prompt`` on ``backend``'s device."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    mx.set_default_device(mx.gpu if backend == "gpu" else mx.cpu)
    model, _ = load_model(folder)
    steps = generate_step(mx.array(prompt, dtype=mx.int32), model, max_tokens=max_tokens)
    try:
        return [int(token) for token, _ in steps]
    finally:
        steps.close()


def report_text(r: SelftestReport) -> list[str]:
    how = "modelled from MLX's source" if r.modelled else "the CPU model"
    ratio = r.provable_bytes / r.observed_mlx_peak_bytes if r.observed_mlx_peak_bytes else 0.0
    return [
        f"selftest: dctms {r.dctms}, mlx {r.mlx}, {r.machine}, device {r.device}, target "
        f"{r.target} ({how})",
        f"  {'provable peak':<22} {r.provable_bytes:>14,} B",
        f"  {'simulated peak':<22} {r.simulated_peak_bytes:>14,} B  (dctms simulate, the model)",
        f"  {'observed MLX peak':<22} {r.observed_mlx_peak_bytes:>14,} B  (measured on this machine)",
        f"  within envelope: {'yes' if r.within_envelope else 'NO'} (provable / observed = "
        f"{ratio:.3f})",
        f"  ids equal to mlx-lm's: {'yes' if r.ids_equal else 'NO'} ({len(r.runner_ids)} tokens)",
        f"selftest: {'passed' if r.ok else 'FAILED'}",
    ]


def report_json(r: SelftestReport) -> str:
    return json.dumps(asdict(r) | {"ok": r.ok}, indent=2) + "\n"
