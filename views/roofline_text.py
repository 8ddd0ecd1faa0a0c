"""``dctms roofline``'s text: the profile, a table per phase by op class, the predictions and, when a
bench summary is given, predicted against measured."""

from __future__ import annotations

from dctms.figures.roofline import ClassRow, Roofline, seconds_text, tokens_per_s_text
from dctms.figures.units import MIB
from dctms.schema.types import Plan


def _row(row: ClassRow, ridge: float) -> str:
    intensity = "-" if row.intensity is None else f"{row.intensity:,.2f}"
    return (
        f"  {row.op_class:<17}{row.ops:>6}{row.flops / 1e9:>11,.3f}"
        f"{row.weights / MIB:>11,.1f}{row.kv / MIB:>9,.1f}{row.activations / MIB:>10,.1f}"
        f"{row.scratch / MIB:>9,.1f}{intensity:>10}  {row.bound(ridge):<8}"
        f"{seconds_text(row.seconds):>11}"
    )


HEADER = (
    f"  {'op class':<17}{'ops':>6}{'GFLOP':>11}{'weights':>11}{'kv':>9}{'activ.':>10}"
    f"{'scratch':>9}{'FLOP/B':>10}  {'bound':<8}{'time':>11}"
)


def roofline_text(plan: Plan, roof: Roofline) -> str:
    p, b = roof.profile, plan.bounds
    plan_phases = {ph.name: ph for ph in plan.phases}
    lines = [
        f"{plan.model.architecture} ({plan.model.num_layers} layers), N = {b.input_tokens:,}, "
        f"M = {b.output_tokens:,}, batch {b.batch}, prefill chunk {b.prefill_chunk}, {b.dtype}",
        f"profile {p.name}: ridge {roof.ridge:,.2f} FLOP/byte",
        f"  peak   {p.peak_flops / 1e9:,.1f} GFLOP/s  ({p.peak_flops_source})",
        f"  memory {p.bandwidth_bytes_per_s / 1e9:,.1f} GB/s  ({p.bandwidth_source})",
    ]
    for ph in roof.phases:
        lines += [
            "",
            f"phase {ph.name}: {ph.tokens:,} token{'s' if ph.tokens != 1 else ''} per call, "
            f"{seconds_text(ph.seconds)} per call at the roofline (bytes in MiB)",
            HEADER,
        ]
        lines += [_row(r, roof.ridge) for r in ph.rows]
        lines.append(_row(ph.total, roof.ridge))
        lengths = getattr(plan_phases.get(ph.name), "lengths", None)
        if lengths is not None:  # the runner runs it at real lengths: these are the bound's
            at = ", ".join(f"{n} {b:,}" for n, b in zip(lengths.names, lengths.bound, strict=True))
            lines.append(
                f"  (at the bound: {at}; the runner calls it at real lengths, so a shorter call "
                "moves less than this)"
            )
    decode = next((ph for ph in roof.phases if ph.name == "decode"), None)
    if any(getattr(ph, "lengths", None) is not None for ph in plan.phases):
        title = "predicted at the roofline, every call at its phase's bound (no dispatch overhead)"
    else:
        title = "predicted at the roofline (a lower bound on time: no dispatch overhead)"
    title += f", on profile {roof.profile.name}"
    lines += ["", title]
    if decode is not None:
        lines.append(
            f"  decode: {seconds_text(roof.decode_s)} per token = "
            f"{tokens_per_s_text(roof.decode_tokens_per_s)} tok/s per sequence "
            f"({decode.total.bound(roof.ridge)}-bound, {decode.total.intensity or 0:,.2f} FLOP/byte, "
            f"{decode.total.bytes / MIB:,.1f} MiB moved per token)"
        )
    calls = " + ".join(f"{n} x {name}" for name, n in roof.prefill_calls) or "no prefill calls"
    lines.append(
        f"  TTFT for a {roof.prompt_tokens:,}-token prompt: {seconds_text(roof.ttft_s)} ({calls})"
    )
    return "\n".join(lines) + "\n"


def comparison_text(cmp: dict) -> str:
    """Predicted against ``dctms bench``'s measurement (``views.roofline_bench.compare_with_bench``)."""
    lines = [
        "",
        f"against dctms bench (plan {cmp.get('bench_plan') or '?'}): ratio = predicted time / "
        "measured time, the fraction of the roofline reached",
    ]
    lines.append(f"  {'prompt':<8}{'tokens':>7}{'TTFT measured':>16}{'predicted':>12}{'ratio':>9}")
    for r in cmp["ttft"]:
        measured = r["ttft_measured_ms"]
        lines.append(
            f"  {r['prompt']:<8}{r['tokens']:>7,}"
            f"{'-' if measured is None else seconds_text(measured / 1000):>16}"
            f"{seconds_text(r['ttft_predicted_ms'] / 1000):>12}"
            f"{'-' if r['ratio'] is None else format(r['ratio'], '.3g'):>9}"
        )
    d = cmp["decode"]
    ratio = "-" if d["ratio"] is None else f"{d['ratio']:.3g}"
    lines.append(
        f"  decode tok/s: measured {tokens_per_s_text(d['measured_tokens_per_s'])}, predicted "
        f"{tokens_per_s_text(d['predicted_tokens_per_s'])}, ratio {ratio}"
    )
    return "\n".join(lines) + "\n"
