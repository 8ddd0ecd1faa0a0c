"""Shared by the serve tests: tiny random-weight models with their plans, and a `dctms serve`
subprocess on loopback (port 0: the kernel picks a free one, the server prints it)."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from conftest import TINY_QWEN2

# Two models that differ in weights and bounds, so a request reaching the wrong plan shows.
TINY_MODELS = {
    "alpha": (dict(TINY_QWEN2), 0, 32, 8),  # config, seed, N, M
    "beta": (dict(TINY_QWEN2, num_hidden_layers=1, intermediate_size=96), 1, 48, 12),
}
# beta's tokenizer has a chat template (alpha's has none: its chat prompts are the plain contents).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass(frozen=True)
class TinyServed:
    name: str
    plan: Path
    folder: Path
    n: int
    m: int

    def spec(self) -> str:
        return f"{self.name}={self.plan}={self.folder}"


def build_tiny_models(root: Path) -> dict[str, TinyServed]:
    from dctms.schema.io import write_plan
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions, compile_plan
    from dctms.toolkit.tiny_model import write_tiny_model

    out = {}
    for name, (config, seed, n, m) in TINY_MODELS.items():
        folder = root / name
        write_tiny_model(folder, config, seed=seed)
        if name == "beta":
            (folder / "tokenizer_config.json").write_text(json.dumps({
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
            }))  # fmt: skip
        plan = compile_plan(open_model(folder), CompileOptions(n, m, prefill_chunk=16))
        write_plan(plan, folder / f"{name}.plan")
        out[name] = TinyServed(name, folder / f"{name}.plan", folder, n, m)
    return out


def dctms_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "dctms.cli.main", *args]


class ServerProcess:
    """``dctms serve ... --port 0`` in a subprocess; ``url`` once it listens."""

    def __init__(
        self, args: list[str], timeout_s: float = 120.0, env: dict | None = None, preexec_fn=None
    ):
        self.proc = subprocess.Popen(
            dctms_command("serve", *args, "--host", "127.0.0.1", "--port", "0"),
            env=env,
            preexec_fn=preexec_fn,  # e.g. joining a memory cgroup before exec
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._listening = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not self._listening.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("server did not start:\n" + self.stderr())

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            if m:
                self.url = m.group(1)
                self._listening.set()

    def stderr(self) -> str:
        return "".join(self.lines)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)

    def status(self) -> dict:
        import urllib.request

        with urllib.request.urlopen(self.url + "/status", timeout=30) as r:
            return json.loads(r.read())

    def interrupt(self, sig: int = signal.SIGINT, timeout_s: float = 30.0) -> int:
        """Ctrl-C (SIGINT, or ``sig``) and wait for the process to end; its exit status."""
        self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_tokens(
    served: TinyServed, prompt: str, max_tokens: int, report: Path, chat: bool = False
) -> list[int]:
    """What `dctms run` generates for ``prompt`` (greedy, stops at end-of-sequence): as raw text
    (what /v1/completions feeds), or with ``chat`` as one user message through the chat template
    (what /v1/chat/completions feeds)."""
    cmd = dctms_command(
        "run", str(served.plan), "--model", str(served.folder), "--prompt", prompt,
        "--max-tokens", str(max_tokens), "--report", str(report),
        *([] if chat else ["--ignore-chat-template"]),
    )  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(report.read_text())["tokens"]


def two_token_stop(tokenizer, tokens: list[int]) -> tuple[str, int]:
    """A stop string of two generated tokens' text, first found where they were generated (not
    at the start): the string and the index of its second token."""
    for k in range(1, len(tokens) - 1):
        pair = tokenizer.decode(tokens[k : k + 2])
        if "\ufffd" in pair or len(pair) < 2:
            continue
        whole = tokenizer.decode(tokens[: k + 2])
        if whole.find(pair) == len(whole) - len(pair):
            return pair, k + 1
    raise AssertionError(f"no two printable tokens in {tokens}")


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)

    def events(self) -> list[str]:
        """A server-sent event stream's data lines."""
        lines = self.body.decode().splitlines()
        return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def metric_series(url: str) -> dict[str, float]:
    """The server's /metrics as {series with its labels: value}."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {
        key: float(value)
        for key, value in (line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
    }


def http_request(
    method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
    host: str = "127.0.0.1",
) -> bytes:
    """The bytes of one HTTP/1.1 request that asks the server to close the connection after it."""
    fields = {"Host": host, "Connection": "close"}
    if body or method == "POST":
        fields["Content-Length"] = str(len(body))
    fields.update(headers or {})
    head = "".join(f"{k}: {v}\r\n" for k, v in fields.items() if v is not None)
    return f"{method} {path} HTTP/1.1\r\n{head}\r\n".encode("utf-8", "surrogateescape") + body


def exchange(address: tuple[str, int], data: bytes, timeout_s: float = 30.0) -> Reply:
    """Send ``data`` on a fresh connection and read the reply until the server closes it; a reply
    not complete within ``timeout_s`` raises ``TimeoutError``. (A HEAD's reply has no body.)"""
    deadline = time.monotonic() + timeout_s
    with socket.create_connection(address, timeout=timeout_s) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered (and closed) before it read everything: read that answer
        chunks = []
        while True:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                raise TimeoutError(f"no complete reply within {timeout_s} s") from None
            if not chunk:
                break
            chunks.append(chunk)
    return parse_reply(b"".join(chunks), no_body=data[:5].upper() == b"HEAD ")


def parse_reply(raw: bytes, no_body: bool = False) -> Reply:
    while raw.startswith(b"HTTP/1.1 1"):  # an interim 1xx (100 Continue): the reply follows
        raw = raw.partition(b"\r\n\r\n")[2]
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        raise ValueError(f"no complete HTTP reply: {raw[:200]!r}")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if no_body:  # the answer to a HEAD
        body = b""
    elif headers.get("transfer-encoding") == "chunked":
        body = _unchunk(body)
    elif "content-length" in headers:
        length = int(headers["content-length"])
        if len(body) < length:
            raise ValueError(f"a reply cut short: {len(body)} of {length} body bytes")
        body = body[:length]
    return Reply(status, headers, body)


def _unchunk(data: bytes) -> bytes:
    out, pos = [], 0
    while True:
        end = data.index(b"\r\n", pos)
        size = int(data[pos:end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(data[end + 2 : end + 2 + size])
        pos = end + 2 + size + 2
