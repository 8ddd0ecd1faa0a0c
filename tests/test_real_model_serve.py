"""The real SmolLM2-135M-Instruct named by its Hugging Face id and served to the `openai` client: a
plan compiled by id from a Hugging Face cache, `dctms serve --plan NAME=PLAN=ORG/NAME`, stop
strings and finish reasons, and the usual fields a greedy plan honours. Skips, saying why, when
the cached model is missing (tests/test_real_model.py fetches and converts it)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
from serve_helpers import ServerProcess  # noqa: E402
from test_real_model import QUESTION, smollm2  # noqa: E402, F401  (the session fixture)

pytestmark = pytest.mark.slow

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMMIT = hashlib.sha1(b"smollm2 float32 conversion").hexdigest()


def _linked_cache(cache: Path, folder: Path) -> None:
    """``folder`` in huggingface_hub's cache layout, its blobs links to the files (no copy)."""
    store = cache / ("models--" + REPO.replace("/", "--"))
    snapshot = store / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (store / "blobs").mkdir()
    for f in sorted(folder.iterdir()):
        if f.is_file():
            blob = store / "blobs" / hashlib.sha256(f.name.encode()).hexdigest()
            blob.symlink_to(f.resolve())
            (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (store / "refs").mkdir()
    (store / "refs" / "main").write_text(COMMIT)


@pytest.fixture(scope="module")
def served(smollm2, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("smollm2-hub")
    cache = root / "hub"
    _linked_cache(cache, smollm2)
    env = {**os.environ, "HF_HUB_CACHE": str(cache)}
    plan = root / "smollm2.plan"
    compiled = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "compile", REPO, "-N", "64", "-M", "16",
         "--prefill-chunk", "32", "-o", str(plan), "-q"],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert compiled.returncode == 0, compiled.stderr
    os.environ["HF_HUB_CACHE"], old = str(cache), os.environ.get("HF_HUB_CACHE")
    try:  # the server process inherits it
        proc = ServerProcess(["--plan", f"smol={plan}={REPO}", "--memory", "4GiB"], timeout_s=600)
    finally:
        if old is None:
            del os.environ["HF_HUB_CACHE"]
        else:
            os.environ["HF_HUB_CACHE"] = old
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0, timeout=300)
    yield client, plan
    proc.close()


def test_the_plan_records_the_id_and_the_commit(served):
    from dctms.schema.io import read_plan

    plan = read_plan(served[1])
    assert (plan.compile.hub.repo_id, plan.compile.hub.revision) == (REPO, COMMIT)


def test_stop_and_finish_reasons_on_the_real_model(served):
    client, _ = served
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model="smol", messages=messages, max_tokens=16,
                                           temperature=0, top_p=1, n=1, user="test")  # fmt: skip
    answer = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop"  # the model ended it (end of sequence)
    words = answer.split(" ")
    assert len(words) >= 3, answer
    stop = " " + words[2]  # the third word, with its space
    want = answer[: answer.find(stop)]
    got = client.chat.completions.create(model="smol", messages=messages, max_tokens=16, stop=stop)
    assert (got.choices[0].message.content, got.choices[0].finish_reason) == (want, "stop")
    assert got.usage.completion_tokens < whole.usage.completion_tokens
    streamed = list(client.chat.completions.create(
        model="smol", messages=messages, max_tokens=16, stop=[stop, "never here"], stream=True,
    ))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want
    assert streamed[-1].choices[0].finish_reason == "stop"
    short = client.completions.create(model="smol", prompt="The capital of France is",
                                      max_tokens=3)  # fmt: skip
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


def test_sampling_fields_are_refused_naming_the_recompile(served):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "x"}],
                                       temperature=0.7, max_tokens=2)  # fmt: skip
    assert "'temperature'" in str(err.value) and "--sampling" in str(err.value)


@pytest.fixture(scope="module")
def served_sampling(smollm2, tmp_path_factory):  # noqa: F811
    """A --sampling plan of the real model, served (named by its folder: the id path is above)."""
    plan = tmp_path_factory.mktemp("smollm2-sampling") / "sampling.plan"
    compiled = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "compile", str(smollm2), "-N", "64", "-M", "16",
         "--prefill-chunk", "32", "--sampling", "-o", str(plan), "-q"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert compiled.returncode == 0, compiled.stderr
    proc = ServerProcess(["--plan", f"smol={plan}={smollm2}", "--memory", "4GiB"], timeout_s=600)
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0, timeout=300)
    yield client, smollm2, proc
    proc.close()


def test_the_openai_clients_usual_fields_on_the_real_model(served_sampling):
    """Issue 30's bar: temperature 0.7, top_p 0.9, stop, seed and logprobs from the `openai`
    client, answered without an error; the seeded ids equal mlx-lm's generate_step's with the same
    sampler after mx.random.seed, on the same chat prompt; MLX's peak within the envelope."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from dctms.runner.tokenize import Tokenizer, encode_chat

    client, folder, proc = served_sampling
    messages = [{"role": "user", "content": "Name three colours."}]
    r = client.chat.completions.create(
        model="smol", messages=messages, max_tokens=16, temperature=0.7, top_p=0.9, seed=1234,
        stop=["\n\n\n"], logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = r.choices[0]
    ids = choice.model_extra["token_ids"]  # return_token_ids: the generated ids
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert len(choice.logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in choice.logprobs.content)
    prompt = encode_chat(Tokenizer(folder), messages[0]["content"], None)
    model, _ = load(str(folder))
    mx.random.seed(1234)
    steps = generate_step(mx.array(prompt), model, max_tokens=16,
                          sampler=make_sampler(0.7, 0.9), prefill_step_size=32)  # fmt: skip
    want = [int(t) for t, _ in steps]
    assert ids and ids == want[: len(ids)], (ids, want)  # a stop string may end it early
    other = client.chat.completions.create(
        model="smol", messages=messages, max_tokens=16, temperature=0.7, top_p=0.9, seed=99,
    )  # fmt: skip
    assert other.choices[0].message.content != choice.message.content
    assert proc.status()["within_envelope"] is True
