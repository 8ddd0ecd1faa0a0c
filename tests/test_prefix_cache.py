"""The prompt-prefix pool (issue #31): blocks with inter-call lifetimes, planned in M_KV.

A multi-turn conversation through a plan with a pool reuses the earlier turns' prompt chunks
(hits), generates exactly the ids a plan without the pool generates, stays within the provable
envelope, and the pool never grows (it evicts). The verifier refuses edits that would let a block
copy address outside the pool or the slots.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import TINY_QWEN2
from hardening import assert_invalid, assert_one_line_refusal, cli, edit_plan, phase_named

from dctms.runner.prefix_cache import PrefixIndex

BOUNDS = ["-N", "96", "-M", "6", "--prefill-chunk", "16", "--pack-seconds", "0", "-q"]


# ------------------------------------------------------------------------------- the index


def test_a_lookup_leaves_one_token_to_prefill() -> None:
    index = PrefixIndex(blocks=8, block_tokens=4)
    prompt = tuple(range(12))
    assert index.to_save(prompt) == [(0, 0), (4, 1), (8, 2)]
    hit = index.lookup(prompt)
    assert (hit.blocks, hit.tokens) == ([(0, 0), (4, 1)], 8)  # the third leaves nothing to prefill
    assert hit.first_token is None  # saved without its first token: not kept whole
    assert index.lookup(prompt + (99,)).blocks == [(0, 0), (4, 1), (8, 2)]
    assert index.lookup((0, 1, 2, 7, 4, 5, 6, 7, 8)).blocks == []  # the first chunk differs
    assert index.stats.hit_tokens == 20


def test_the_pool_evicts_its_least_recently_used_block() -> None:
    index = PrefixIndex(blocks=2, block_tokens=2)
    a, b, c = (1, 1, 9), (2, 2, 9), (3, 3, 9)
    assert index.to_save(a) == [(0, 0)] and index.to_save(b) == [(0, 1)]
    index.lookup(a)  # a is now more recent than b
    assert index.to_save(c) == [(0, 1)]  # b's block
    assert index.stats.evictions == 1 and index.used == 2
    assert index.lookup(b).blocks == [] and index.lookup(a).blocks == [(0, 0)]


def test_a_whole_prompt_is_found_with_its_first_token() -> None:
    index = PrefixIndex(blocks=8, block_tokens=4)
    prompt = tuple(range(10))  # two whole chunks and a part chunk of 2 tokens
    assert index.to_save(prompt, first_token=77) == [(0, 0), (4, 1), (8, 2)]
    hit = index.lookup(prompt)
    assert (hit.blocks, hit.tokens, hit.first_token) == ([(0, 0), (4, 1), (8, 2)], 10, 77)
    longer = index.lookup(prompt + (5, 5))  # a part block is no prefix of a longer prompt
    assert (longer.blocks, longer.tokens, longer.first_token) == ([(0, 0), (4, 1)], 8, None)
    shorter = index.lookup(prompt[:9])
    assert (shorter.blocks, shorter.first_token) == ([(0, 0), (4, 1)], None)
    on_a_boundary = tuple(range(100, 108))  # no part chunk: its last whole chunk is kept whole
    assert index.to_save(on_a_boundary, first_token=5) == [(0, 3), (4, 4)]
    hit = index.lookup(on_a_boundary)
    assert (hit.blocks, hit.tokens, hit.first_token) == ([(0, 3), (4, 4)], 8, 5)
    assert index.stats.hit_tokens == 10 + 8 + 8 + 8


def test_a_part_block_never_evicts_a_whole_chunk_and_goes_first() -> None:
    index = PrefixIndex(blocks=3, block_tokens=2)
    a, b = (1, 1, 9), (2, 2, 3, 3, 8)
    assert index.to_save(a, first_token=4) == [(0, 0), (2, 1)]  # its chunk and its part chunk
    assert index.lookup(a).first_token == 4
    # b's two whole chunks: the free block, then a's part block (not a's older whole chunk); b's
    # own part chunk finds no part block outside its own prompt to take, so b is not kept whole
    assert index.to_save(b, first_token=6) == [(0, 2), (2, 1)]
    assert index.lookup(b).first_token is None and index.lookup(a).first_token is None
    assert index.lookup((1, 1, 7)).blocks == [(0, 0)]  # a's whole chunk stayed
    assert index.table() == [2, 4, 2] and index.stats.evictions == 1
    # evicting the block a whole prompt's first chunk sits in forgets the prompt
    index = PrefixIndex(blocks=2, block_tokens=2)
    index.to_save((5, 5), first_token=1)
    index.to_save((6, 6), first_token=2)
    index.to_save((7, 7), first_token=3)  # evicts (5, 5), the least recently used
    assert index.lookup((5, 5)).first_token is None and index.lookup((7, 7)).first_token == 3


def test_a_history_saves_its_whole_chunks_on_the_requests_event() -> None:
    index = PrefixIndex(blocks=8, block_tokens=4)
    index.start_recording()
    prompt = tuple(range(6))
    hit = index.lookup(prompt)
    assert hit.event is index.events[0]
    assert index.to_save(prompt, first_token=50) == [(0, 0), (4, 1)]  # its chunk, its part chunk
    history = prompt + (50, 51, 52, 53, 54)  # prompt and answer: 11 tokens, 2 whole chunks
    assert index.save_history(history, hit.event) == [(4, 2)]  # the part chunk's not a whole one
    assert (index.events[0].saved, index.events[0].table) == ([0, 1, 2], [4, 6, 8] + [None] * 5)
    assert history[:8] in index and history[:11] not in index  # whole chunks only
    assert index.lookup(history + (7,)).tokens == 8 and len(index.events) == 2


# ------------------------------------------------------------------------------- the runner


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    from dctms.toolkit.tiny_model import write_tiny_model

    root = tmp_path_factory.mktemp("prefix")
    model = write_tiny_model(root / "model", TINY_QWEN2)
    out = {"model": model}
    for name, extra in (("plain", []), ("pool", ["--prefix-blocks", "8"]),
                        ("small", ["--prefix-blocks", "2", "--batch", "2"])):  # fmt: skip
        out[name] = root / f"{name}.plan"
        result = cli("compile", str(model), *BOUNDS, *extra, "-o", str(out[name]))
        assert result.code == 0, result.err
    return out


def _conversation(path: Path, turns: int = 4) -> Path:
    # the tiny model's byte tokenizer: a token per character, so the turns stay short
    path.write_text(json.dumps({"turns": [f"question {k} is here" for k in range(turns)]}))
    return path


def _turns(result) -> list[dict]:
    assert result.code == 0, result.err
    return [json.loads(line) for line in result.out.splitlines()]


def test_a_conversation_hits_the_pool_and_generates_the_same_ids(tiny, tmp_path) -> None:
    conv = _conversation(tmp_path / "c.json")
    args = ["--model", str(tiny["model"]), "--conversation", str(conv), "--max-tokens", "4"]
    report = tmp_path / "r.json"
    pooled = _turns(cli("run", str(tiny["pool"]), *args, "--ignore-eos", "--report", str(report)))
    plain = _turns(cli("run", str(tiny["plain"]), *args, "--ignore-eos"))
    assert [t["tokens"] for t in pooled] == [t["tokens"] for t in plain]
    assert pooled[0]["cached_tokens"] == 0
    assert all(t["cached_tokens"] >= 16 for t in pooled[1:])  # every later turn reuses blocks
    assert all(t["cached_tokens"] % 16 == 0 and t["cached_tokens"] < t["prompt_tokens"]
               for t in pooled)  # fmt: skip
    data = json.loads(report.read_text())
    assert data["within_envelope"] and data["prefix_pool"]["hit_blocks"] > 0
    assert data["prefix_pool"]["used"] <= data["prefix_pool"]["blocks"] == 8


def test_a_small_pool_evicts_and_the_ids_stay_exact(tiny) -> None:
    from dctms.runner.batch import BatchSession
    from dctms.runner.load import load_checked_plan
    from dctms.runner.request import validate_request
    from dctms.runner.session import Session
    from dctms.schema.model_folder import open_model_folder

    model = open_model_folder(tiny["model"])
    small, plain = load_checked_plan(tiny["small"]), load_checked_plan(tiny["plain"])
    rng = random.Random(4)
    stems = [[rng.randrange(256) for _ in range(20)] for _ in range(3)]  # one chunk each
    # a, a, b, b, c, c, a, a, b: each second one hits, c evicts a, a evicts b
    prompts = [
        stems[(i // 2) % 3] + [rng.randrange(256) for _ in range(1 + i % 5)] for i in range(9)
    ]
    batch = BatchSession(small, model)
    seqs = []
    for p in prompts:  # one at a time: each finds what the ones before it left
        seqs.append(batch.submit(validate_request(small, p, 5)))
        batch.run_all()
    stats, peak = batch.prefix.stats, batch.stats.peak_observed
    assert stats.evictions > 0 and batch.prefix.used == 2 and stats.hit_blocks > 0
    assert peak <= small.envelope.provable
    del batch
    alone = Session(plain, model)
    assert [s.generation.tokens for s in seqs] == [
        alone.generate(validate_request(plain, p, 5)).tokens for p in prompts
    ]


def test_a_repeated_prompt_prefills_nothing_and_generates_the_same_ids(tiny) -> None:
    """A prompt the pool holds whole (its part chunk and its first token) is answered without a
    prefill call: the same ids as the plan without a pool, whatever the slot held before."""
    from dctms.runner.batch import BatchSession
    from dctms.runner.load import load_checked_plan
    from dctms.runner.request import validate_request
    from dctms.runner.session import Session
    from dctms.schema.model_folder import open_model_folder

    model = open_model_folder(tiny["model"])
    pool, plain = load_checked_plan(tiny["pool"]), load_checked_plan(tiny["plain"])
    rng = random.Random(9)
    part, boundary, other = ([rng.randrange(256) for _ in range(n)] for n in (37, 32, 50))
    # (prompt, max_tokens): each repeat follows another prompt that wrote its slot's positions;
    # the last one's first token is all it asks for: it ends where it is admitted
    runs = [
        (part, 5),
        (other, 5),
        (part, 5),
        (boundary, 4),
        (other, 3),
        (boundary, 4),
        (boundary, 1),
    ]
    batch = BatchSession(pool, model)
    seqs, calls = [], []
    for prompt, budget in runs:  # one at a time: each finds what the ones before it left
        before = batch.stats.prefill_calls
        seqs.append(batch.submit(validate_request(pool, prompt, budget)))
        batch.run_all()
        calls.append(batch.stats.prefill_calls - before)
    # 8 blocks: part's 2 chunks and part chunk, other's 3 and part chunk; boundary's 2 chunks take
    # the free block and other's part block (the least recently used part block, never a whole
    # chunk), so other's repeat prefills its last 2 tokens, and keeps its part chunk in the block of
    # part's (a part block takes only a part block's place)
    assert calls == [3, 4, 0, 2, 1, 0, 0]
    assert [s.generation.cached_tokens for s in seqs] == [0, 0, 37, 0, 48, 32, 32]
    assert batch.stats.whole_prompt_hits == 3 and batch.slots == [None] * len(batch.slots)
    assert sorted(batch.prefix.table()) == [16, 16, 16, 32, 32, 32, 48, 50]
    assert batch.stats.peak_observed <= pool.envelope.provable
    del batch
    alone = Session(plain, model)
    assert [s.generation.tokens for s in seqs] == [
        alone.generate(validate_request(plain, p, budget)).tokens for p, budget in runs
    ]


def test_a_chats_answers_are_reused_by_its_next_turn_with_the_same_ids(tiny) -> None:
    """Each turn re-sends the history (the prompt, the answer, two new tokens): the chunks that
    hold an answer come from the pool too (re-prefilled after the turn as the whole chunk the next
    prompt's prefill would run), and every turn's ids equal the plan without a pool."""
    from dctms.runner.batch import BatchSession
    from dctms.runner.load import load_checked_plan
    from dctms.runner.request import validate_request
    from dctms.runner.session import Session
    from dctms.schema.model_folder import open_model_folder

    model = open_model_folder(tiny["model"])
    pool, plain = load_checked_plan(tiny["pool"]), load_checked_plan(tiny["plain"])
    rng = random.Random(17)
    batch = BatchSession(pool, model)
    prompt, prompts, seqs, history_chunks = [rng.randrange(256) for _ in range(28)], [], [], []
    pending = []
    for _ in range(6):  # prompts of 28, 36, 44, 52, 60 and 68 tokens, 6 generated each
        prompts.append(prompt)
        seqs.append(batch.submit(validate_request(pool, prompt, 6)))
        batch.run_all()  # the turn: its history waits for an idle moment
        pending.append(bool(batch.histories))
        batch.run_all(histories=True)  # that moment: every slot is free after it
        history_chunks.append(batch.stats.history_chunks)
        prompt = prompt + seqs[-1].generation.tokens + [rng.randrange(256) for _ in range(2)]
    # the histories of 34, 50 and 66 tokens end a whole chunk past their prompt's last one:
    # turns 2, 4 and 6 find it (a prompt's own chunks alone would give 16, 32 and 48)
    assert [s.generation.cached_tokens for s in seqs] == [0, 32, 32, 48, 48, 64]
    assert pending == [True, False] * 3 and history_chunks == [1, 1, 2, 2, 3, 3]
    assert batch.slots == [None] * len(batch.slots)
    assert batch.stats.peak_observed <= pool.envelope.provable
    del batch
    alone = Session(plain, model)
    assert [s.generation.tokens for s in seqs] == [
        alone.generate(validate_request(plain, p, 6)).tokens for p in prompts
    ]


def test_without_pool_answers_a_chat_finds_its_prompts_chunks_only(tiny) -> None:
    """``keep_answers = False`` (serve --no-pool-answers): no history, so each turn finds the
    previous prompt's whole chunks only, and the ids are those of the plan without a pool."""
    from dctms.runner.batch import BatchSession
    from dctms.runner.load import load_checked_plan
    from dctms.runner.request import validate_request
    from dctms.runner.session import Session
    from dctms.schema.model_folder import open_model_folder

    model = open_model_folder(tiny["model"])
    pool, plain = load_checked_plan(tiny["pool"]), load_checked_plan(tiny["plain"])
    rng = random.Random(17)
    batch = BatchSession(pool, model)
    batch.keep_answers = False
    prompt, prompts, seqs = [rng.randrange(256) for _ in range(28)], [], []
    for _ in range(6):  # the chat of the test above
        prompts.append(prompt)
        seqs.append(batch.submit(validate_request(pool, prompt, 6)))
        batch.run_all(histories=True)
        assert not batch.histories
        prompt = prompt + seqs[-1].generation.tokens + [rng.randrange(256) for _ in range(2)]
    assert [s.generation.cached_tokens for s in seqs] == [0, 16, 32, 32, 48, 48]
    assert batch.stats.history_chunks == 0
    del batch
    alone = Session(plain, model)
    assert [s.generation.tokens for s in seqs] == [
        alone.generate(validate_request(plain, p, 6)).tokens for p in prompts
    ]


def test_a_request_ends_the_histories_and_runs_as_without_them(tiny) -> None:
    """A history is work for an idle batch: a request that arrives ends it, and so does a
    running sequence in a slot above it (it moves down instead); the ids stay the plan's."""
    from dctms.runner.batch import BatchSession
    from dctms.runner.load import load_checked_plan
    from dctms.runner.request import validate_request
    from dctms.runner.session import Session
    from dctms.schema.model_folder import open_model_folder

    model = open_model_folder(tiny["model"])
    small, plain = load_checked_plan(tiny["small"]), load_checked_plan(tiny["plain"])
    rng = random.Random(23)
    a, b, c, d = ([rng.randrange(256) for _ in range(n)] for n in (28, 20, 21, 30))
    batch = BatchSession(small, model)
    first = batch.submit(validate_request(small, a, 6))
    while not first.done:
        batch.iterate()
    assert list(batch.histories) == [0] and batch.busy == 1 and not batch.live  # [16, 32) next
    runs = [(b, 4), (c, 4)]
    later = [batch.submit(validate_request(small, p, n)) for p, n in runs]
    batch.run_all()  # b and c arrive: the history ends before its chunk
    assert (batch.stats.histories_cut, batch.stats.history_chunks) == (1, 0)
    # d (30 tokens, 2 generated: a whole chunk [16, 32) to give) ends in slot 0 while b runs on
    # in slot 1: its history ends, b moves down into slot 0
    runs += [(d, 2), (b, 6)]
    later += [batch.submit(validate_request(small, p, n)) for p, n in runs[2:]]
    moves = batch.stats.moves
    batch.run_all()
    assert (batch.stats.histories_cut, batch.stats.history_chunks) == (2, 0)
    assert batch.stats.moves == moves + 1 and batch.slots == [None, None] and not batch.histories
    del batch
    alone = Session(plain, model)
    assert [s.generation.tokens for s in later] == [
        alone.generate(validate_request(plain, p, n)).tokens for p, n in runs
    ]


def test_a_cancelled_request_keeps_no_history(tiny) -> None:
    from dctms.runner.batch import BatchSession
    from dctms.runner.load import load_checked_plan
    from dctms.runner.request import validate_request
    from dctms.schema.model_folder import open_model_folder

    model = open_model_folder(tiny["model"])
    pool = load_checked_plan(tiny["pool"])
    batch = BatchSession(pool, model)
    prompt = [random.Random(5).randrange(256) for _ in range(30)]
    kept: list[int] = []

    def until_three(token: int) -> bool:
        kept.append(token)
        return len(kept) < 3

    seq = batch.submit(validate_request(pool, prompt, 6), on_token=until_three)
    batch.run_all()  # the client went away after 3 tokens: its answer is no chat's history
    assert seq.finish == "cancelled" and batch.stats.history_chunks == 0 and not batch.histories
    same = batch.submit(validate_request(pool, prompt, 6))
    batch.run_all(histories=True)  # the same prompt answered in full: 36 tokens, [16, 32) kept
    assert (same.finish, batch.stats.history_chunks) == ("length", 1)


def test_batch_prompts_that_repeat_are_answered_from_the_pool(tiny, tmp_path) -> None:
    rng = random.Random(12)
    p, q = ([rng.randrange(256) for _ in range(n)] for n in (41, 23))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"tokens": x}) + "\n" for x in (p, q, p)))
    report = tmp_path / "r.json"
    result = cli("run", str(tiny["pool"]), "--model", str(tiny["model"]), "--batch-prompts",
                 str(prompts), "--max-tokens", "4", "--ignore-eos", "--report", str(report))  # fmt: skip
    rows = _turns(result)
    assert [r["cached_tokens"] for r in rows] == [0, 0, 41]
    assert rows[2]["tokens"] == rows[0]["tokens"]
    data = json.loads(report.read_text())
    pool = data["prefix_pool"]
    assert pool["whole_prompt_hits"] == 1 and pool["hit_tokens"] == 41 and pool["blocks"] == 8
    assert data["prefill_calls"] == 3 + 2  # p in three chunks, q in two, p again in none
    assert "(1 prompts held whole: no prefill call)" in result.err


