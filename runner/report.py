"""The run report: what was generated, how fast, and the memory proof (observed vs envelope)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

import dctms
from dctms.runner.blas import loaded_blas
from dctms.runner.session import Generation
from dctms.schema.output import write_output
from dctms.schema.types import Plan


def build_report(
    plan: Plan,
    gen: Generation,
    mlx_peak: int,
    rss_peak: int,
    rss_series: list[tuple[float, int]],
    text: str | None,
    prompt: list[int] | None = None,
) -> dict:
    provable = plan.envelope.provable
    lat = gen.token_latencies_s
    return {
        "dctms_version": dctms.__version__,
        "prompt_tokens": prompt,
        "tokens": gen.tokens,
        "text": text,
        "ttft_s": gen.ttft_s,
        "token_latencies_s": lat,
        "tokens_per_s": gen.tokens_per_s,
        "observed": {"mlx_peak_bytes": mlx_peak, "rss_peak_bytes": rss_peak},
        "envelope": msgspec.to_builtins(plan.envelope),
        "provable_bytes": provable,
        "within_envelope": mlx_peak <= provable,
        "envelope_over_observed": provable / mlx_peak if mlx_peak else None,
        "rss_within_m_max": rss_peak <= plan.envelope.total,
        "rss_series": [[round(t, 4), rss] for t, rss in rss_series],
        "blas": loaded_blas().to_dict(),
    }


def report_bytes(report: dict) -> bytes:
    return (json.dumps(report, indent=1) + "\n").encode("utf-8")


def write_report(report: dict, path: str | Path) -> None:
    """Atomic (``schema.output``): never a half-written report."""
    write_output(path, report_bytes(report))
