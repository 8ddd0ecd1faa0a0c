"""`dctms serve` safe by default on a developer's laptop (issue 35), over loopback: the API key, the
Host check against DNS rebinding, JSON-only bodies against cross-site posts, the body-size limit,
header and body timeouts, tokenising off the event loop, JSON errors for every status and for
hostile JSON, a clean SIGTERM, and per-rank plans refused at start-up."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_helpers import (
    Reply,
    ServerProcess,
    build_tiny_models,
    dctms_command,
    exchange,
    http_request,
)

from dctms.schema.errors import DctmsError
from dctms.serve.security import (
    API_KEY_ENV,
    allowed_hosts,
    exposure_warning,
    host_allowed,
    resolve_api_key,
)

pytestmark = pytest.mark.slow  # one server process for most of the module

KEY = "k3y-for-the-tests"
MIB = 2**20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_tiny_models(tmp_path_factory.mktemp("serve-security-models"))


@pytest.fixture(scope="module")
def server(models):
    env = dict(os.environ, **{API_KEY_ENV: KEY})  # the key from the environment
    proc = ServerProcess(
        ["--plan", models["alpha"].spec(), "--plan", models["beta"].spec(), "--memory", "1GiB",
         "--allowed-host", "proxy.example"],  # fmt: skip
        env=env,
    )
    yield proc
    proc.close()


def ask(server: ServerProcess, method: str, path: str, body: bytes = b"",
        headers: dict | None = None, host: str = "127.0.0.1", timeout_s: float = 30) -> Reply:
    fields = {"Authorization": f"Bearer {KEY}"}
    if method == "POST":
        fields["Content-Type"] = "application/json"
    fields.update(headers or {})
    return exchange(server.address, http_request(method, path, body, fields, host), timeout_s)


def completion(**fields) -> bytes:
    fields = {"model": "alpha", "prompt": "hi", "max_tokens": 1, **fields}
    return json.dumps(fields, ensure_ascii=False).encode()


def finished(server: ServerProcess) -> int:
    return ask(server, "GET", "/status").json()["requests_finished"]


def assert_error(reply: Reply, status: int, words: str = "") -> dict:
    assert reply.status == status, (reply.status, reply.body[:300])
    assert reply.headers["content-type"].startswith("application/json"), reply.headers
    error = reply.json()["error"]
    assert {"message", "type", "code"} <= set(error)
    assert words in error["message"], error["message"]
    return error


# --------------------------------------------------------------------------- the API key


def test_every_route_needs_the_api_key(server):
    before = finished(server)
    routes = [("GET", "/v1/models", b""), ("GET", "/status", b""), ("GET", "/metrics", b""),
              ("POST", "/v1/completions", completion())]  # fmt: skip
    for method, path, body in routes:
        for auth in (None, "Bearer wrong-key", f"Bearer {KEY}x", f"Basic {KEY}", KEY, "Bearer"):
            reply = ask(server, method, path, body, {"Authorization": auth})
            assert_error(reply, 401, "API key")
            assert reply.headers["www-authenticate"] == "Bearer"
        assert ask(server, method, path, body).status == 200, path
    assert ask(server, "GET", "/v1/models", headers={"Authorization": f"bearer {KEY}"}).status == 200
    assert finished(server) == before + 1  # only the authorised completion ran


def test_the_key_comes_from_the_option_or_the_environment():
    assert resolve_api_key(None, {API_KEY_ENV: "from-env"}) == "from-env"
    assert resolve_api_key("from-arg", {API_KEY_ENV: "from-env"}) == "from-arg"
    assert resolve_api_key(None, {}) is None
    assert resolve_api_key(None, {API_KEY_ENV: ""}) is None  # set but empty: no key
    for bad in ("", "two words", "tab\there", "caf\u00e9"):
        with pytest.raises(DctmsError, match="--api-key"):
            resolve_api_key(bad, {})
    with pytest.raises(DctmsError, match=API_KEY_ENV):
        resolve_api_key(None, {API_KEY_ENV: "new\nline"})


def test_a_server_reachable_from_elsewhere_without_a_key_warns():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert exposure_warning(host, None) is None, host
    for host in ("0.0.0.0", "::", "192.168.1.20", "myhost.lan"):
        assert "without an API key" in exposure_warning(host, None), host
        assert exposure_warning(host, "key") is None


# --------------------------------------------------------------------------- DNS rebinding


@pytest.mark.parametrize(
    "host", ["attacker.example", "attacker.example:{port}", "localhost.attacker.example",
             "127.0.0.1.nip.io", "192.168.1.20", "[::2]", "localhost:{port}@attacker.example",
             "", "local host", "proxy.example.attacker.example"],  # fmt: skip
)
def test_a_foreign_host_header_is_refused(server, host):
    before = finished(server)
    host = host.format(port=server.address[1])
    for method, path, body in [("GET", "/v1/models", b""), ("POST", "/v1/completions", completion())]:
        assert_error(ask(server, method, path, body, host=host), 403, "Host")
    assert finished(server) == before


def test_loopback_names_and_allowed_hosts_are_served(server):
    port = server.address[1]
    for host in ["127.0.0.1", f"127.0.0.1:{port}", "localhost", f"localhost:{port}", "LocalHost",
                 f"[::1]:{port}", "[::1]", "proxy.example", "proxy.example:443", "localhost."]:  # fmt: skip
        assert ask(server, "GET", "/v1/models", host=host).status == 200, host


@pytest.mark.parametrize("name", ["Host", "Authorization", "Content-Type"])
def test_a_repeated_header_is_refused(server, name):
    before = finished(server)
    good = {"Host": "127.0.0.1", "Authorization": f"Bearer {KEY}",
            "Content-Type": "application/json"}[name]  # fmt: skip
    data = http_request("POST", "/v1/completions", completion(), {"Authorization": f"Bearer {KEY}",
                                                                  "Content-Type": "application/json"})
    head, _, body = data.partition(b"\r\n\r\n")
    for extra in (good, "attacker.example" if name == "Host" else "text/plain"):
        repeated = head + f"\r\n{name}: {extra}".encode() + b"\r\n\r\n" + body
        words = "malformed HTTP" if name == "Host" else "repeated"  # h11 refuses two Hosts itself
        assert_error(exchange(server.address, repeated), 400, words)
    assert finished(server) == before


def test_http_1_0_without_a_host_header_is_refused(server):
    data = f"GET /v1/models HTTP/1.0\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()
    assert_error(exchange(server.address, data), 403, "Host")


def test_the_host_rule_is_the_name_without_the_port():
    names = allowed_hosts("0.0.0.0", ["Proxy.Example", "gw.example:8443", "[fd00::1]", "10.0.0.2."])
    assert names == {"127.0.0.1", "localhost", "::1", "0.0.0.0", "proxy.example", "gw.example",
                     "fd00::1", "10.0.0.2"}  # fmt: skip
    assert "::" in allowed_hosts("::", []) and "fd00::2" in allowed_hosts("[fd00::2]", [])
    for bad in ("", " ", "a b", "x:y", "[::1", "[::1]x", ":80"):
        with pytest.raises(DctmsError, match="--allowed-host"):
            allowed_hosts("127.0.0.1", [bad])
    assert host_allowed("proxy.example:8443", names) and host_allowed("[::1]:80", names)
    assert not host_allowed("[::1", names) and not host_allowed("::1", names)
    assert not host_allowed("localhost:80:80", names) and not host_allowed("localhost:x", names)
    assert host_allowed("anything.example", allowed_hosts("127.0.0.1", ["*"]))


# --------------------------------------------------------------------------- cross-site bodies


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
     "multipart/form-data; boundary=x", None, "", "application/jsonx", "application/json-patch",
     "text/plain; application/json"],  # fmt: skip
)
def test_a_body_that_is_not_json_typed_runs_nothing(server, content_type):
    before = finished(server)
    reply = ask(server, "POST", "/v1/completions", completion(), {"Content-Type": content_type})
    assert_error(reply, 415, "application/json")
    assert finished(server) == before


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
def test_json_content_types_with_parameters_are_served(server, content_type):
    reply = ask(server, "POST", "/v1/completions", completion(), {"Content-Type": content_type})
    assert reply.status == 200 and reply.json()["choices"]


def test_a_cors_preflight_gets_no_permission(server):
    reply = ask(server, "OPTIONS", "/v1/completions",
                headers={"Origin": "http://attacker.example",
                         "Access-Control-Request-Method": "POST"})  # fmt: skip
    assert_error(reply, 405)
    assert not any(name.startswith("access-control-") for name in reply.headers)


# --------------------------------------------------------------------------- sizes and timeouts


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    big = completion(prompt="x" * (4 * MIB))
    t0 = time.monotonic()
    assert_error(ask(server, "POST", "/v1/completions", big), 413, "1048576")
    assert time.monotonic() - t0 < 10


def test_a_chunked_body_over_the_limit_is_refused(server):
    piece = b"x" * 65536
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(20)) + b"0\r\n\r\n"
    data = http_request("POST", "/v1/completions", b"", {
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
        "Content-Length": None, "Transfer-Encoding": "chunked"}) + chunks  # fmt: skip
    assert_error(exchange(server.address, data), 413, "1048576")


def test_a_large_prompt_is_tokenised_off_the_event_loop(server):
    """A prompt just under the size limit (about a second of tokenising here) is refused as too
    long; meanwhile /status answers every time in a fraction of that (on the event loop, one poll
    would wait for the whole tokenisation)."""
    body = completion(prompt="é" * (MIB // 2 - 64))
    assert len(body) < MIB
    result: list[tuple[Reply, float]] = []

    def big_request() -> None:
        t0 = time.monotonic()
        reply = ask(server, "POST", "/v1/completions", body)
        result.append((reply, time.monotonic() - t0))

    big = threading.Thread(target=big_request)
    big.start()
    latencies = []
    while big.is_alive():
        t0 = time.monotonic()
        assert ask(server, "GET", "/status").status == 200
        latencies.append(time.monotonic() - t0)
        time.sleep(0.02)
    big.join()
    reply, took = result[0]
    assert_error(reply, 400, "more than the plan bound N = 32")
    assert len(latencies) >= 3, (latencies, took)
    assert max(latencies) < took / 2, (latencies, took)


def _closed_after(address: tuple[str, int], data: bytes, limit_s: float) -> tuple[float, bytes]:
    """Send ``data`` and wait (at most ``limit_s``) for the server to close: (seconds, reply)."""
    t0 = time.monotonic()
    with socket.create_connection(address, timeout=limit_s) as s:
        s.sendall(data)
        received = b""
        while True:
            try:
                chunk = s.recv(4096)
            except TimeoutError:
                return limit_s, received
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
    return time.monotonic() - t0, received


def test_slow_headers_and_slow_bodies_are_cut_off(server):
    host, port = server.address
    half_head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Ty".encode()
    trickled: list[float] = []

    def trickle() -> None:  # one byte of a head every 0.5 s: the deadline is not pushed back
        t0 = time.monotonic()
        with socket.create_connection((host, port), timeout=30) as s:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                for byte in half_head * 10:
                    s.sendall(bytes([byte]))
                    time.sleep(0.5)
                    if time.monotonic() - t0 > 30:
                        break
        trickled.append(time.monotonic() - t0)

    head_only = http_request("POST", "/v1/completions", b"", {
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
        "Content-Length": "100"}) + b'{"model": '  # fmt: skip
    with ThreadPoolExecutor(4) as pool:
        pool.submit(trickle)
        idle = pool.submit(_closed_after, (host, port), b"", 30)
        slow_head = pool.submit(_closed_after, (host, port), half_head, 30)
        slow_body = pool.submit(_closed_after, (host, port), head_only, 30)
        (t_idle, r_idle), (t_head, r_head) = idle.result(), slow_head.result()
        t_body, r_body = slow_body.result()
    assert t_idle < 10 and r_idle == b""
    assert t_head < 10 and r_head == b""
    assert t_body < 20
    assert trickled and trickled[0] < 10, trickled  # a send failed once the server had closed
    from serve_helpers import parse_reply

    assert_error(parse_reply(r_body), 408, "body")


def test_an_oversized_head_is_a_json_error(server):
    data = http_request("GET", "/v1/models", b"", {"Authorization": f"Bearer {KEY}",
                                                   "X-Filler": "y" * 100_000})  # fmt: skip
    assert_error(exchange(server.address, data), 431, "headers exceed")
    # the same head in pieces: h11 stops buffering an incomplete head at 16 KiB
    with socket.create_connection(server.address, timeout=30) as s:
        s.sendall(data[:20_000])
        time.sleep(0.3)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(data[20_000:])
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                received += chunk
    from serve_helpers import parse_reply

    assert_error(parse_reply(received), 400, "malformed HTTP request")


def test_a_malformed_request_line_is_a_json_error(server):
    assert_error(exchange(server.address, b"GARBAGE\r\n\r\n"), 400)


# --------------------------------------------------------------------------- JSON errors


@pytest.mark.parametrize(
    "method, path, status",
    [("GET", "/v1/completions", 405), ("GET", "/v1/chat/completions", 405),
     ("POST", "/v1/embeddings", 404), ("GET", "/nothing/here", 404), ("POST", "/status", 405),
     ("DELETE", "/v1/models", 405), ("PUT", "/metrics", 405)],  # fmt: skip
)
def test_unknown_routes_and_methods_are_json_errors(server, method, path, status):
    body = completion() if method in ("POST", "PUT") else b""
    error = assert_error(ask(server, method, path, body), status)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body",
    [b'{"model": "alpha", "prompt": "\\ud800", "max_tokens": 1}',
     b'{"model": "alpha", "prompt": "a\\udfffb", "max_tokens": 1}',
     b'{"model": "alpha", "prompt": "hi", "max_tokens": 1, "\\ud800": 1}',
     b'{"model": "\\udc00", "prompt": "hi"}'],  # fmt: skip
)
def test_a_lone_surrogate_in_a_completion_is_400(server, body):
    assert_error(ask(server, "POST", "/v1/completions", body), 400, "surrogate")


def test_a_lone_surrogate_in_a_chat_message_is_400(server):
    body = b'{"model": "beta", "messages": [{"role": "user", "content": "x\\ud800"}], "max_tokens": 1}'
    assert_error(ask(server, "POST", "/v1/chat/completions", body), 400, "surrogate")
    body = b'{"model": "alpha", "messages": [{"role": "\\ud800", "content": "x"}], "max_tokens": 1}'
    assert_error(ask(server, "POST", "/v1/chat/completions", body), 400, "surrogate")


def test_a_surrogate_pair_is_a_character(server):
    body = b'{"model": "alpha", "prompt": "smile \\ud83d\\ude00", "max_tokens": 1}'
    assert ask(server, "POST", "/v1/completions", body).status == 200


@pytest.mark.parametrize("depth", [65, 1000, 50_000, 100_000])
def test_deeply_nested_json_is_400(server, depth):
    bodies = [
        b"[" * depth + b"]" * depth,
        b'{"model": "alpha", "prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}",
        b'{"model": "alpha", "messages": [{"role": "user", "content": [{"type": "text", "text": '
        + b'{"a": ' * depth + b"1" + b"}" * depth + b"}]}]}",
    ]
    for body in bodies:
        if len(body) < MIB:
            path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
            assert_error(ask(server, "POST", path, body), 400, "nested")


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_json_number_constants_are_400(server, constant):
    body = b'{"model": "alpha", "prompt": "hi", "max_tokens": ' + constant + b"}"
    assert_error(ask(server, "POST", "/v1/completions", body), 400, "JSON")


def test_a_body_that_is_not_utf8_is_400(server):
    body = b'{"model": "alpha", "prompt": "\xff\xfe"}'
    assert_error(ask(server, "POST", "/v1/completions", body), 400, "JSON")


def test_a_client_closing_mid_body_leaves_no_traceback(server):
    data = http_request("POST", "/v1/completions", b"", {
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
        "Content-Length": "5000"}) + b'{"model": "alpha", "prompt": "'  # fmt: skip
    for _ in range(3):
        with socket.create_connection(server.address, timeout=10) as s:
            s.sendall(data)
            time.sleep(0.2)
    time.sleep(0.5)
    assert ask(server, "GET", "/status").status == 200


def test_the_log_has_no_traceback(server):
    """Last in the module: after every hostile request above, the server logged no traceback."""
    assert ask(server, "GET", "/status").status == 200
    log = server.stderr()
    for word in ("Traceback", "ClientDisconnect", "Exception in ASGI", "RecursionError"):
        assert word not in log, log[-3000:]


# --------------------------------------------------------------------------- start-up options


@pytest.mark.parametrize(
    "extra, words",
    [(["--api-key", ""], "--api-key"), (["--max-body-bytes", "0"], "--max-body-bytes"),
     (["--max-body-bytes", "lots"], "--max-body-bytes"), (["--allowed-host", ""], "--allowed-host"),
     (["--allowed-host", "a b"], "--allowed-host")],  # fmt: skip
)
def test_bad_security_options_are_one_line(models, extra, words):
    cmd = dctms_command("serve", "--plan", models["alpha"].spec(), "--port", "0", *extra)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr


def test_a_rank_plan_is_refused_at_start_up(models, tmp_path):
    alpha = models["alpha"]
    ranks = tmp_path / "ranks"
    out = subprocess.run(
        dctms_command("compile", str(alpha.folder), "-N", "8", "-M", "4", "-q", "--ranks", "2",
                      "--parallel", "pipeline", "-o", str(ranks)),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    cmd = dctms_command("serve", "--plan", f"{ranks / 'rank0.plan'}={alpha.folder}", "--port", "0")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "rank 0 of 2" in lines[0], proc.stderr


# --------------------------------------------------------------------------- SIGTERM


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """A tiny model whose plan allows long generations (M = 4096), so a stream is still running
    when the signal comes."""
    from conftest import TINY_QWEN2
    from serve_helpers import TinyServed

    from dctms.schema.io import write_plan
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions, compile_plan
    from dctms.toolkit.tiny_model import write_tiny_model

    folder = tmp_path_factory.mktemp("serve-long") / "long"
    write_tiny_model(folder, dict(TINY_QWEN2, eos_token_id=None), seed=3)
    plan = compile_plan(open_model(folder), CompileOptions(16, 4096, prefill_chunk=16))
    write_plan(plan, folder / "long.plan")
    return TinyServed("long", folder / "long.plan", folder, 16, 4096)


def test_sigterm_ends_streams_with_an_error_event_and_queued_requests_with_503(long_model):
    proc = ServerProcess(["--plan", long_model.spec(), "--memory", "1GiB"])
    address = proc.address
    stream_body = json.dumps({"model": "long", "prompt": "go", "max_tokens": 4096,
                              "stream": True}).encode()  # fmt: skip
    queued_body = json.dumps({"model": "long", "prompt": "wait", "max_tokens": 4}).encode()
    json_type = {"Content-Type": "application/json"}
    try:
        with socket.create_connection(address, timeout=60) as s, ThreadPoolExecutor(3) as pool, \
                socket.create_connection(address, timeout=60) as uploading:
            # a body still on its way when the signal comes
            uploading.sendall(http_request("POST", "/v1/completions", b"", {
                **json_type, "Content-Length": "100"}) + b'{"model": "long", ')  # fmt: skip
            s.sendall(http_request("POST", "/v1/completions", stream_body, json_type))
            first = s.recv(4096)
            assert b"200 OK" in first, first
            queued = [
                pool.submit(exchange, address,
                            http_request("POST", "/v1/completions", queued_body, json_type), 60)
                for _ in range(3)
            ]  # fmt: skip
            deadline = time.monotonic() + 30
            while proc.status()["queue_waiting"] < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert proc.status()["queue_running"] == 1  # the stream is still generating
            proc.proc.send_signal(signal.SIGTERM)
            rest = first
            while chunk := s.recv(65536):
                rest += chunk
            replies = [f.result() for f in queued]
            upload = b""
            while chunk := uploading.recv(65536):
                upload += chunk
        rc = proc.proc.wait(30)
    finally:
        proc.close()
    from serve_helpers import parse_reply

    for reply in [*replies, parse_reply(upload)]:
        assert_error(reply, 503, "shutting down")
    stream = Reply(200, {}, rest.partition(b"\r\n\r\n")[2])
    events = [e for e in _sse_data(stream.body) if e != "[DONE]"]
    assert "error" in json.loads(events[-1]), events[-3:]
    assert "shutting down" in json.loads(events[-1])["error"]["message"]
    assert rc == 0
    log = proc.stderr()
    for word in ("Traceback", "CancelledError", "graceful shutdown exceeded", "ERROR"):
        assert word not in log, log[-3000:]
    assert log.rstrip().endswith("dctms serve: stopped")


def _sse_data(chunked: bytes) -> list[str]:
    """The data lines of a chunked event stream (chunk framing left in place: events are
    whole lines within one chunk)."""
    return [
        line.removeprefix(b"data: ").decode()
        for line in chunked.split(b"\n")
        if line.startswith(b"data: ")
    ]
