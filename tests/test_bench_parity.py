"""The parity table's figures (``dctms.benchmark.parity``) on hand-made summaries."""

from __future__ import annotations

import pytest

from dctms.benchmark.parity import _positions, parity_rows


def test_positions_attended_per_decode_step() -> None:
    # mlx-lm reads the positions written so far: 11, 12, 13 after a 10-token prompt
    assert _positions(10, 3, None) == pytest.approx(12.0)
    # the runner reads its window: the smallest verified one holding them
    assert _positions(10, 3, [8, 12, 16]) == pytest.approx((12 + 12 + 16) / 3)
    assert _positions(10, 0, None) == 0.0


def _figures(mean_ms, ttft_ms, decode, cv, tokens=5.0) -> dict:
    return {"mean_ms": mean_ms, "ttft_mean_ms": ttft_ms, "decode_tokens_per_s": decode,
            "cv": cv, "tokens_mean": tokens}  # fmt: skip


def test_parity_rows() -> None:
    summary = {
        "settings": {
            "parity": {
                "read_bandwidth_bytes_per_s": 1e9,
                "weights_bytes": 1000,
                "kv_bytes_per_position": 10,
                "provable_bytes": 5000,
                "decode_windows": [16, 32],
            }
        },
        "prompts": [{"id": "P1", "tokens": 10}],
        "per_prompt": {
            "P1": {"baseline": _figures(100, 20, 50, 0.2), "runner": _figures(90, 22, 60, 0.1)}
        },
    }
    calls = [
        {"prompt": "P1", "system": "runner", "mlx_peak_bytes": 7000, "mlx_foreign_bytes": 3000},
        {"prompt": "P1", "system": "runner", "mlx_peak_bytes": 6000, "mlx_foreign_bytes": 2000},
    ]
    (row,) = parity_rows(summary, calls)
    assert row["latency_ratio"] == pytest.approx(0.9)
    assert row["ttft_ratio"] == pytest.approx(1.1)
    assert row["decode_ratio"] == pytest.approx(1.2)
    assert row["cv_ratio"] == pytest.approx(0.5)
    assert row["within_envelope"] and row["envelope_over_observed"] == pytest.approx(5000 / 4000)
    # 4 decode steps after 10 tokens: mlx-lm 11..14 positions (mean 12.5), runner window 16
    assert row["baseline_bytes_per_token"] == pytest.approx(1000 + 10 * 12.5)
    assert row["runner_bytes_per_token"] == pytest.approx(1000 + 10 * 16)
    assert row["runner_roofline"] == pytest.approx((1000 + 160) * 60 / 1e9)
    calls[0]["mlx_peak_bytes"] = 9000  # a call above the envelope
    assert not parity_rows(summary, calls)[0]["within_envelope"]
    # a ring or recurrent state is read whole at every step, by both systems
    summary["settings"]["parity"]["kv_fixed_bytes"] = 300
    (row,) = parity_rows(summary, calls)
    assert row["baseline_bytes_per_token"] == pytest.approx(1300 + 10 * 12.5)
    assert row["runner_bytes_per_token"] == pytest.approx(1300 + 10 * 16)


def test_no_parity_settings_no_rows() -> None:
    assert parity_rows({"settings": {}, "prompts": [], "per_prompt": {}}, []) == []