def test_the_pool_is_counted_in_the_kv_term(tiny) -> None:
    from dctms.schema.io import read_plan

    pool, plain = read_plan(tiny["pool"]), read_plan(tiny["plain"])
    blocks = [s for s in pool.state if s.name.endswith(".pool")]
    assert len(blocks) == 2 * TINY_QWEN2["num_hidden_layers"]
    assert all(s.shape[0] == 8 and s.shape[2] == 16 for s in blocks)
    assert pool.envelope.kv == plain.envelope.kv + sum(s.bytes for s in blocks)
    assert {p.name for p in pool.phases} >= {"save_block", "load_block"}
    assert pool.bounds.prefix_blocks == 8 and plain.bounds.prefix_blocks == 0


# ------------------------------------------------------------------------------- bad input


def test_a_pool_beyond_the_budget_names_the_largest_that_fits(tiny, tmp_path) -> None:
    from dctms.schema.io import read_plan

    plan = read_plan(tiny["pool"])
    per_block = sum(s.bytes for s in plan.state if s.name.endswith(".pool")) // 8
    out = tmp_path / "x.plan"
    result = cli("compile", str(tiny["model"]), *BOUNDS, "--prefix-blocks", "8",
                 "--memory", str(plan.envelope.total - 2 * per_block), "-o", str(out))  # fmt: skip
    assert_one_line_refusal(result, "compile", "the largest pool that fits is --prefix-blocks 6 ")
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--prefix-blocks", "-1"], "--prefix-blocks must be 0 (none) or more"),
        (["--prefix-cache", "100B"], "holds no block: one block"),
        (["--prefix-cache", "lots"], "--prefix-cache:"),
        (["--prefix-blocks", "2", "--kv-bits", "8"], "not supported with --kv-bits"),
        (["--prefix-blocks", "2", "--sampling"], "not supported with --sampling"),
    ],
)
def test_bad_pool_options_are_refused_in_one_line(tiny, tmp_path, flags, needle) -> None:
    result = cli("compile", str(tiny["model"]), *BOUNDS, *flags, "-o", str(tmp_path / "x.plan"))
    assert_one_line_refusal(result, "compile", needle)


