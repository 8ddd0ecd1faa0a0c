"""Sampling inside the plan (``compile --sampling``), against mlx-lm itself.

On a tiny random-weight model: with the same seed, the runner's ids equal ``generate_step``'s with
``make_sampler(...)`` / ``make_logits_processors(...)`` after ``mx.random.seed(seed)``, for each
parameter at a setting where it changes the ids; the log-probabilities equal the ones
``generate_step`` yields; the observed peak stays within the provable envelope. A greedy plan
refuses sampling settings naming ``--sampling``; the verifier rejects a sampling plan whose
interface is broken; settings outside what mlx-lm or the plan accept are one line, exit 2.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest
from msgspec.structs import replace as struct_replace
from test_real_model import smollm2  # noqa: F401 - the session fixture
from tiny_configs import BASE, QWEN2_F32

from dctms.runner.request import validate_request
from dctms.runner.sampling import SamplingParams
from dctms.schema.errors import DctmsError
from dctms.schema.model_folder import open_model
from dctms.schema.sampling import BIAS_SLOTS
from dctms.schema.verify import verify_plan
from dctms.toolkit.compiler import CompileOptions, compile_plan

N, M, CHUNK = 64, 32, 16
K = 16  # generated tokens per run
CONFIG = {**BASE, **QWEN2_F32}
PROMPT = [(i * 37 + 5) % 256 for i in range(23)]  # two prefill chunks, the second padded
# Each setting, and the one that differs from it only by the parameter under test.
CASES = {
    "temp": (SamplingParams(temp=1.0, seed=3), SamplingParams(seed=3)),
    "top_p": (SamplingParams(temp=1.0, top_p=0.3, seed=5), SamplingParams(temp=1.0, seed=5)),
    "top_k": (SamplingParams(temp=1.0, top_k=3, seed=6), SamplingParams(temp=1.0, seed=6)),
    "min_p": (SamplingParams(temp=1.0, min_p=0.5, seed=7), SamplingParams(temp=1.0, seed=7)),
    "repetition_penalty": (
        SamplingParams(temp=1.0, repetition_penalty=3.0, repetition_context_size=8, seed=8),
        SamplingParams(temp=1.0, seed=8),
    ),
    "logit_bias": (
        SamplingParams(logit_bias={3: 4.0, 9: -50.0}, seed=9),
        SamplingParams(seed=9),
    ),
    "seed": (SamplingParams(temp=0.7, top_p=0.9, seed=11), SamplingParams(temp=0.7, top_p=0.9, seed=12)),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, sampling plan, plan path, greedy plan path, mlx-lm model)."""
    from mlx_lm.utils import load_model

    from dctms.schema.io import write_plan
    from dctms.toolkit.tiny_model import write_tiny_model

    folder = tmp_path_factory.mktemp("sampling")
    write_tiny_model(folder, CONFIG, seed=7)
    plan = compile_plan(open_model(folder), CompileOptions(N, M, prefill_chunk=CHUNK, sampling=True))
    write_plan(plan, folder / "sampling.plan")
    greedy = compile_plan(open_model(folder), CompileOptions(N, M, prefill_chunk=CHUNK))
    write_plan(greedy, folder / "greedy.plan")
    return folder, plan, folder / "sampling.plan", folder / "greedy.plan", load_model(folder)[0]


@pytest.fixture(scope="module")
def session(tiny):
    from dctms.runner.load import load_checked_plan
    from dctms.runner.session import Session
    from dctms.schema.model_folder import open_model_folder

    folder, _, path, _, _ = tiny
    plan = load_checked_plan(str(path))
    return Session(plan, open_model_folder(str(folder)))


def ours(session, params: SamplingParams, prompt=PROMPT, k: int = K):
    return session.generate(validate_request(session.plan, prompt, k, (), params))


