"""`dctms serve` against the real `openai` client on loopback: two tiny models in one pool."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

# In the test extra; a venv set up before it was added skips here instead of failing to collect
# every other test (`make setup` installs it).
openai = pytest.importorskip("openai")
from serve_helpers import (  # noqa: E402
    ServerProcess,
    build_tiny_models,
    dctms_command,
    run_tokens,
    two_token_stop,
)

from dctms.runner.tokenize import Tokenizer  # noqa: E402

pytestmark = pytest.mark.slow  # one server process for the module: ~10 s in all


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_tiny_models(tmp_path_factory.mktemp("serve-models"))


@pytest.fixture(scope="module")
def server(models):
    proc = ServerProcess(
        ["--plan", models["alpha"].spec(), "--plan", models["beta"].spec(), "--memory", "1GiB"]
    )
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _post(url: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_models_lists_both_plans_with_their_bounds(client):
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {"alpha", "beta"}
    assert listed["alpha"].model_extra["max_prompt_tokens"] == 32
    assert listed["beta"].model_extra["max_output_tokens"] == 12


def test_completion_equals_dctms_run_for_each_model(client, models, tmp_path):
    prompt = "the memory is known"
    for name in ("alpha", "beta"):
        served = models[name]
        want = run_tokens(served, prompt, served.m, tmp_path / f"{name}.json")
        got = client.completions.create(
            model=name, prompt=prompt, max_tokens=served.m, extra_body={"return_token_ids": True}
        )
        choice = got.choices[0]
        assert choice.model_extra["token_ids"] == want, name
        assert got.usage.completion_tokens == len(want)
        assert got.usage.prompt_tokens == len(prompt.encode())  # byte-level tokenizer
        assert choice.finish_reason in ("stop", "length")
    # the two models really are different plans
    a = client.completions.create(model="alpha", prompt=prompt, max_tokens=8)
    b = client.completions.create(model="beta", prompt=prompt, max_tokens=8)
    assert a.choices[0].text != b.choices[0].text


def test_chat_equals_dctms_run_through_the_chat_template(client, models, tmp_path):
    served = models["beta"]  # its tokenizer has a chat template
    question = "how much memory?"
    want = run_tokens(served, question, served.m, tmp_path / "chat.json", chat=True)
    got = client.chat.completions.create(
        model="beta", messages=[{"role": "user", "content": question}], max_tokens=served.m,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert got.choices[0].model_extra["token_ids"] == want
    assert got.choices[0].message.role == "assistant"
    templated = f"user: {question}\nassistant:"
    assert got.usage.prompt_tokens == len(templated.encode())
    raw = run_tokens(served, question, served.m, tmp_path / "raw.json")
    assert raw != want  # the template really changed the prompt


def test_chat_without_a_template_is_the_plain_contents(client):
    chat = client.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "plain words"}], max_tokens=6
    )
    plain = client.completions.create(model="alpha", prompt="plain words", max_tokens=6)
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens


def test_chat_streaming_adds_up_and_starts_with_the_role(client):
    messages = [{"role": "system", "content": "short"}, {"role": "user", "content": "go"}]
    whole = client.chat.completions.create(model="beta", messages=messages, max_tokens=10)
    deltas = list(
        client.chat.completions.create(
            model="beta", messages=messages, max_tokens=10, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert deltas[0].choices[0].delta.role == "assistant"
    text = "".join(d.choices[0].delta.content or "" for d in deltas if d.choices)
    assert text == whole.choices[0].message.content
    finishes = [d.choices[0].finish_reason for d in deltas if d.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert deltas[-1].choices == [] and deltas[-1].usage.total_tokens == whole.usage.total_tokens


def test_chat_over_n_is_refused_naming_the_bound(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="beta", messages=[{"role": "user", "content": "y" * 48}], max_tokens=2
        )
    assert "N = 48" in str(err.value)


def test_streaming_pieces_add_up_to_the_whole_completion(client):
    whole = client.completions.create(model="beta", prompt="stream me", max_tokens=10)
    pieces, finishes = [], []
    for chunk in client.completions.create(
        model="beta", prompt="stream me", max_tokens=10, stream=True
    ):
        for choice in chunk.choices:
            pieces.append(choice.text)
            finishes.append(choice.finish_reason)
    assert "".join(pieces) == whole.choices[0].text
    assert finishes[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    assert len(pieces) >= 2


def test_prompt_as_token_ids(client):
    by_text = client.completions.create(model="alpha", prompt="abc", max_tokens=5)
    by_ids = client.completions.create(model="alpha", prompt=[97, 98, 99], max_tokens=5)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_prompt_over_n_is_refused_naming_the_bound(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="alpha", prompt="x" * 33, max_tokens=4)
    assert "N = 32" in str(err.value) and "33 tokens" in str(err.value)
    # the same prompt fits beta's plan (N = 48)
    assert client.completions.create(model="beta", prompt="x" * 33, max_tokens=2).choices


def test_max_tokens_over_m_is_refused_naming_the_bound(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="alpha", prompt="hi", max_tokens=9)
    assert "M = 8" in str(err.value)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gamma", prompt="hi", max_tokens=2)
    assert "gamma" in str(err.value) and "alpha" in str(err.value)


def test_sampling_is_refused_rather_than_ignored(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="alpha", prompt="hi", max_tokens=2, temperature=0.7)
    assert "'temperature'" in str(err.value) and "--sampling" in str(err.value)
    ok = client.completions.create(model="alpha", prompt="hi", max_tokens=2, temperature=0)
    assert ok.choices


def test_stop_ends_completions_streamed_or_not_before_a_string_spanning_tokens(client, models):
    served, prompt = models["beta"], "stream me"
    whole = client.completions.create(
        model="beta", prompt=prompt, max_tokens=served.m, extra_body={"return_token_ids": True}
    )
    ids, text = whole.choices[0].model_extra["token_ids"], whole.choices[0].text
    assert len(ids) == served.m and whole.choices[0].finish_reason == "length"
    stop, last = two_token_stop(Tokenizer(served.folder), ids)
    want = text[: text.find(stop)]
    got = client.completions.create(
        model="beta", prompt=prompt, max_tokens=served.m, stop=["never!", stop],
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = got.choices[0]
    assert (choice.text, choice.finish_reason) == (want, "stop")
    assert choice.model_extra["token_ids"] == ids[: last + 1]  # ended at the stop's last token
    assert got.usage.completion_tokens == last + 1
    pieces, finishes = [], []
    for chunk in client.completions.create(
        model="beta", prompt=prompt, max_tokens=served.m, stop=stop, stream=True
    ):
        for c in chunk.choices:
            pieces.append(c.text)
            finishes.append(c.finish_reason)
    assert "".join(pieces) == want and finishes[-1] == "stop"
    # a stop string that never comes: the held-back tails are all released
    never = client.completions.create(model="beta", prompt=prompt, max_tokens=served.m,
                                      stop=text[-1] + "never")  # fmt: skip
    assert never.choices[0].text == text and never.choices[0].finish_reason == "length"


def test_stop_in_chat_streamed_equals_unstreamed(client, models):
    served = models["beta"]
    messages = [{"role": "user", "content": "stop here"}]
    whole = client.chat.completions.create(
        model="beta", messages=messages, max_tokens=served.m, extra_body={"return_token_ids": True}
    )
    ids = whole.choices[0].model_extra["token_ids"]
    stop, last = two_token_stop(Tokenizer(served.folder), ids)
    content = whole.choices[0].message.content
    got = client.chat.completions.create(model="beta", messages=messages, max_tokens=served.m,
                                         stop=stop)  # fmt: skip
    assert got.choices[0].message.content == content[: content.find(stop)]
    assert got.choices[0].finish_reason == "stop"
    deltas = list(client.chat.completions.create(
        model="beta", messages=messages, max_tokens=served.m, stop=stop, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    streamed = "".join(d.choices[0].delta.content or "" for d in deltas if d.choices)
    assert streamed == got.choices[0].message.content
    assert [d.choices[0].finish_reason for d in deltas if d.choices][-1] == "stop"
    assert deltas[-1].usage.completion_tokens == got.usage.completion_tokens == last + 1


def test_the_usual_greedy_fields_of_the_openai_client_are_answered(client):
    got = client.chat.completions.create(
        model="beta", messages=[{"role": "user", "content": "usual"}], max_completion_tokens=6,
        temperature=0, top_p=1, n=1, stop=["\n\n"], user="someone", stream=False,
        presence_penalty=0, frequency_penalty=0, metadata={"team": "memory"},
        response_format={"type": "text"}, store=False, service_tier="auto",
        parallel_tool_calls=False,
    )  # fmt: skip
    assert got.choices[0].finish_reason in ("stop", "length") and got.usage.completion_tokens <= 6
    for extra in ({"tools": [{"type": "function", "function": {"name": "f"}}]}, {"n": 2}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="beta", messages=[{"role": "user", "content": "x"}], **extra
            )
        assert repr(next(iter(extra))) in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:  # a misspelt field is not ignored
        client.completions.create(model="alpha", prompt="x", extra_body={"max_token": 3})
    assert "'max_token'" in str(err.value)


@pytest.mark.parametrize(
    "data, status, words",
    [
        (b"{not json", 400, "malformed JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"prompt": "hi"}', 400, "'model'"),
        (b'{"model": "alpha", "prompt": ""}', 400, "empty"),
        (b'{"model": "alpha", "prompt": "hi", "max_tokens": 0}', 400, "positive"),
        (b'{"model": "alpha", "prompt": [1, 999999]}', 400, "vocabulary"),
        (b'{"model": "alpha", "prompt": ["a", "b"]}', 400, "batches"),
        (b'{"model": "alpha", "prompt": "hi", "stream": "yes"}', 400, "stream"),
    ],
)
def test_bad_requests_get_a_json_error(server, data, status, words):
    code, body = _post(server.url + "/v1/completions", data)
    assert code == status
    assert words in body["error"]["message"]


def test_client_that_disconnects_mid_stream_does_not_wedge_the_server(server, client):
    before = server.status()["clients_disconnected"]
    body = json.dumps({"model": "beta", "prompt": "go away", "max_tokens": 12, "stream": True})
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        assert b"200 OK" in s.recv(200)  # the stream began; now vanish
    deadline = time.monotonic() + 30
    while server.status()["clients_disconnected"] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.status()["clients_disconnected"] == before + 1
    # the next request is served normally
    assert client.completions.create(model="alpha", prompt="still here", max_tokens=3).choices
    st = server.status()
    assert st["queue_waiting"] == 0 and st["queue_running"] == 0


def test_status_and_metrics_report_the_envelope_and_the_peak(server, client):
    client.completions.create(model="alpha", prompt="measure", max_tokens=8)
    st = server.status()
    env = st["envelope"]
    a, b = (p for p in env["plans"])
    # the pool composition: held bytes summed, one shared arena (the largest)
    assert env["provable"] == a["held"] + b["held"] + max(a["intermediate"], b["intermediate"])
    assert st["envelope_provable_bytes"] == env["provable"]
    assert 0 < st["observed_mlx_peak_bytes"] <= env["provable"]
    assert st["within_envelope"] is True
    # runtime: one process baseline (it was measured with a chat template loaded, so beta's
    # transformers is inside it), plus the server's stack, once
    extras = {e["what"].split(" (")[0]: e["bytes"] for e in env["runtime_extras"]}
    assert set(extras) == {"HTTP server stack"}
    assert env["runtime"] == max(a["runtime"], b["runtime"]) + sum(extras.values())
    assert env["total"] == env["provable"] + env["runtime"]
    assert st["rss_within_envelope_total"] is True, (st["rss_bytes"], env["total"])
    # the peak since the server started (weights loaded, a request run) beside the current RSS
    assert st["rss_peak_bytes"] >= st["rss_bytes"] > 0
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    assert f"dctms_envelope_provable_bytes {env['provable']}" in text
    rss = {k: int(v) for k, _, v in (line.partition(" ") for line in text.splitlines())
           if k in ("dctms_rss_bytes", "dctms_rss_peak_bytes")}  # fmt: skip
    assert rss["dctms_rss_peak_bytes"] >= rss["dctms_rss_bytes"] > 0
    assert "dctms_observed_mlx_peak_bytes " in text and "dctms_queue_waiting " in text


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_stops_the_server_cleanly(models, sig):
    proc = ServerProcess(["--plan", models["alpha"].spec(), "--memory", "1GiB"])
    try:
        assert openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0).models.list()
        rc = proc.interrupt(sig)
    finally:
        proc.close()
    assert rc == 0, proc.stderr()
    assert "Traceback" not in proc.stderr()
    assert proc.stderr().rstrip().endswith("dctms serve: stopped")


def test_a_pool_over_memory_refuses_to_start(models):
    cmd = dctms_command(
        "serve", "--plan", models["alpha"].spec(), "--plan", models["beta"].spec(),
        "--memory", "10MiB", "--port", "0",
    )  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "more than the 10.00 MiB budget" in lines[0]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--plan", "nothing-here.plan=/tmp"], "nothing-here.plan"),
        (["--plan", "a=b=c=d"], "expected PLAN=MODEL_DIR"),
        (["--plan", "x.plan"], "expected PLAN=MODEL_DIR"),
    ],
)
def test_bad_serve_arguments_are_one_line(args, words):
    proc = subprocess.run(dctms_command("serve", *args), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr


def test_wrong_weights_for_a_plan_refuse_to_start(models):
    mixed = f"alpha={models['alpha'].plan}={models['beta'].folder}"
    proc = subprocess.run(
        dctms_command("serve", "--plan", mixed, "--port", "0"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "differs" in proc.stderr


def test_a_full_queue_refuses_with_503_and_serves_the_rest(models):
    from concurrent.futures import ThreadPoolExecutor

    proc = ServerProcess(["--plan", models["beta"].spec(), "--memory", "1GiB", "--max-queue", "1"])
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0, timeout=60)

        def ask(k: int) -> str:
            try:
                client.completions.create(model="beta", prompt=f"queue {k}", max_tokens=12)
                return "answered"
            except openai.APIStatusError as err:
                assert "server busy" in str(err)
                return str(err.status_code)

        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(ask, range(16)))
        assert set(outcomes) <= {"answered", "503"}
        assert "503" in outcomes and outcomes.count("answered") >= 2
        st = proc.status()
        assert st["requests_refused"] == outcomes.count("503")
        assert st["queue_waiting"] == 0 and st["queue_limit"] == 1
    finally:
        proc.close()


def test_ctrl_c_with_streams_running_and_requests_queued_still_stops(models):
    import threading

    proc = ServerProcess(["--plan", models["beta"].spec(), "--memory", "1GiB"])
    started = threading.Event()
    outcomes: list[str] = []

    def stream() -> None:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0, timeout=60)
        try:
            for _ in client.completions.create(
                model="beta", prompt="long", max_tokens=12, stream=True
            ):
                started.set()
            outcomes.append("finished")
        except Exception as err:  # cut off by the shutdown: an error, never a hang
            outcomes.append(type(err).__name__)

    threads = [threading.Thread(target=stream) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        assert started.wait(60)
        t0 = time.monotonic()
        rc = proc.interrupt()
        took = time.monotonic() - t0
    finally:
        proc.close()
    for t in threads:
        t.join(60)
    assert rc == 0, proc.stderr()
    assert took < 20 and "Traceback" not in proc.stderr()
    assert len(outcomes) == 4 and not any(t.is_alive() for t in threads)


def test_a_queued_request_whose_client_left_is_withdrawn(server, client):
    from concurrent.futures import ThreadPoolExecutor

    before = server.status()["clients_disconnected"]
    body = json.dumps({"model": "beta", "prompt": "never mind", "max_tokens": 12})
    host, port = server.url.removeprefix("http://").split(":")
    with ThreadPoolExecutor(4) as pool:  # keep the worker busy so the next request queues
        busy = [
            pool.submit(client.completions.create, model="beta", prompt=f"busy {k}", max_tokens=12)
            for k in range(4)
        ]
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                f"\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
            )  # and gone before the answer
        assert all(f.result().choices for f in busy)
    deadline = time.monotonic() + 30
    while server.status()["clients_disconnected"] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    st = server.status()
    assert st["clients_disconnected"] == before + 1
    assert st["queue_waiting"] == 0 and st["queue_running"] == 0
