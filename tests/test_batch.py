"""Batched plans with ragged positions (issue #29): B slots, sequences joining and leaving.

The plans are a tiny random model's (``toolkit.tiny_model``): a batched plan's greedy ids of each
sequence equal the same prompt run alone through a batch-1 plan, the observed peak stays within the
provable envelope after every call, a cancelled sequence frees its slot, and the verifier refuses
edits that would make the batched runner write outside its state.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import TINY_QWEN2
from hardening import assert_invalid, assert_one_line_refusal, cli, edit_plan, phase_named

BOUNDS = ["-N", "24", "-M", "10", "--prefill-chunk", "8", "--pack-seconds", "0", "-q"]
SLOTS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    from dctms.toolkit.tiny_model import write_tiny_model

    root = tmp_path_factory.mktemp("batch")
    model = write_tiny_model(root / "model", TINY_QWEN2)
    out = {"model": model}
    for name, batch in (("one", 1), ("batched", SLOTS)):
        out[name] = root / f"{name}.plan"
        result = cli("compile", str(model), *BOUNDS, "--batch", str(batch), "-o", str(out[name]))
        assert result.code == 0, result.err
    return out


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(1, 25))] for _ in range(count)]


def _requests(plan, prompts: list[list[int]], budgets: list[int]) -> list:
    """Each prompt with its ``max_tokens``, validated for ``plan``."""
    from dctms.runner.request import validate_request

    return [validate_request(plan, p, m) for p, m in zip(prompts, budgets, strict=True)]


def _sessions(tiny):
    from dctms.runner.batch import BatchSession
    from dctms.runner.load import load_checked_plan
    from dctms.runner.session import Session
    from dctms.schema.model_folder import open_model_folder

    model = open_model_folder(tiny["model"])
    one, batched = load_checked_plan(tiny["one"]), load_checked_plan(tiny["batched"])
    return Session(one, model), BatchSession(batched, model)


def test_the_batched_plan_has_slots_rows_and_positions(tiny) -> None:
    from dctms.schema.io import read_plan

    plan = read_plan(tiny["batched"])
    phases = {p.name: p for p in plan.phases}
    inputs = {n: [b.name for b in p.inputs if b.kind == "input"] for n, p in phases.items()}
    assert inputs == {
        "prefill": ["tokens", "position", "last_index", "slot"],
        "decode": ["tokens", "positions"],
        "decode_one": ["tokens", "positions"],  # slot 0 alone: one row, MLX's scalar paths
        "move_slot": ["slot", "source"],  # a sequence in a high slot moves to a free low one
    }
    kv_names = {s.name for s in plan.state if s.kind == "kv"}
    assert {b.name for b in phases["move_slot"].outputs} == kv_names
    # every row read completes at a sync point before its array is updated in place
    reasons = [sp.reason for sp in phases["move_slot"].sync_points]
    assert sum("in-place update" in r for r in reasons) == len(kv_names)
    # and each row is read after the previous array is written: at most two rows alive at once
    row = max(s.bytes // s.shape[0] for s in plan.state if s.kind == "kv")
    assert row < phases["move_slot"].arena_bytes <= 2 * row + 2 * plan.target.alignment
    assert list(phases["decode"].lengths.names) == ["rows", "window"]
    assert phases["decode_one"].inputs[0].shape == [1]
    rows = {p[0] for p in phases["decode"].lengths.points}
    assert max(rows) == SLOTS and len(rows) >= 2  # fewer busy slots compute fewer rows
    kv = [s for s in plan.state if s.kind == "kv"]
    assert all(s.shape[0] == SLOTS and s.shape[2] == plan.bounds.kv_capacity for s in kv)
    one = read_plan(tiny["one"])
    assert plan.envelope.kv == SLOTS * one.envelope.kv
    assert [b.name for b in one.phases[1].inputs if b.kind == "input"] == ["tokens", "position"]


def test_batched_ids_equal_each_prompt_run_alone(tiny) -> None:
    """More prompts than slots, mixed lengths and budgets: they queue, join at step boundaries,
    and each generates exactly what it generates alone."""
    alone, batch = _sessions(tiny)
    prompts = _prompts(11)
    budgets = [1 + i % 10 for i in range(len(prompts))]
    expected = [alone.generate(r).tokens for r in _requests(alone.plan, prompts, budgets)]
    seqs = [batch.submit(r) for r in _requests(batch.plan, prompts, budgets)]
    batch.run_all()
    assert [s.generation.tokens for s in seqs] == expected
    assert all(s.finish == "length" for s in seqs)
    assert batch.busy == 0 and batch.idle
    stats = batch.stats
    assert stats.rows_busy == sum(m - 1 for m in budgets)  # the first token comes from prefill
    assert stats.rows_busy <= stats.rows_computed < stats.decode_steps * SLOTS + 1
    assert stats.single_steps > 0  # the tail: slot 0 alone ran the one-row phase
    assert 0 < stats.peak_observed <= batch.plan.envelope.provable


def test_a_stop_token_and_a_cancelled_sequence_free_their_slots(tiny) -> None:
    from dctms.runner.request import validate_request

    alone, batch = _sessions(tiny)
    prompt = _prompts(1, seed=3)[0]
    full = alone.generate(validate_request(alone.plan, prompt, 10)).tokens
    stopped = batch.submit(validate_request(batch.plan, prompt, 10, stop={full[2]}))
    seen: list[int] = []
    dropped = batch.submit(
        validate_request(batch.plan, prompt, 10), lambda t: seen.append(t) or len(seen) < 3
    )
    batch.run_all()
    assert stopped.generation.tokens == full[: full.index(full[2]) + 1]
    assert stopped.finish == "stop"
    assert dropped.finish == "cancelled" and dropped.generation.tokens == full[:3]
    assert batch.busy == 0
    # cancelled from outside between iterations (a client gone): the slot is free at once
    later = batch.submit(validate_request(batch.plan, prompt, 10))
    batch.iterate()
    assert batch.busy == 1
    batch.cancel(later)
    batch.iterate()
    assert batch.busy == 0 and later.finish == "cancelled"
    again = batch.submit(validate_request(batch.plan, prompt, 10))
    batch.run_all()
    assert again.generation.tokens == full


def test_a_sequence_left_in_a_high_slot_moves_down_and_steps_alone(tiny) -> None:
    """Three short requests in slots 0-2 end; the long one in slot 3 moves down as slots below it
    free up (its KV row copied, ``move_slot``) and, once in slot 0, the steps compute its row
    alone, with the ids it has alone."""
    alone, batch = _sessions(tiny)
    prompts = _prompts(SLOTS, seed=5)
    budgets = [2] * (SLOTS - 1) + [10]
    expected = [alone.generate(r).tokens for r in _requests(alone.plan, prompts, budgets)]
    seqs = [batch.submit(r) for r in _requests(batch.plan, prompts, budgets)]
    batch.iterate()
    assert [s.slot for s in seqs] == list(range(SLOTS))
    while not all(s.done for s in seqs[:-1]):
        batch.iterate()
    assert not seqs[-1].done
    batch.iterate()  # the first iteration with slots 0 .. B-2 free
    assert seqs[-1].slot == 0 and batch.stats.moves >= 1
    steps, singles = batch.stats.decode_steps, batch.stats.single_steps
    batch.run_all()
    assert [s.generation.tokens for s in seqs] == expected
    assert batch.stats.single_steps - singles == batch.stats.decode_steps - steps > 0
    assert batch.stats.rows_computed == batch.stats.rows_busy  # no idle row was ever computed
    assert 0 < batch.stats.peak_observed <= batch.plan.envelope.provable


def test_without_the_move_phase_a_sequence_keeps_its_slot(tiny, tmp_path) -> None:
    """A batched plan of an earlier compiler (no ``move_slot``) still runs: nothing moves."""
    from dctms.runner.request import validate_request

    alone, batch = _sessions(tiny)
    batch.move = None
    prompts = _prompts(SLOTS, seed=5)
    budgets = [2] * (SLOTS - 1) + [10]
    seqs = [batch.submit(r) for r in _requests(batch.plan, prompts, budgets)]
    batch.run_all()
    assert seqs[-1].slot == SLOTS - 1 and batch.stats.moves == 0
    want = alone.generate(validate_request(alone.plan, prompts[-1], 10)).tokens
    assert seqs[-1].generation.tokens == want


def test_sessions_refuse_the_other_kind_of_plan(tiny) -> None:
    from dctms.runner.batch import BatchSession
    from dctms.runner.load import load_checked_plan
    from dctms.runner.session import Session
    from dctms.schema.errors import DctmsError
    from dctms.schema.model_folder import open_model_folder

    model = open_model_folder(tiny["model"])
    with pytest.raises(DctmsError, match="batch 4 runs in a BatchSession"):
        Session(load_checked_plan(tiny["batched"]), model)
    with pytest.raises(DctmsError, match="batch-1 plan"):
        BatchSession(load_checked_plan(tiny["one"]), model)


# ------------------------------------------------------------------------------------ the CLI


def test_run_batch_prompts(tiny, tmp_path, capsys) -> None:
    lines = [{"tokens": p} for p in _prompts(6, seed=5)]
    lines[2]["max_tokens"] = 3
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    report = tmp_path / "r.json"
    result = cli("run", str(tiny["batched"]), "--model", str(tiny["model"]), "--batch-prompts",
                 str(path), "--ignore-eos", "--report", str(report))  # fmt: skip
    assert result.code == 0, result.err
    rows = [json.loads(x) for x in result.out.splitlines()]
    assert [r["line"] for r in rows] == list(range(1, 7))
    assert [len(r["tokens"]) for r in rows] == [10, 10, 3, 10, 10, 10]
    assert "6 prompts through 4 slots" in result.err and "within envelope: yes" in result.err
    data = json.loads(report.read_text())
    assert data["within_envelope"] and data["observed"]["mlx_peak_bytes"] <= data["provable_bytes"]
    one = cli("run", str(tiny["one"]), "--model", str(tiny["model"]), "--tokens",
              ",".join(map(str, lines[0]["tokens"])), "--ignore-eos")  # fmt: skip
    assert one.out.strip() == ",".join(map(str, rows[0]["tokens"]))


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json\n", ":1: not JSON"),
        ('{"x": 1}\n', ':1: expected an object with either "prompt" or "tokens"'),
        ('{"tokens": [1]}\n{"tokens": "1,2"}\n', ':2: "tokens" must be a list of ids'),
        ('{"tokens": [1], "max_tokens": 99}\n', ":1: --max-tokens 99 exceeds the plan's M = 10"),
        ('{"tokens": [' + ",".join(["1"] * 25) + "]}\n", ":1: prompt has 25 tokens"),
        ('{"tokens": [300]}\n', ":1: prompt token 0 is 300"),
        ("\n", "no prompts in it"),
    ],
)
def test_bad_batch_prompt_files_are_refused_in_one_line(tiny, tmp_path, content, needle) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    result = cli("run", str(tiny["batched"]), "--model", str(tiny["model"]), "--batch-prompts",
                 str(path))  # fmt: skip
    assert_one_line_refusal(result, "run", needle)


def test_batch_prompts_need_a_batched_plan(tiny, tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"tokens": [1, 2]}\n')
    result = cli("run", str(tiny["one"]), "--model", str(tiny["model"]), "--batch-prompts",
                 str(path))  # fmt: skip
    assert_one_line_refusal(result, "run", "compile it with --batch B")


def test_a_batch_beyond_the_budget_names_the_largest_that_fits(tiny, tmp_path) -> None:
    from dctms.schema.io import read_plan

    plan = read_plan(tiny["batched"])
    per_slot = plan.envelope.kv // SLOTS
    budget = plan.envelope.total - per_slot  # one slot short
    out = tmp_path / "x.plan"
    result = cli("compile", str(tiny["model"]), *BOUNDS, "--batch", str(SLOTS),
                 "--memory", str(budget), "-o", str(out))  # fmt: skip
    line = assert_one_line_refusal(result, "compile", f"--batch {SLOTS} needs M_max")
    assert f"the largest batch that fits is --batch {SLOTS - 1} " in line
    assert not out.exists()


@pytest.mark.parametrize("flag", [["--kv-bits", "8"], ["--max-kv-size", "16"], ["--sampling"]])
def test_batched_plans_refuse_what_they_do_not_plan(tiny, tmp_path, flag) -> None:
    result = cli("compile", str(tiny["model"]), *BOUNDS, "--batch", "2", *flag,
                 "-o", str(tmp_path / "x.plan"))  # fmt: skip
    assert_one_line_refusal(result, "compile", "--batch 2")


# ------------------------------------------------------------------------ the verifier's rules


def test_the_verifier_checks_slot_writes_against_the_batch(tiny, tmp_path) -> None:
    """bounds.batch above the state's slots: the prefill's [slot, position] write (and the rows a
    decode step may address) would land past the arrays."""

    def more_slots(doc: dict) -> None:
        doc["bounds"]["batch"] = SLOTS + 1

    edited = edit_plan(tiny["batched"], tmp_path / "e.plan", more_slots)
    assert_invalid(cli("validate", str(edited)), f"fewer than bounds.batch {SLOTS + 1} slots")


def test_the_verifier_checks_scatter_indices(tiny, tmp_path) -> None:
    """A decode Scatter whose row index reaches past the state (its Arange made to count to
    B + 1 at the bound) is refused by index_safety."""

    def rows_past(doc: dict) -> None:
        decode = phase_named(doc, "decode")
        scatter = next(op for op in decode["ops"] if op["primitive"] == "Scatter")
        producer = {o: k for k, op in enumerate(decode["ops"]) for o in op["outputs"]}
        seen, todo = set(), [scatter["inputs"][1]]
        while todo:  # walk back from the row index to its Arange
            t = todo.pop()
            if producer.get(t) is None or t in seen:
                continue
            seen.add(t)
            k = producer[t]
            op = decode["ops"][k]
            if op["primitive"] == "Arange":  # rows 1 .. B at every point: the last is past
                op["args"][0] += 1.0
                op["args"][1] += 1.0
                for f in decode["lengths"]["affine"]:
                    if f"o{k}/1" in f["at"]:
                        f["at"].remove(f"o{k}/1")
                        decode["lengths"]["affine"].append({**f, "c": f["c"] + 1, "at": [f"o{k}/1"]})
                        break
                decode["lengths"]["affine"] = [f for f in decode["lengths"]["affine"] if f["at"]]
                return
            todo += op["inputs"]
        raise AssertionError("no Arange behind the Scatter's row index")

    edited = edit_plan(tiny["batched"], tmp_path / "e.plan", rows_past)
    assert_invalid(cli("validate", str(edited)), "Scatter on axis 0")


def test_the_verifier_wants_the_batched_inputs(tiny, tmp_path) -> None:
    def rename(doc: dict) -> None:
        decode = phase_named(doc, "decode")
        binding = next(b for b in decode["inputs"] if b["name"] == "positions")
        binding["name"] = "position"

    edited = edit_plan(tiny["batched"], tmp_path / "e.plan", rename)
    assert_invalid(cli("validate", str(edited)), "no input binding named 'positions'")


def test_the_unedited_batched_plan_validates(tiny) -> None:
    assert cli("validate", str(tiny["batched"])).code == 0


def test_decode_one_belongs_to_batched_plans(tiny, tmp_path) -> None:
    def one_slot(doc: dict) -> None:
        doc["bounds"]["batch"] = 1

    edited = edit_plan(tiny["batched"], tmp_path / "e.plan", one_slot)
    assert_invalid(cli("validate", str(edited)), "decode_one is a batched plan's phase")


def test_the_verifier_bounds_the_slot_move(tiny, tmp_path) -> None:
    """move_slot belongs to a batched plan, moves every slot array, writes at the slot input, and
    reads each row at a sync point before the array's in-place update."""

    def one_slot(doc: dict) -> None:
        doc["bounds"]["batch"] = 1

    edited = edit_plan(tiny["batched"], tmp_path / "a.plan", one_slot)
    assert_invalid(cli("validate", str(edited)), "move_slot moves a slot, but bounds.batch is 1")

    def one_array_fewer(doc: dict) -> None:
        move = phase_named(doc, "move_slot")
        move["outputs"] = move["outputs"][1:]

    edited = edit_plan(tiny["batched"], tmp_path / "b.plan", one_array_fewer)
    assert_invalid(cli("validate", str(edited)), "move_slot must move every slot array")

    def written_at_the_source(doc: dict) -> None:
        move = phase_named(doc, "move_slot")
        read = next(op for op in move["ops"] if op["primitive"] == "DynamicSlice")
        write = next(op for op in move["ops"] if op["primitive"] == "DynamicSliceUpdate")
        write["inputs"][2] = read["inputs"][1]  # the row's start: the source input

    edited = edit_plan(tiny["batched"], tmp_path / "c.plan", written_at_the_source)
    assert_invalid(cli("validate", str(edited)), "at an index that is not the position input")

    def no_sync_before_the_updates(doc: dict) -> None:
        move = phase_named(doc, "move_slot")
        last = move["sync_points"][-1]
        move["sync_points"] = [last]

    edited = edit_plan(tiny["batched"], tmp_path / "d.plan", no_sync_before_the_updates)
    assert_invalid(
        cli("validate", str(edited)), "in the same segment (no sync point between them)"
    )


def test_a_session_on_another_thread_runs_after_the_main_thread_ran_mlx(tiny) -> None:
    """MLX 0.32 imports a recorded graph onto the stream of the thread that first evaluated
    anything; a server's worker thread in a process whose main thread already ran MLX re-creates
    the segments in Python instead (runner.execute.replays_here), with the same ids."""
    import threading

    import mlx.core as mx

    from dctms.runner.request import validate_request

    mx.eval(mx.ones(2) + 1)  # the main thread runs MLX first
    alone, _ = _sessions(tiny)
    want = alone.generate(validate_request(alone.plan, [1, 2, 3], 6)).tokens
    got: list = []

    def work() -> None:
        try:
            _, batch = _sessions(tiny)
            got.append(batch.generate(validate_request(batch.plan, [1, 2, 3], 6)).tokens)
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            got.append(err)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(120)
    assert got == [want]