def test_prefix_cache_size_gives_whole_blocks(tiny, tmp_path) -> None:
    from dctms.schema.io import read_plan

    plan = read_plan(tiny["pool"])
    per_block = sum(s.bytes for s in plan.state if s.name.endswith(".pool")) // 8
    out = tmp_path / "x.plan"
    size = 3 * per_block + per_block // 2
    assert cli("compile", str(tiny["model"]), *BOUNDS, "--prefix-cache", str(size),
               "-o", str(out)).code == 0  # fmt: skip
    assert read_plan(out).bounds.prefix_blocks == 3


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("[1, 2]", 'expected {"turns": [TEXT, ...]}'),
        ('{"turns": []}', 'expected {"turns": [TEXT, ...]}'),
        ('{"turns": ["a"], "system": 3}', '"system" must be a string'),
        ("{", "cannot read it as JSON"),
    ],
)
def test_bad_conversation_files_are_refused_in_one_line(tiny, tmp_path, content, needle) -> None:
    path = tmp_path / "c.json"
    path.write_text(content)
    result = cli("run", str(tiny["pool"]), "--model", str(tiny["model"]), "--conversation",
                 str(path))  # fmt: skip
    assert_one_line_refusal(result, "run", needle)


# ------------------------------------------------------------------------------- the verifier


