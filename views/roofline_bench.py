"""Roofline prediction against a ``dctms bench`` measurement of the same plan: per prompt, the
runner's measured TTFT against the TTFT predicted for that prompt's length, and the runner's pooled
decode tok/s against the predicted one. Every ratio is predicted time / measured time (for decode:
measured tok/s / predicted tok/s), the fraction of the roofline the run reaches: 1 would be a run at
the target's peak figures, below 1 is time the roofline does not count (dispatch, kernels below
peak, other processes)."""

from __future__ import annotations

import json
from pathlib import Path

from dctms.figures.roofline import plan_roofline
from dctms.schema.errors import DctmsError
from dctms.schema.types import Plan, TargetProfile

SUMMARY_FORMAT = "dctms-bench-summary/1"
RUNNER = "runner"


def read_bench_summary(path: str | Path) -> dict:
    """A bench ``summary.json`` (or the bench output folder holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "summary.json"
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DctmsError(f"{p}: no such bench summary (run `dctms bench` first)") from None
    except (OSError, ValueError) as err:
        raise DctmsError(f"{p}: unreadable bench summary: {err}") from None
    if not isinstance(doc, dict) or doc.get("format") != SUMMARY_FORMAT:
        raise DctmsError(f"{p}: not a dctms bench summary (format {SUMMARY_FORMAT})")
    return doc


def _ratio(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return predicted / measured


def compare_with_bench(plan: Plan, profile: TargetProfile, summary: dict) -> dict:
    """Rows per prompt and the decode line, JSON-ready."""
    try:
        per_prompt = summary["per_prompt"]
        measured_decode = summary["systems"][RUNNER]["decode_tokens_per_s"]
        prompts = summary["prompts"]
    except (KeyError, TypeError):
        raise DctmsError("bench summary lacks per_prompt / systems.runner / prompts") from None
    rows = []
    for entry in prompts:
        tokens = entry.get("tokens")
        got = (per_prompt.get(entry.get("id")) or {}).get(RUNNER) or {}
        if not isinstance(tokens, int) or tokens < 1:
            continue
        predicted_ms = plan_roofline(plan, profile, tokens).ttft_s * 1000
        measured_ms = got.get("ttft_mean_ms")
        rows.append(
            {
                "prompt": entry["id"],
                "tokens": tokens,
                "ttft_measured_ms": measured_ms,
                "ttft_predicted_ms": predicted_ms,
                "ratio": _ratio(predicted_ms, measured_ms),
            }
        )
    predicted_decode = plan_roofline(plan, profile).decode_tokens_per_s
    return {
        "bench_plan": (summary.get("settings") or {}).get("plan"),
        "ttft": rows,
        "decode": {
            "measured_tokens_per_s": measured_decode,
            "predicted_tokens_per_s": predicted_decode,
            # predicted time / measured time = measured tok/s / predicted tok/s
            "ratio": _ratio(measured_decode, predicted_decode),
        },
    }
