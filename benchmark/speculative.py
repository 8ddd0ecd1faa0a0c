"""``dctms bench PLAN --model T --draft-model D``: three systems on the same prompts, interleaved.

- ``runner``: the plan's target alone (``Session.generate``, prefill then decode);
- ``speculative``: the plan with its draft (``SpeculativeSession.generate``, verify calls of K + 1);
- ``mlx-lm-speculative``: mlx-lm's ``speculative_generate_step`` with the same K over the models
  ``mlx_lm.utils.load_model`` loads, under MLX's default limits.

The target's weights are loaded once for both runner systems (the plain runner is the speculative
session's own target ``Session``). Calls go through the A/B protocol's ``run_protocol`` (the three
systems alternate call by call, ``calls.json`` after every call); the summary gives, per system, the
median tok/s over all calls, the acceptance rate (kept draft tokens / proposed), MLX's peak and the
ratios of the speculative runner to the other two, and whether all three produced the same ids.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import mlx.core as mx

import dctms
from dctms.benchmark.systems import MlxLimits, Output, Runner, record_token
from dctms.figures.units import MIB
from dctms.schema.output import write_output

PLAIN, SPECULATIVE, MLX_LM = "runner", "speculative", "mlx-lm-speculative"
LABELS = {
    PLAIN: "dctms runner (target alone)",
    SPECULATIVE: "dctms speculative runner",
    MLX_LM: "mlx-lm speculative_generate_step",
}
SUMMARY_MD = "speculative.md"
SUMMARY_JSON = "speculative.json"


class SpeculativeRunner:
    """The speculative session as a benchmark system."""

    name = SPECULATIVE

    def __init__(self, spec, requests=()):
        self.spec = spec
        self._requests = {(r.prompt, r.max_tokens, r.stop): r for r in requests}
        self.proposed = self.accepted = 0

    def prepare(self) -> None:
        foreign = max(0, mx.get_active_memory() - self.spec.held_bytes())
        self.foreign_bytes = foreign
        self.spec.target.apply_limits(foreign)

    def generate(self, ids: list[int], max_tokens: int, stop: set[int]) -> Output:
        from dctms.runner.request import validate_request

        request = self._requests.get((tuple(ids), max_tokens, frozenset(stop)))
        if request is None:
            request = validate_request(self.spec.plan, ids, max_tokens, stop)
        g = self.spec.generate(request)
        self.last = (g.proposed, g.accepted)
        return Output(g.tokens, g.ttft_s, list(g.token_latencies_s))


class MlxLmSpeculative:
    """mlx-lm's greedy speculative decoding with the plan's K, as ``mlx_lm.generate`` runs it."""

    name = MLX_LM

    def __init__(self, target: Path, draft: Path, num_draft: int, defaults: MlxLimits):
        from mlx_lm.utils import load_model

        self.defaults, self.num_draft = defaults, num_draft
        self.model, _ = load_model(Path(target))
        self.draft, _ = load_model(Path(draft))

    def prepare(self) -> None:
        self.defaults.apply()

    def generate(self, ids: list[int], max_tokens: int, stop: set[int]) -> Output:
        from mlx_lm.generate import generation_stream, speculative_generate_step

        start = last = time.perf_counter()
        out = Output([], 0.0)
        proposed = accepted = 0
        round_open = False
        steps = speculative_generate_step(
            mx.array(ids, dtype=mx.uint32),
            self.model,
            self.draft,
            num_draft_tokens=self.num_draft,
            max_tokens=max_tokens,
        )
        try:
            for token, _logprobs, from_draft in steps:
                if not round_open:  # a round proposes min(K, tokens left) draft tokens
                    proposed += min(self.num_draft, max_tokens - len(out.tokens))
                    round_open = True
                accepted += bool(from_draft)
                round_open = bool(from_draft)  # the target's own token closes the round
                last = record_token(out, token, start, last)
                if token in stop:
                    break
        finally:
            steps.close()
        mx.synchronize(generation_stream)
        self.last = (proposed, accepted)
        return out


def measure_with_acceptance(system, ids: list[int], max_tokens: int, stop: set[int]) -> dict:
    """``systems.measure_call`` plus the call's proposed and accepted draft tokens."""
    from dctms.benchmark.systems import measure_call

    call = measure_call(system, ids, max_tokens, stop)
    proposed, accepted = getattr(system, "last", (0, 0))
    if system.name != PLAIN:
        call["draft_proposed"], call["draft_accepted"] = proposed, accepted
    return call


