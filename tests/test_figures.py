"""dctms.figures: the rows both the CLI's renderers and the inspector draw, and the one sweep."""

from __future__ import annotations

import random

import msgspec
import pytest
from conftest import make_tiny_plan

from dctms.figures.comparison import plan_diff
from dctms.figures.overview import bounds_rows, envelope_rows
from dctms.figures.units import exact_bytes, human, parse_size
from dctms.schema.errors import DctmsError
from dctms.schema.sizes import live_bytes
from dctms.views.diff import diff_data
from dctms.views.show import show_text


def test_one_size_formatter() -> None:
    assert human(512) == "512 B" and human(1000) == "1000 B"
    assert human(1536) == "1.50 KiB" and human(1536, 1) == "1.5 KiB"
    assert human(3 * 2**30 + 2**29) == "3.50 GiB"
    assert human(-(2**20)) == "-1.00 MiB"
    assert exact_bytes(409223296) == "409,223,296 B (390.27 MiB)"
    assert parse_size("16GiB") == 16 * 2**30 and parse_size("8GB") == 8 * 10**9
    with pytest.raises(DctmsError, match="not a size"):
        parse_size("lots")


def test_live_bytes_sweep_matches_brute_force() -> None:
    rng = random.Random(7)
    slots = 40
    spans = []
    for _ in range(300):
        a = rng.randrange(-2, slots + 2)
        b = a + rng.randrange(-3, 12)
        spans.append((a, b, rng.randrange(0, 1000)))
    want = [
        sum(size for a, b, size in spans if 0 <= a <= b < slots and a <= s <= b)
        for s in range(slots)
    ]
    assert live_bytes(spans, slots) == want
    assert live_bytes([], 0) == []


def test_show_draws_the_figures_rows() -> None:
    plan = make_tiny_plan()
    text = show_text(plan)
    for name, value in bounds_rows(plan):
        assert f"  {name:<20} {value}" in text
    for row in envelope_rows(plan):
        assert f"  {row.name:<18} {row.bytes:>18,}" in text


def test_diff_json_and_inspector_rows_are_the_same_numbers() -> None:
    old = make_tiny_plan()
    e = old.envelope
    envelope = msgspec.structs.replace(
        e, runtime=e.runtime + 512, total=e.total + 512, free=e.free - 512
    )
    new = msgspec.structs.replace(old, envelope=envelope)
    rows = plan_diff(old, new)
    data = diff_data(old, new)
    by_key = {r["name"]: r for r in data["envelope"]}
    assert [r.key for r in rows.envelope] == list(by_key)
    for r in rows.envelope:
        assert (by_key[r.key]["old"], by_key[r.key]["new"], by_key[r.key]["delta"]) == (
            r.old,
            r.new,
            r.delta,
        )
    assert [c.key for c in rows.bounds] == [r["name"] for r in data["bounds"]]
    assert [c.key for c in rows.fingerprint] == [r["name"] for r in data["model"]]
    arena = [r for r in rows.phases if r.figure == "arena"]
    assert [r["name"] for r in data["stats"]][-len(arena) :] == [r.key for r in arena]
    assert rows.changed == 3  # runtime, total, free
