"""The benchmark's summary: figures per system and prompt, ratios with intervals, ``summary.md``.

``summarise`` works on plain call records (the contents of ``calls.json``), so a summary can be
rebuilt from any ``calls.json``, complete or partial."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from dctms.benchmark import stats
from dctms.benchmark.parity import parity_rows, render_parity
from dctms.benchmark.systems import BASELINE, LABELS, RUNNER
from dctms.figures.units import MIB
from dctms.schema.output import write_output

SUMMARY_MD = "summary.md"
SUMMARY_JSON = "summary.json"


def summarise(
    header: dict,
    calls: Sequence[dict],
    resamples: int = stats.DEFAULT_RESAMPLES,
    seed: int = stats.DEFAULT_SEED,
) -> dict:
    """Figures over the paired calls: a (repetition, prompt) counts once both systems ran it, so
    both systems' statistics always cover the same prompts (after Ctrl-C the last call may be
    alone; it stays in ``calls.json`` and is left out here)."""
    prompt_ids = [p["id"] for p in header["prompts"]]
    all_calls = calls
    calls = paired(calls)
    groups = {
        (pid, sys): stats.Sample.of([c for c in calls if c["prompt"] == pid and c["system"] == sys])
        for pid in prompt_ids
        for sys in (BASELINE, RUNNER)
    }
    systems = {
        sys: stats.describe(stats.pool([groups[pid, sys] for pid in prompt_ids]))
        for sys in (BASELINE, RUNNER)
    }
    per_prompt = {
        pid: {sys: stats.describe(groups[pid, sys]) for sys in (BASELINE, RUNNER)}
        for pid in prompt_ids
    }

    def ratios(pids: list[str], scope: str) -> dict:
        return stats.bootstrap_ratios(
            [groups[pid, RUNNER] for pid in pids],
            [groups[pid, BASELINE] for pid in pids],
            scope=scope,
            resamples=resamples,
            seed=seed,
        )

    ratio = {"all": ratios(prompt_ids, "all")}
    ratio.update({pid: ratios([pid], pid) for pid in prompt_ids})
    summary = {
        "format": "dctms-bench-summary/1",
        "dctms_version": header.get("dctms_version"),
        "status": header.get("status"),
        "completed_calls": len(all_calls),
        "paired_calls": len(calls),
        "planned_calls": header.get("planned_calls"),
        "settings": header.get("settings", {}),
        "prompts": header["prompts"],
        "bootstrap": {
            "resamples": resamples,
            "seed": seed,
            "confidence": stats.DEFAULT_CONFIDENCE,
            "method": "percentile; each system resampled independently, stratified by prompt",
        },
        "systems": systems,
        "per_prompt": per_prompt,
        "ratios": ratio,
        "greedy_agreement": agreement(calls, prompt_ids),
    }
    summary["parity"] = parity_rows(summary, calls)
    return summary


def paired(calls: Sequence[dict]) -> list[dict]:
    """The calls whose (repetition, prompt) both systems completed."""
    seen: dict[tuple, set[str]] = {}
    for c in calls:
        seen.setdefault((c.get("rep"), c["prompt"]), set()).add(c["system"])
    both = {k for k, v in seen.items() if {BASELINE, RUNNER} <= v}
    return [c for c in calls if (c.get("rep"), c["prompt"]) in both]


def agreement(calls: Sequence[dict], prompt_ids: list[str]) -> dict:
    """Per prompt: whether each system repeated itself across reps, and whether the two agree."""
    out = {}
    for pid in prompt_ids:
        seqs = {
            sys: [c["tokens"] for c in calls if c["prompt"] == pid and c["system"] == sys]
            for sys in (BASELINE, RUNNER)
        }
        if not seqs[BASELINE] or not seqs[RUNNER]:
            out[pid] = None
            continue
        b, r = seqs[BASELINE][0], seqs[RUNNER][0]
        common = next((i for i, (x, y) in enumerate(zip(b, r, strict=False)) if x != y), None)
        out[pid] = {
            "identical": b == r,
            "common_prefix": min(len(b), len(r)) if common is None else common,
            "baseline_tokens": len(b),
            "runner_tokens": len(r),
            "baseline_repeatable": all(s == b for s in seqs[BASELINE]),
            "runner_repeatable": all(s == r for s in seqs[RUNNER]),
        }
    return out


def _f(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _mib(value: int | None) -> str:
    return "–" if value is None else f"{value / MIB:,.1f}"


def _r(entry: dict) -> str:
    if entry["ratio"] is None:
        return "–"
    text = f"{entry['ratio']:.3f}"
    if entry["low"] is not None:
        text += f" [{entry['low']:.3f}, {entry['high']:.3f}]"
    return text


def render_markdown(summary: dict, figures: Sequence[str] = (), figure_note: str = "") -> str:
    s = summary["settings"]
    done, planned = summary["completed_calls"], summary["planned_calls"]
    status = summary["status"]
    lines = ["# dctms bench: plan runner vs mlx-lm baseline", ""]
    if status != "complete":
        lines += [
            f"**Partial result ({status})**: {done} of {planned} calls completed; every figure "
            "below covers the completed calls only.",
            "",
        ]
    unpaired = done - summary.get("paired_calls", done)
    if unpaired:
        lines += [
            f"{unpaired} call(s) whose counterpart on the other system did not complete are kept "
            "in `calls.json` but left out of the statistics, so both systems cover the same "
            "prompts.",
            "",
        ]
    lines += ["## Settings", ""]
    for key, label in (
        ("plan", "plan"),
        ("model", "model folder"),
        ("bounds", "plan bounds"),
        ("reps", "repetitions per prompt and system"),
        ("max_tokens", "max tokens per call"),
        ("warmup", "warm-up calls per system (not counted)"),
        ("decoding", "decoding"),
        ("stop", "stop"),
        ("tokenization", "tokenisation"),
        ("order", "order"),
        ("baseline", "baseline"),
        ("runner", "runner"),
        ("runner_setup", "runner set-up"),
        ("process", "process"),
        ("machine", "machine"),
        ("blas", "BLAS"),
        ("versions", "versions"),
    ):
        if key in s:
            lines.append(f"- {label}: {s[key]}")
    prompts = ", ".join(
        f"{p['id']} {p['category']} ({p['tokens']} tokens)" for p in summary["prompts"]
    )
    lines += [f"- prompts: {prompts}", f"- calls: {done} of {planned}", ""]

    lines += [
        "## All prompts (layout of the paper's Tables 2 and 3)",
        "",
        "| System | μ_L (ms) | σ_L (ms) | CV_L | tok/s | peak RSS (MiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for sys in (BASELINE, RUNNER):
        d = summary["systems"][sys]
        lines.append(
            f"| {LABELS[sys]} | {_f(d['mean_ms'])} | {_f(d['std_ms'])} | {_f(d['cv'], 3)} "
            f"| {_f(d['tokens_per_s'])} | {_mib(d['rss_peak_bytes'])} |"
        )
    a = summary["ratios"]["all"]
    lines.append(
        f"| runner ÷ baseline | {_r(a['mean_ms'])} | {_r(a['std_ms'])} | {_r(a['cv'])} "
        f"| {_r(a['tokens_per_s'])} | {_r(a['rss_peak_bytes'])} |"
    )
    lines += [""]

    lines += [
        "## Per prompt",
        "",
        "| Prompt | System | n | μ_L (ms) | σ_L (ms) | CV_L | P50 (ms) | P99 (ms) | TTFT (ms) "
        "| tokens | tok/s | decode tok/s | peak RSS (MiB) | MLX peak (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for pid, by_sys in summary["per_prompt"].items():
        for sys in (BASELINE, RUNNER):
            d = by_sys[sys]
            lines.append(
                f"| {pid} | {LABELS[sys]} | {d['n']} | {_f(d['mean_ms'])} | {_f(d['std_ms'])} "
                f"| {_f(d['cv'], 3)} | {_f(d['p50_ms'])} | {_f(d['p99_ms'])} "
                f"| {_f(d['ttft_mean_ms'])} | {_f(d['tokens_mean'])} | {_f(d['tokens_per_s'])} "
                f"| {_f(d['decode_tokens_per_s'])} | {_mib(d['rss_peak_bytes'])} "
                f"| {_mib(d['mlx_peak_bytes'])} |"
            )
    lines += [""]
    lines += render_parity(summary.get("parity", []), summary["settings"].get("parity", {}))

    b = summary["bootstrap"]
    lines += [
        f"## Ratios runner ÷ baseline ({b['confidence']:.0%} bootstrap intervals, "
        f"{b['resamples']:,} resamples, seed {b['seed']})",
        "",
        "Below 1 means the runner is lower (for tok/s: slower).",
        "",
        "| Scope | μ_L | σ_L | CV_L | P50 | P99 | tok/s | peak RSS | MLX peak |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for scope, r in summary["ratios"].items():
        lines.append(
            f"| {scope} | {_r(r['mean_ms'])} | {_r(r['std_ms'])} | {_r(r['cv'])} "
            f"| {_r(r['p50_ms'])} | {_r(r['p99_ms'])} | {_r(r['tokens_per_s'])} "
            f"| {_r(r['rss_peak_bytes'])} | {_r(r['mlx_peak_bytes'])} |"
        )
    lines += [""]

    lines += [
        "## Greedy agreement",
        "",
        "| Prompt | same tokens | common prefix | baseline tokens | runner tokens "
        "| baseline repeatable | runner repeatable |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    yes = {True: "yes", False: "no"}
    for pid, g in summary["greedy_agreement"].items():
        if g is None:
            lines.append(f"| {pid} | – | – | – | – | – | – |")
            continue
        lines.append(
            f"| {pid} | {yes[g['identical']]} | {g['common_prefix']} | {g['baseline_tokens']} "
            f"| {g['runner_tokens']} | {yes[g['baseline_repeatable']]} "
            f"| {yes[g['runner_repeatable']]} |"
        )
    lines += [""]

    lines += [
        "## Definitions",
        "",
        "- Latency L: wall time of one call (`time.perf_counter`), prompt ids in, last token out and "
        "the device idle; TTFT: until the first generated token.",
        "- μ_L mean; σ_L sample standard deviation (n − 1; – for fewer than two calls); "
        "CV_L = σ_L / μ_L; P50/P99 linear interpolation between closest ranks (Hyndman & Fan "
        "type 7, NumPy's default).",
        "- The all-prompts rows pool prompts of very different lengths, so their σ_L and CV_L "
        "mostly measure the prompt mix (the same for both systems); the per-prompt CV_L is the "
        "call-to-call stability of one workload.",
        "- tok/s: generated tokens ÷ summed wall latency (prefill included); decode tok/s: 1 ÷ the "
        "median interval between consecutive tokens after the first (the calls pooled), one decode "
        "step in the steady state; tok/s after TTFT: tokens after the first ÷ (latency − TTFT), "
        "summed. They differ by where a pipeline puts its first decode step: mlx-lm's "
        "`generate_step` launches it before it yields the first token (its TTFT holds it), the "
        "runner after (its time after TTFT holds it), and at a stop token both wait for one more "
        "step already in flight.",
        "- peak RSS: largest resident-set sample of the whole process (psutil, every 10 ms, plus one "
        "at the start and end of the call). MLX peak: `mx.get_peak_memory()` after "
        "`mx.reset_peak_memory()` before the call. Both systems' weights are loaded in this one "
        "process, so both figures include both models; their differences are the calls' own "
        "allocations. RSS rarely shrinks (allocator caches), so a group's peak RSS also carries "
        "what earlier calls left resident.",
        "- Intervals: percentile bootstrap of runner ÷ baseline; each system's calls are resampled "
        "with replacement independently within each prompt (stratified); seeded, so the same "
        "calls give the same intervals.",
        "",
    ]
    lines += ["## Figures", ""]
    if figures:
        lines += [f"![latency and RSS]({figures[0]})", "", ", ".join(f"`{f}`" for f in figures)]
    else:
        lines.append(figure_note or "no figures")
    lines.append("")
    return "\n".join(lines)


def write_summary(
    out_dir: Path, summary: dict, figures: Sequence[str] = (), figure_note: str = ""
) -> None:
    write_output(out_dir / SUMMARY_JSON, (json.dumps(summary, indent=1, allow_nan=False) + "\n").encode())
    write_output(out_dir / SUMMARY_MD, render_markdown(summary, figures, figure_note).encode())
