"""The parity table (issue 12): per prompt, runner ÷ mlx-lm and each system's roofline fraction.

Per prompt: mean latency, TTFT and decode tok/s ratios (runner ÷ baseline), the CV_L ratio, whether
every runner call's own MLX peak stayed within the plan's provable envelope, the provable envelope
÷ the largest of those peaks, and for both systems the *roofline fraction* of decode:

    decode bytes per token = weight bytes + fixed KV bytes + KV bytes per position × positions attended
    fraction = bytes per token × decode tok/s ÷ this machine's measured read bandwidth

(the seeds' memory-wall argument: decode streams every weight once per token). mlx-lm attends over
the positions written so far (prompt + i at step i); the runner over its decode window at that step
(the smallest verified window >= prompt + i + 1, ``settings.parity.decode_windows``). Activations
are left out: they are a small fraction of the bytes in decode. Fixed KV bytes: sliding-window rings
and recurrent state, read whole at every step whatever the position (``figures.cache_layout``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from dctms.benchmark.systems import BASELINE, RUNNER


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _positions(prompt: int, steps: int, windows: Sequence[int] | None) -> float:
    """Mean positions attended over ``steps`` decode steps starting after ``prompt`` tokens."""
    if steps <= 0:
        return 0.0
    total = 0
    for i in range(steps):
        need = prompt + i + 1
        if windows:
            k = bisect_left(windows, need)
            total += windows[min(k, len(windows) - 1)]
        else:
            total += need
    return total / steps


def parity_rows(summary: dict, calls: Sequence[dict]) -> list[dict]:
    """One row per prompt; empty when the settings carry no parity figures."""
    info = (summary.get("settings") or {}).get("parity")
    if not isinstance(info, dict):
        return []
    bandwidth = info.get("read_bandwidth_bytes_per_s") or 0
    weights, per_pos = info.get("weights_bytes", 0), info.get("kv_bytes_per_position", 0)
    weights += info.get("kv_fixed_bytes", 0)  # read at every step, like the weights
    provable = info.get("provable_bytes")
    windows = sorted(info.get("decode_windows") or [])
    rows = []
    for entry in summary["prompts"]:
        pid = entry["id"]
        by = summary["per_prompt"][pid]
        base, run = by[BASELINE], by[RUNNER]
        own = [
            c["mlx_peak_bytes"] - c.get("mlx_foreign_bytes", 0)
            for c in calls
            if c["prompt"] == pid and c["system"] == RUNNER
        ]
        row = {
            "prompt": pid,
            "tokens": entry["tokens"],
            "latency_ratio": _ratio(run["mean_ms"], base["mean_ms"]),
            "ttft_ratio": _ratio(run["ttft_mean_ms"], base["ttft_mean_ms"]),
            "decode_ratio": _ratio(run["decode_tokens_per_s"], base["decode_tokens_per_s"]),
            "after_ttft_ratio": _ratio(
                run.get("after_ttft_tokens_per_s"), base.get("after_ttft_tokens_per_s")
            ),
            "cv_ratio": _ratio(run["cv"], base["cv"]),
            "within_envelope": bool(own) and provable is not None and max(own) <= provable,
            "envelope_over_observed": _ratio(provable, max(own)) if own else None,
        }
        for sys, d, win in ((BASELINE, base, None), (RUNNER, run, windows)):
            steps = max(int(round((d["tokens_mean"] or 1) - 1)), 0)
            per_token = weights + per_pos * _positions(entry["tokens"], steps, win)
            tok_s = d["decode_tokens_per_s"]
            row[f"{sys}_bytes_per_token"] = per_token
            row[f"{sys}_roofline"] = per_token * tok_s / bandwidth if tok_s and bandwidth else None
        rows.append(row)
    return rows


def render_parity(rows: Sequence[dict], info: dict) -> list[str]:
    if not rows:
        return []

    def f(x: float | None, digits: int = 3) -> str:
        return "–" if x is None else f"{x:.{digits}f}"

    bw = info.get("read_bandwidth_bytes_per_s") or 0
    lines = [
        "## Parity (runner ÷ mlx-lm per prompt; roofline fraction of decode)",
        "",
        f"Read bandwidth measured in this process before the calls: {bw / 1e9:.2f} GB/s "
        f"({info.get('read_bandwidth_source', 'mx.sum over a large float32 array')}). Roofline "
        "fraction = (weight bytes + fixed KV bytes + KV bytes per position × positions attended) × decode tok/s "
        "÷ read bandwidth. Decode tok/s: 1 ÷ the median interval between tokens after the first; "
        "tok/s after TTFT: tokens after the first ÷ (latency − TTFT) (see Definitions).",
        "",
        "| Prompt | tokens | latency | TTFT | decode tok/s | tok/s after TTFT | CV_L "
        "| within envelope | M_max provable ÷ observed | roofline mlx-lm | roofline runner |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompt']} | {r['tokens']} | {f(r['latency_ratio'])} | {f(r['ttft_ratio'])} "
            f"| {f(r['decode_ratio'])} | {f(r.get('after_ttft_ratio'))} | {f(r['cv_ratio'])} "
            f"| {'yes' if r['within_envelope'] else 'NO'} | {f(r['envelope_over_observed'])} "
            f"| {f(r['baseline_roofline'])} | {f(r['runner_roofline'])} |"
        )
    return [*lines, ""]
