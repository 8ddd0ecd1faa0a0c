"""The prompt-prefix pool over a recorded run (issue #31): the index records every request's hits,
saves and evictions; ``dctms run --conversation --report`` keeps them per turn; ``dctms show --run``
and the inspector's Pool screen draw the block map and the per-turn table, and refuse a report that
is not a run of the plan's pool in one line.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from hardening import assert_one_line_refusal, cli
from prefix_runs import CHUNK, compile_pool_plans, fixed_prompts, record_fixed_run

from dctms.figures.prefix_run import block_char, block_map
from dctms.runner.prefix_cache import PrefixIndex

# ------------------------------------------------------------------------ the index's events


def test_events_record_hits_saves_and_evictions_of_a_two_block_pool() -> None:
    index = PrefixIndex(blocks=2, block_tokens=2)
    index.start_recording()
    a, b = (1, 1, 2, 2, 9), (3, 3, 9)
    for prompt in (a, a, b):
        index.lookup(prompt)
        index.to_save(prompt)
    first, again, other = index.events
    assert (first.hits, first.saved, first.evicted, first.table) == ([], [0, 1], [], [2, 4])
    assert (again.hits, again.saved, again.evicted, again.table) == ([0, 1], [], [], [2, 4])
    # b takes the least recently used block: a's first chunk (block 0, a prefix of 2 tokens)
    assert (other.hits, other.saved, other.evicted, other.table) == ([], [0], [(0, 2)], [2, 4])
    assert index.owners() == {0: 2, 1: 4} and index.table() == [2, 4]
    assert other.as_json(2) == {
        "prompt_tokens": 3, "cached_tokens": 0, "hits": [], "saved": [0],
        "evicted": [{"block": 0, "tokens": 2}], "table": [2, 4],
    }  # fmt: skip
    assert again.as_json(2)["cached_tokens"] == 4
    assert index.stats.evictions == 1 and index.stats.hit_blocks == 2


def test_interleaved_requests_close_their_own_events() -> None:
    """A batch looks requests up at admission and saves each after its prefill, in any order."""
    index = PrefixIndex(blocks=4, block_tokens=2)
    index.start_recording()
    a, b = (1, 1, 9), (2, 2, 2, 2, 9)
    index.lookup(a), index.lookup(b)
    index.to_save(b)
    index.to_save(a)
    ev_a, ev_b = index.events
    assert (ev_a.prompt_tokens, ev_a.saved, ev_a.table) == (3, [2], [2, 4, 2, None])
    assert (ev_b.prompt_tokens, ev_b.saved, ev_b.table) == (5, [0, 1], [2, 4, None, None])


def test_an_index_records_nothing_unless_asked() -> None:
    index = PrefixIndex(blocks=2, block_tokens=2)
    index.lookup((1, 1, 9))
    index.to_save((1, 1, 9))
    assert index.events is None and index._open == []


def test_block_characters_name_the_chunk_a_block_holds() -> None:
    assert block_map([None, 16, 32, 16 * 10, 16 * 35, 16 * 36], 16) == ".12az+"
    assert block_char(None, 16) == "."


# ------------------------------------------------------------------------ runs and reports


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    return compile_pool_plans(tmp_path_factory.mktemp("pool-views"))


@pytest.fixture(scope="module")
def conversation(tiny, tmp_path_factory) -> dict[str, Path]:
    """``dctms run --conversation --report`` through the 2-block and the 8-block pools."""
    root = tmp_path_factory.mktemp("pool-conversation")
    conv = root / "c.json"
    conv.write_text(json.dumps({"turns": [f"question {k} is here" for k in range(4)]}))
    out = {}
    for name in ("small", "pool", "plain"):
        out[name] = root / f"{name}.json"
        result = cli("run", str(tiny[name]), "--model", str(tiny["model"]), "--conversation",
                     str(conv), "--max-tokens", "3", "--ignore-eos", "--report", str(out[name]))  # fmt: skip
        assert result.code == 0, result.err
    return out


def test_the_conversation_report_keeps_the_pool_per_turn(conversation) -> None:
    data = json.loads(conversation["small"].read_text())
    events, pool, turns = data["pool_events"], data["prefix_pool"], data["turns"]
    assert [e["turn"] for e in events] == [t["turn"] for t in turns] == [1, 2, 3, 4]
    assert [e["cached_tokens"] for e in events] == [t["cached_tokens"] for t in turns]
    assert [e["prompt_tokens"] for e in events] == [t["prompt_tokens"] for t in turns]
    assert sum(len(e["hits"]) for e in events) == pool["hit_blocks"] > 0
    assert sum(len(e["saved"]) for e in events) == pool["saved_blocks"]
    # one growing conversation in 2 blocks: it keeps its first two chunks (a chunk is found only
    # behind the ones before it, so the pool never evicts a prompt's own chunks for its later ones);
    # turn 1's whole prompt (a part chunk) took the free block, and gave it to turn 2's chunk
    evicted = [x for e in events for x in e["evicted"]]
    assert (
        len(evicted) == pool["evictions"] == 1
        and evicted[0]["tokens"] == events[0]["prompt_tokens"]
    )
    assert events[0]["prompt_tokens"] % CHUNK and sorted(events[0]["table"]) == [
        CHUNK,
        events[0]["prompt_tokens"],
    ]
    assert events[-1]["table"] == pool["table"] and sorted(pool["table"]) == [CHUNK, 2 * CHUNK]
    for e in events:  # a turn's saves are chunks of its prompt, in the pool afterwards
        assert len(e["saved"]) <= -(-e["prompt_tokens"] // CHUNK)
        assert all(e["table"][block] is not None for block in e["saved"])
    # the keys the report had before stay
    assert {"turns", "provable_bytes", "observed", "within_envelope"} <= set(data)
    assert {"blocks", "block_tokens", "used", "lookups", "hit_tokens"} <= set(pool)
    plain = json.loads(conversation["plain"].read_text())
    assert plain["prefix_pool"] is None and plain["pool_events"] == []


def test_show_run_draws_the_map_and_the_turns(tiny, conversation) -> None:
    data = json.loads(conversation["small"].read_text())
    result = cli("show", str(tiny["small"]), "--run", str(conversation["small"]))
    assert result.code == 0, result.err
    section = result.out[result.out.index("prefix pool over a recorded run") :].splitlines()
    assert section[0] == "prefix pool over a recorded run (small.json): 2 blocks of 16 positions"
    assert section[2].split() == ["0", block_map(data["prefix_pool"]["table"], CHUNK)]
    header = next(i for i, line in enumerate(section) if line.split()[:2] == ["turn", "prompt"])
    rows = [line.split() for line in section[header + 1 :]]
    assert rows == [
        [str(e["turn"]), str(e["prompt_tokens"]), str(e["cached_tokens"]), str(len(e["hits"])),
         str(len(e["saved"])), str(len(e["evicted"])), block_map(e["table"], CHUNK)]
        for e in data["pool_events"]
    ]  # fmt: skip
    pool = data["prefix_pool"]
    assert (
        f"4 turns; blocks hit {pool['hit_blocks']} ({pool['hit_tokens']:,} prompt tokens not "
        f"prefilled), saved {pool['saved_blocks']}, evicted {pool['evictions']}; 2 of 2 in use"
        in result.out
    )
    as_json = json.loads(cli("show", str(tiny["small"]), "--json", "--run",
                             str(conversation["small"])).out)  # fmt: skip
    assert as_json["pool_run"]["map"] == block_map(pool["table"], CHUNK)
    assert [t["hit"] for t in as_json["pool_run"]["turns"]] == [
        len(e["hits"]) for e in data["pool_events"]
    ]


def _edited(path: Path, out: Path, edit) -> Path:
    data = json.loads(path.read_text())
    edit(data)
    out.write_text(json.dumps(data))
    return out


@pytest.mark.parametrize(
    ("plan", "report", "needle"),
    [
        ("plain", "small", "plain.plan has no prefix pool: compile it with --prefix-blocks K"),
        (
            "small",
            "pool",
            "recorded with a pool of 8 blocks of 16 positions, small.plan has 2 "
            "blocks of 16 positions: not a run of this plan",
        ),  # fmt: skip
        ("pool", "plain", "its run had no prefix pool"),
        ("small", "conversation file", "not a report of `dctms run PLAN --conversation FILE"),
        ("small", "missing", "no such file"),
        ("small", "not json", "cannot read it as JSON"),
        ("small", "block 7", "turn 1 names a block outside the pool (0..1)"),
        ("small", "short table", "a block table without one entry per block (2)"),
        ("small", "string block", "Expected `int`, got `str`"),
    ],
)
def test_show_run_refuses_a_report_that_is_not_this_pools_run(
    tiny, conversation, tmp_path, plan, report, needle
) -> None:
    small = conversation["small"]
    paths = {
        "conversation file": small.parent / "c.json",
        "missing": tmp_path / "none.json",
        "not json": tmp_path / "x.json",
        "block 7": _edited(
            small, tmp_path / "b7.json", lambda d: d["pool_events"][0]["saved"].append(7)
        ),  # fmt: skip
        "short table": _edited(
            small, tmp_path / "t.json", lambda d: d["prefix_pool"]["table"].pop()
        ),  # fmt: skip
        "string block": _edited(
            small, tmp_path / "s.json", lambda d: d["pool_events"][0]["saved"].append("0")
        ),  # fmt: skip
    }
    if report == "not json":
        paths[report].write_text("{")
    path = paths.get(report, conversation.get(report))
    result = cli("show", str(tiny[plan]), "--run", str(path))
    assert_one_line_refusal(result, "show", needle)


def test_the_inspector_refuses_a_bad_run_in_one_line(tiny, conversation, capsys) -> None:
    from dctms.tui.app import main

    assert main([str(tiny["small"]), "--run", str(conversation["pool"])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dctms-tui: --run ")
    assert "not a run of this plan" in err
    with pytest.raises(SystemExit) as exit_:
        main([str(tiny["small"]), str(tiny["pool"]), "--run", str(conversation["small"])])
    assert exit_.value.code == 2
    assert "--run draws one plan's prefix pool" in capsys.readouterr().err


# ------------------------------------------------------------------------ the Pool screen


def _pool_screen_text(plan_path: Path, report: Path | None) -> str:
    from dctms.figures.prefix_run import read_pool_run
    from dctms.schema.io import read_plan
    from dctms.tui.app import InspectorApp
    from dctms.tui.state import Inspection

    plan = read_plan(plan_path)
    run = None if report is None else read_pool_run(report, plan)
    app = InspectorApp(Inspection(plan, plan_path.name, pool_run=run), screen="pool")
    shown = []

    async def main() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            shown.append("\n".join(s.text for s in app.screen._compositor.render_strips()))

    asyncio.run(main())
    return shown[0]


def test_the_pool_screen_draws_the_run(tiny, tmp_path) -> None:
    report = tmp_path / "fixed.json"
    data = record_fixed_run(tiny["small"], tiny["model"])
    report.write_text(json.dumps(data))
    events = data["pool_events"]
    assert len(events) == len(fixed_prompts())
    # the fixed prompts: a hit (whose second chunk takes the block of A[:18] kept whole), then B
    # evicts A's first chunk, then A finds nothing and evicts
    assert [len(e["hits"]) for e in events] == [0, 1, 0, 0]
    assert [[x["tokens"] for x in e["evicted"]] for e in events] == [[], [18], [16], [16]]
    shown = _pool_screen_text(tiny["small"], report)
    assert "2 blocks of 16 positions" in shown and "at the end of fixed.json" in shown
    rows = [line.split() for line in shown.splitlines()]
    for e in events:
        assert [str(e["turn"]), str(e["prompt_tokens"]), str(e["cached_tokens"]),
                str(len(e["hits"])), str(len(e["saved"])), str(len(e["evicted"])),
                block_map(e["table"], CHUNK)] in rows  # fmt: skip


def test_the_pool_screen_without_a_run_or_a_pool(tiny) -> None:
    shown = _pool_screen_text(tiny["pool"], None)
    assert "0 ........" in shown and "no recorded run: dctms run PLAN" in shown
    shown = _pool_screen_text(tiny["plain"], None)
    assert "This plan has no prefix pool: compile it with --prefix-blocks K" in shown
