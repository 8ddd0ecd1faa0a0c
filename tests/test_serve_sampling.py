"""`dctms serve` with a plan compiled with --sampling, through the real `openai` client on loopback.

The seeded ids a request gets equal `dctms run`'s with the same settings (which the runner tests
hold equal to mlx-lm's); logprobs come back in OpenAI's chat and completions formats; a greedy-only
plan refuses sampling fields with a 400 naming the recompile flag; bad values are 400s naming
the field.
"""

from __future__ import annotations

import json
import subprocess

import pytest

openai = pytest.importorskip("openai")
from conftest import TINY_QWEN2  # noqa: E402
from serve_helpers import ServerProcess, dctms_command  # noqa: E402

pytestmark = pytest.mark.slow  # one server process for the module

N, M = 32, 8
PROMPT = "the memory is known"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from dctms.schema.io import write_plan
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions, compile_plan
    from dctms.toolkit.tiny_model import write_tiny_model

    root = tmp_path_factory.mktemp("serve-sampling")
    write_tiny_model(root, dict(TINY_QWEN2), seed=3)
    for name, sampling in (("sampled", True), ("greedy", False)):
        opts = CompileOptions(N, M, prefill_chunk=16, sampling=sampling)
        write_plan(compile_plan(open_model(root), opts), root / f"{name}.plan")
    return root


@pytest.fixture(scope="module")
def server(folder):
    specs = [f"{name}={folder / f'{name}.plan'}={folder}" for name in ("sampled", "greedy")]
    proc = ServerProcess(["--plan", specs[0], "--plan", specs[1], "--memory", "1GiB"])
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def run_ids(folder, tmp_path, *flags: str) -> list[int]:
    report = tmp_path / "r.json"
    cmd = dctms_command(
        "run", str(folder / "sampled.plan"), "--model", str(folder), "--prompt", PROMPT,
        "--ignore-chat-template", "--max-tokens", str(M), "--report", str(report), *flags,
    )  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(report.read_text())["tokens"]


def test_seeded_completion_equals_dctms_run(client, folder, tmp_path):
    got = client.completions.create(
        model="sampled", prompt=PROMPT, max_tokens=M, temperature=0.7, top_p=0.9, seed=5,
        extra_body={"top_k": 50, "repetition_penalty": 1.1, "return_token_ids": True},
    )  # fmt: skip
    ids = got.choices[0].model_extra["token_ids"]
    flags = ["--temp", "0.7", "--top-p", "0.9", "--seed", "5", "--top-k", "50"]
    assert ids == run_ids(folder, tmp_path, *flags, "--repetition-penalty", "1.1")
    other = client.completions.create(
        model="sampled", prompt=PROMPT, max_tokens=M, temperature=0.7, top_p=0.9, seed=6,
        extra_body={"top_k": 50, "repetition_penalty": 1.1, "return_token_ids": True},
    )  # fmt: skip
    assert other.choices[0].model_extra["token_ids"] != ids


def test_chat_logprobs_in_openais_format(client):
    got = client.chat.completions.create(
        model="sampled", messages=[{"role": "user", "content": PROMPT}], max_tokens=M,
        temperature=0.7, seed=1, logprobs=True, top_logprobs=3,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = got.choices[0]
    content = choice.logprobs.content
    ids = [t for t in choice.model_extra["token_ids"] if t != TINY_QWEN2["eos_token_id"]]
    assert len(content) == len(ids) > 0
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and entry.logprob <= values[0] <= 0
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_completion_logprobs_in_openais_format(client):
    got = client.completions.create(
        model="sampled", prompt=PROMPT, max_tokens=M, logprobs=2, seed=2, temperature=1.0
    )
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == got.choices[0].text


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_logprobs_add_up_to_the_whole_answers(client, chat):
    """Each streamed chunk carries the log-probabilities of the tokens its text came from; over
    the stream they are the unstreamed answer's, with the same seed (completions' text offsets
    continue across chunks)."""
    kwargs = dict(model="sampled", max_tokens=M, temperature=0.7, seed=3)
    if chat:
        ask = dict(messages=[{"role": "user", "content": PROMPT}], logprobs=True, top_logprobs=2)
        whole = client.chat.completions.create(**kwargs, **ask).choices[0]
        chunks = [c for c in client.chat.completions.create(**kwargs, **ask, stream=True)
                  if c.choices]  # fmt: skip
        streamed = [e for c in chunks if c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content]  # fmt: skip
        assert [(e.token, e.logprob) for e in streamed] == [
            (e.token, e.logprob) for e in whole.logprobs.content
        ]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    else:
        whole = client.completions.create(**kwargs, prompt=PROMPT, logprobs=2).choices[0]
        chunks = list(client.completions.create(**kwargs, prompt=PROMPT, logprobs=2, stream=True))
        lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        assert [t for lp in lps for t in lp.tokens] == whole.logprobs.tokens
        assert [v for lp in lps for v in lp.token_logprobs] == whole.logprobs.token_logprobs
        assert [o for lp in lps for o in lp.text_offset] == whole.logprobs.text_offset
    assert len(streamed if chat else lps) > 0


def test_greedy_plan_refuses_sampling_naming_the_flag(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="greedy", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            temperature=0.7, top_p=0.9,
        )  # fmt: skip
    assert "--sampling" in str(err.value) and "temperature" in str(err.value)
    ok = client.completions.create(model="greedy", prompt="hi", max_tokens=2, temperature=0)
    assert ok.choices


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"top_k": -1}, "top_k"),
        ({"temperature": "hot"}, "temperature"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"repetition_context_size": 10**6}, "repetition_context_size"),
    ],
)
def test_bad_sampling_fields_are_400_naming_the_field(server, extra, field):
    import urllib.error
    import urllib.request

    body = {"model": "sampled", "prompt": PROMPT, "max_tokens": 2, **extra}
    req = urllib.request.Request(
        server.url + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert err.value.code == 400
    error = json.loads(err.value.read())["error"]
    assert error["param"] == field, error