def summarise(calls: list[dict], prompts: list[str], num_draft: int) -> dict:
    """Median tok/s per system over all calls, acceptance, MLX peak, ratios, id agreement."""
    systems = {}
    for name in (PLAIN, SPECULATIVE, MLX_LM):
        mine = [c for c in calls if c["system"] == name]
        rates = [c["tokens_per_s"] for c in mine if c["tokens_per_s"]]
        proposed = sum(c.get("draft_proposed", 0) for c in mine)
        accepted = sum(c.get("draft_accepted", 0) for c in mine)
        systems[name] = {
            "label": LABELS[name],
            "calls": len(mine),
            "tokens_per_s_median": statistics.median(rates) if rates else None,
            "acceptance": accepted / proposed if proposed else None,
            "mlx_peak_bytes_max": max((c["mlx_peak_bytes"] for c in mine), default=None),
        }

    def ratio(a: str, b: str) -> float | None:
        x, y = systems[a]["tokens_per_s_median"], systems[b]["tokens_per_s_median"]
        return x / y if x and y else None

    same = {}
    for pid in prompts:
        outs = {
            c["system"]: tuple(c["tokens"]) for c in calls if c["prompt"] == pid
        }  # the last call of each system (greedy: every call gives the same ids)
        same[pid] = len(set(outs.values())) == 1 if len(outs) == 3 else None
    return {
        "format": "dctms-bench-speculative/1",
        "num_draft": num_draft,
        "systems": systems,
        "ratios": {
            "speculative_over_runner": ratio(SPECULATIVE, PLAIN),
            "speculative_over_mlx_lm_speculative": ratio(SPECULATIVE, MLX_LM),
        },
        "same_ids": same,
    }


def render(summary: dict) -> str:
    rows = [
        f"## Speculative decoding (K = {summary['num_draft']})",
        "",
        "| system | calls | tok/s (median) | acceptance | MLX peak MiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in summary["systems"].values():
        rate = s["tokens_per_s_median"]
        acc = s["acceptance"]
        peak = s["mlx_peak_bytes_max"]
        rows.append(
            f"| {s['label']} | {s['calls']} | {'n/a' if rate is None else f'{rate:.1f}'} | "
            f"{'—' if acc is None else f'{acc:.1%}'} | "
            f"{'n/a' if peak is None else f'{peak / MIB:.2f}'} |"
        )
    r = summary["ratios"]
    rows += [
        "",
        "tok/s ratios: speculative runner / runner = "
        f"{_fmt(r['speculative_over_runner'])}; speculative runner / mlx-lm speculative = "
        f"{_fmt(r['speculative_over_mlx_lm_speculative'])}",
        "same ids on every system: "
        + ", ".join(f"{pid} {_yes(v)}" for pid, v in summary["same_ids"].items()),
    ]
    return "\n".join(rows) + "\n"


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _yes(v: bool | None) -> str:
    return "n/a" if v is None else ("yes" if v else "NO")


def bench_speculative(
    plan,
    model,
    draft_model,
    prompts,
    requests,
    settings,
    out_dir: Path,
    described: dict,
    say,
    progress=None,
) -> tuple[object, dict]:
    """Load the three systems, run the interleaved protocol into ``out_dir/calls.json``, write the
    summary; returns the protocol's outcome and the summary."""
    from dctms.benchmark.execute import prompt_entries
    from dctms.benchmark.protocol import CALLS_NAME, FORMAT, CallsFile, run_protocol, schedule
    from dctms.runner.speculative import SpeculativeSession

    defaults = MlxLimits.capture()  # before the sessions set the plan's limits
    say(f"loading the runner and its draft ({model.path}, {draft_model.path}) ...")
    spec = SpeculativeSession(plan, model, draft_model)
    say("recording both runners' graphs for every length point the prompts may use ...")
    recorded = [spec.target.prerecord(requests), spec.prerecord(requests)]
    described = {
        **described,
        "runner_setup": f"{sum(r.points for r in recorded)} length points recorded before the "
        f"first call in {sum(r.seconds for r in recorded):.2f} s (set-up, in no call's latency)",
    }
    say("loading mlx-lm's target and draft (mlx_lm.utils.load_model) ...")
    baseline = MlxLmSpeculative(model.path, draft_model.path, plan.draft.num_draft, defaults)
    systems = [Runner(spec.target, requests), SpeculativeRunner(spec, requests), baseline]
    out_dir.mkdir(parents=True, exist_ok=True)
    header = {
        "format": FORMAT,
        "dctms_version": dctms.__version__,
        "status": "running",
        "planned_calls": len(schedule(len(prompts), settings.reps, len(systems))),
        "settings": described,
        "prompts": prompt_entries(prompts),
    }
    calls = CallsFile(out_dir / CALLS_NAME, header)
    outcome = run_protocol(systems, prompts, settings, calls, progress, measure_with_acceptance)
    summary = {
        "dctms_version": dctms.__version__,
        **summarise(outcome.calls, [p.prompt.id for p in prompts], plan.draft.num_draft),
    }
    write(out_dir, summary)
    return outcome, summary


def write(out_dir: Path, summary: dict) -> None:
    import json

    write_output(out_dir / SUMMARY_JSON, (json.dumps(summary, indent=1) + "\n").encode())
    write_output(out_dir / SUMMARY_MD, render(summary).encode())