def test_the_verifier_wants_pool_blocks_for_the_bound(tiny, tmp_path) -> None:
    def more_blocks(doc: dict) -> None:
        doc["bounds"]["prefix_blocks"] = 9

    edited = edit_plan(tiny["pool"], tmp_path / "e.plan", more_blocks)
    assert_invalid(cli("validate", str(edited)), "does not hold 9 blocks of 16 positions")


def test_the_verifier_refuses_a_pool_without_bounds(tiny, tmp_path) -> None:
    def no_blocks(doc: dict) -> None:
        doc["bounds"]["prefix_blocks"] = 0

    edited = edit_plan(tiny["pool"], tmp_path / "e.plan", no_blocks)
    assert_invalid(
        cli("validate", str(edited)), "copies prefix-pool blocks, but bounds.prefix_blocks is 0"
    )


def test_the_verifier_bounds_the_block_a_copy_addresses(tiny, tmp_path) -> None:
    """save_block's pool write read from a constant block 8 (the pool holds 0..7)."""

    def constant_block(doc: dict) -> None:
        save = phase_named(doc, "save_block")
        op = next(o for o in save["ops"] if o["primitive"] == "DynamicSliceUpdate")
        save["constants"].append({"id": "edited", "shape": [1], "dtype": "int32", "value": [8]})
        op["inputs"][-1] = "edited"

    edited = edit_plan(tiny["pool"], tmp_path / "e.plan", constant_block)
    assert_invalid(cli("validate", str(edited)), "ranges over [8, 8]")