def mlx_lm_ids(model, params: SamplingParams, prompt=PROMPT, k: int = K, chunk: int = CHUNK):
    """(ids, log-probability vectors) of generate_step after mx.random.seed(params.seed)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    mx.random.seed(params.seed)
    sampler = make_sampler(params.temp, params.top_p, params.min_p, 1, params.top_k)
    processors = make_logits_processors(
        params.logit_bias or None, params.repetition_penalty, params.repetition_context_size
    )
    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=k,
        sampler=sampler,
        logits_processors=processors,
        prefill_step_size=chunk,
    )
    ids, logprobs = [], []
    for token, lp in steps:
        ids.append(int(token))
        logprobs.append(lp)
    return ids, logprobs


@pytest.mark.parametrize("name", list(CASES))
def test_ids_equal_mlx_lm_with_the_same_seed(tiny, session, name) -> None:
    model = tiny[4]
    params, without = CASES[name]
    got = ours(session, params).tokens
    assert got == mlx_lm_ids(model, params)[0]
    assert got != ours(session, without).tokens, f"{name} does not change the ids here"


def test_the_plan_holds_the_sampling_ops_and_the_envelope(tiny, tmp_path) -> None:
    import json

    folder, plan, path, _, _ = tiny
    assert verify_plan(plan) == []
    for phase in plan.phases:
        ops = {op.primitive for op in phase.ops}
        # the top-p sort, the penalty's and bias's gathers and scatters, the key split and draw
        assert {"ArgSort", "GatherAxis", "ScatterAxis", "RandomBits", "SearchSorted"} <= ops
    # in a process of its own (mlx-lm's runs here would count in MLX's peak)
    report = tmp_path / "r.json"
    flags = ["--temp", "0.7", "--top-p", "0.9", "--top-k", "20", "--min-p", "0.05"]
    flags += ["--repetition-penalty", "1.2", "--logit-bias", "5=2", "--logprobs", "20"]
    proc = run_cli(path, folder, *flags, "--seed", "1", "--report", str(report))
    assert proc.returncode == 0, proc.stderr
    r = json.loads(report.read_text())
    assert 0 < r["observed"]["mlx_peak_bytes"] <= r["provable_bytes"]


def test_logprobs_equal_generate_steps(tiny, session) -> None:
    params = SamplingParams(temp=0.8, seed=21, logprobs=True, top_logprobs=5)
    gen = ours(session, params, k=6)
    ids, vectors = mlx_lm_ids(tiny[4], params, k=6)
    assert gen.tokens == ids and len(gen.logprobs) == len(ids)
    # The ids are equal; the values to float32 rounding (the plan computes the prompt's last
    # logits inside a padded chunk, generate_step alone).
    close = {"rel": 1e-5, "abs": 1e-5}
    for token, got, want in zip(ids, gen.logprobs, vectors, strict=True):
        assert got.logprob == pytest.approx(want[token].item(), **close)
        top = sorted(range(want.shape[0]), key=lambda i: -want[i].item())[:5]
        assert [i for i, _ in got.top] == top
        assert [v for _, v in got.top] == pytest.approx([want[i].item() for i in top], **close)


def test_greedy_sampling_plan_matches_the_greedy_plan(tiny, session) -> None:
    """Temperature 0 and no processors: the same ids as the plan compiled without --sampling."""
    folder, _, _, greedy_path, _ = tiny
    from dctms.runner.load import load_checked_plan
    from dctms.runner.session import Session
    from dctms.schema.model_folder import open_model_folder

    plan = load_checked_plan(str(greedy_path))
    greedy = Session(plan, open_model_folder(str(folder)))
    want = greedy.generate(validate_request(plan, PROMPT, K)).tokens
    assert ours(session, SamplingParams(seed=0)).tokens == want


def run_cli(plan: Path, folder: Path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dctms.cli.main", "run", str(plan), "--model", str(folder)]
    cmd += ["--tokens", ",".join(map(str, PROMPT)), "--max-tokens", "4", "--ignore-eos", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_greedy_plan_refuses_sampling_flags_naming_the_recompile_flag(tiny) -> None:
    folder, _, _, greedy_path, _ = tiny
    proc = run_cli(greedy_path, folder, "--temp", "0.7", "--top-p", "0.9")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--sampling" in lines[0] and "--temp" in lines[0], proc.stderr


def test_run_reports_seed_and_logprobs(tiny, tmp_path) -> None:
    import json

    folder, _, path, _, model = tiny
    report = tmp_path / "r.json"
    proc = run_cli(path, folder, "--temp", "0.7", "--seed", "5", "--logprobs", "3", "--report", str(report))
    assert proc.returncode == 0, proc.stderr
    r = json.loads(report.read_text())
    assert r["seed"] == 5 and r["within_envelope"]
    assert r["tokens"] == mlx_lm_ids(model, SamplingParams(temp=0.7, seed=5), k=4)[0]
    assert [len(t["top_logprobs"]) for t in r["logprobs"]] == [3] * 4


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--top-k", "257"], "top_k"),
        (["--top-p", "1.5"], "top_p"),
        (["--min-p", "-0.1"], "min_p"),
        (["--temp", "-1"], "temperature"),
        (["--repetition-context-size", "0"], "repetition_context_size"),
        (["--repetition-context-size", "100000"], "repetition_context_size"),
        (["--logit-bias", "999=1"], "logit_bias"),
        (["--logit-bias", "x"], "--logit-bias"),
        (["--logprobs", "21"], "top_logprobs"),
        (["--seed", "-1"], "seed"),
    ],
)
def test_bad_settings_are_one_line_exit_2(tiny, flags, words) -> None:
    folder, _, path, _, _ = tiny
    proc = run_cli(path, folder, *flags)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr


def test_too_many_logit_bias_pairs_are_refused(tiny) -> None:
    plan = tiny[1]
    too_many = dict.fromkeys(range(BIAS_SLOTS + 1), 1.0)
    with pytest.raises(DctmsError, match=f"logit_bias has {BIAS_SLOTS + 1} entries"):
        validate_request(plan, PROMPT, 4, (), SamplingParams(logit_bias=too_many))


def _with_phase(plan, name: str, **changes):
    phases = [struct_replace(p, **changes) if p.name == name else p for p in plan.phases]
    return struct_replace(plan, phases=phases)


def test_verifier_rejects_a_broken_sampling_interface(tiny) -> None:
    plan = tiny[1]
    decode = next(p for p in plan.phases if p.name == "decode")
    # an input the runner feeds, missing
    no_key = [b for b in decode.inputs if b.name != "key"]
    rules = {p.rule for p in verify_plan(_with_phase(plan, "decode", inputs=no_key))}
    assert {"sampling", "runner_names"} <= rules
    # the repetition window of another size in the decode output than in its input
    outputs = [
        struct_replace(b, shape=[b.shape[0] + 1]) if b.name == "next_recent" else b
        for b in decode.outputs
    ]
    assert "sampling" in {p.rule for p in verify_plan(_with_phase(plan, "decode", outputs=outputs))}
    # token ids (fed below vocab_size) indexing a gather over fewer entries
    wider = struct_replace(plan, model=struct_replace(plan.model, vocab_size=300))
    found = [p for p in verify_plan(wider) if p.rule == "sampling"]
    assert found and "fewer than model.vocab_size 300" in found[0].message
    # a greedy plan that claims --sampling lacks every sampling input
    greedy = struct_replace(plan, compile=struct_replace(plan.compile, sampling=False))
    assert "sampling" not in {p.rule for p in verify_plan(greedy)}
    assert any(p.rule == "runner_names" for p in verify_plan(greedy))


def test_sampling_refused_where_the_runner_cannot_feed_it(tiny) -> None:
    folder = tiny[0]
    with pytest.raises(DctmsError, match="--sampling is not supported with --kv-bits"):
        compile_plan(open_model(folder), CompileOptions(N, M, kv_bits=4, sampling=True))


@pytest.mark.slow
def test_real_smollm2_seeded_ids_equal_mlx_lm(smollm2, tmp_path) -> None:  # noqa: F811
    SMOLLM2 = smollm2  # noqa: N806 - the session's converted folder (test_real_model's fixture)
    from mlx_lm import load

    from dctms.runner.load import load_checked_plan
    from dctms.runner.session import Session
    from dctms.runner.tokenize import Tokenizer, encode_chat
    from dctms.schema.io import write_plan
    from dctms.schema.model_folder import open_model_folder

    chunk = 32
    plan = compile_plan(open_model(SMOLLM2), CompileOptions(64, 24, prefill_chunk=chunk, sampling=True))
    write_plan(plan, tmp_path / "s.plan")
    session = Session(load_checked_plan(str(tmp_path / "s.plan")), open_model_folder(str(SMOLLM2)))
    prompt = encode_chat(Tokenizer(SMOLLM2), "Name three colours.", None)
    params = SamplingParams(temp=0.7, top_p=0.9, seed=1234)
    got = ours(session, params, prompt=prompt, k=24)
    model, _ = load(str(SMOLLM2))
    assert got.tokens == mlx_lm_ids(model, params, prompt=prompt, k=24, chunk=chunk)[0]
    assert got.tokens != ours(session, replace(params, seed=1235), prompt=prompt, k=24).tokens
    # The envelope, in a process of its own (mlx-lm's model here counts in MLX's peak).
    import json

    report = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "dctms.cli.main", "run", str(tmp_path / "s.plan"), "--model"]
    cmd += [str(SMOLLM2), "--tokens", ",".join(map(str, prompt)), "--max-tokens", "24"]
    cmd += ["--ignore-eos", "--temp", "0.7", "--top-p", "0.9", "--seed", "1234"]
    proc = subprocess.run([*cmd, "--report", str(report)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(report.read_text())
    assert r["tokens"] == got.tokens and r["within_envelope"]


def test_bfloat16_model_ids_equal_mlx_lm(tmp_path) -> None:
    """The scalars meet bfloat16 logits as mlx-lm's Python floats do (cast, not promoted)."""
    from mlx_lm.utils import load_model

    from dctms.runner.session import Session
    from dctms.schema.model_folder import open_model_folder
    from dctms.toolkit.tiny_model import write_tiny_model

    config = {**CONFIG, "model_type": "llama", "torch_dtype": "bfloat16", "head_dim": 64}
    write_tiny_model(tmp_path, {**config, "tie_word_embeddings": False}, seed=5)
    plan = compile_plan(open_model(tmp_path), CompileOptions(N, M, prefill_chunk=CHUNK, sampling=True))
    assert plan.bounds.dtype == "bfloat16"
    session = Session(plan, open_model_folder(str(tmp_path)))
    params = SamplingParams(
        temp=0.7, top_p=0.9, top_k=40, min_p=0.02, repetition_penalty=1.3,
        logit_bias={5: 1.5}, seed=17,
    )  # fmt: skip
    got = ours(session, params).tokens
    assert got == mlx_lm_ids(load_model(tmp_path)[0], params)[0]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_categorical_replica_draws_what_mlx_draws(dtype) -> None:
    """toolkit.sampling.categorical (its bits by in-plan Threefry) against mx.random.categorical
    with the same key: many keys, vocabularies and masked (-inf) logits."""
    from dctms.toolkit.sampling import categorical

    for s in range(120):
        key = mx.random.key(s * 7919 + 3)
        vocab = (2, 10, 257, 5000)[s % 4]
        logits = mx.random.normal((1, vocab), key=mx.random.key(s)) * (1 + s % 5)
        if s % 3 == 0:
            drop = mx.random.uniform(shape=(1, vocab), key=mx.random.key(s + 1)) < 0.5
            logits = mx.where(drop, -mx.inf, logits)
        logits = logits.astype(dtype)
        assert categorical(logits, key).item() == mx.random.categorical(logits, key=key).item(), s