def test_the_verifier_refuses_a_save_that_writes_slots(tiny, tmp_path) -> None:
    def swap(doc: dict) -> None:
        save = phase_named(doc, "save_block")
        out = next(b for b in save["outputs"] if b["name"].endswith(".pool"))
        out["name"] = out["name"].removesuffix(".pool")

    edited = edit_plan(tiny["pool"], tmp_path / "e.plan", swap)
    assert_invalid(cli("validate", str(edited)), "save_block writes pool blocks")


# ------------------------------------------------------------------------------- the server


def _chat(url: str, messages: list[dict]) -> dict:
    import urllib.request

    body = {"model": "m", "messages": messages, "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_dctms_serve_reuses_the_pool_across_requests(tiny) -> None:
    """A chat re-sent with one more turn: the server takes the earlier prompt's chunks from the
    pool (usage.prompt_tokens_details.cached_tokens), and answers what the plan without a pool
    answers."""
    from serve_helpers import ServerProcess, metric_series

    history = [{"role": "user", "content": "question zero is here, and it is long enough"}]
    answers = {}
    for name in ("pool", "plain"):
        server = ServerProcess(["--plan", f"m={tiny[name]}={tiny['model']}"])
        try:
            first = _chat(server.url, history)
            turn = [*history, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "and one more question"}]  # fmt: skip
            second = _chat(server.url, turn)
            again = _chat(server.url, history)  # the first chat once more: kept whole
            metrics = metric_series(server.url)
        finally:
            server.close()
        answers[name] = (first, second, again, metrics)
    (first, second, again, metrics), plain = answers["pool"], answers["plain"]
    plain_first, plain_second, _, plain_metrics = plain
    pool = {k: v for k, v in metrics.items() if k.startswith("dctms_prefix_pool_")}
    assert pool['dctms_prefix_pool_blocks{model="m"}'] == 8
    assert pool['dctms_prefix_pool_lookups_total{model="m"}'] == 3
    assert pool['dctms_prefix_pool_whole_prompt_hits_total{model="m"}'] == 1
    assert pool['dctms_prefix_pool_hit_tokens_total{model="m"}'] == (
        second["usage"]["prompt_tokens_details"]["cached_tokens"] + again["usage"]["prompt_tokens"]
    )
    assert 0 < pool['dctms_prefix_pool_blocks_used{model="m"}'] <= 8
    assert pool['dctms_prefix_pool_evictions_total{model="m"}'] == 0
    assert pool['dctms_prefix_pool_history_chunks_total{model="m"}'] >= 0  # the series is there
    assert 'dctms_prefix_pool_blocks{model="m"}' not in plain_metrics
    whole = again["usage"]
    assert whole["prompt_tokens_details"]["cached_tokens"] == whole["prompt_tokens"]
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16 and cached % 16 == 0 and cached < second["usage"]["prompt_tokens"]
    assert "prompt_tokens_details" not in plain_second["usage"]
    assert [a["choices"][0]["message"]["content"] for a in (first, second)] == [
        a["choices"][0]["message"]["content"] for a in (plain_first, plain_second)
    ]


@pytest.mark.parametrize("flags, chunks", [([], 1), (["--no-pool-answers"], 0)])
def test_dctms_serve_gives_the_pool_an_answers_chunks_while_idle(tiny, flags, chunks) -> None:
    """A prompt one token short of a chunk boundary: whatever the answer, prompt and answer end a
    whole chunk past the prompt's last one, which the idle server prefills again for the pool;
    with --no-pool-answers it stays idle (given 2 s, ten times what that chunk takes here)."""
    import time

    from serve_helpers import ServerProcess, metric_series

    series = 'dctms_prefix_pool_history_chunks_total{model="m"}'
    server = ServerProcess(["--plan", f"m={tiny['pool']}={tiny['model']}", *flags])
    try:
        probe = _chat(server.url, [{"role": "user", "content": "x"}])["usage"]["prompt_tokens"]
        time.sleep(1)  # the probe's own history, if it has one, runs now
        before = metric_series(server.url)[series]
        # the tiny model's byte tokenizer: one token per character of the message
        text = "y" * (1 + (15 - probe) % 16 + 16)
        usage = _chat(server.url, [{"role": "user", "content": text}])["usage"]
        assert usage["prompt_tokens"] % 16 == 15
        deadline, after = time.monotonic() + (30 if chunks else 2), before
        while after == before and time.monotonic() < deadline:
            time.sleep(0.1)
            after = metric_series(server.url)[series]
    finally:
        server.close()
    assert after - before == chunks
