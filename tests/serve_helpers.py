"""Shared by the serve tests: tiny random-weight models with their plans, and a `dctms serve`
subprocess on loopback (port 0: the kernel picks a free one, the server prints it)."""

from __future__ import annotations

import json
import re
import signal
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

    def __init__(self, args: list[str], timeout_s: float = 120.0, preexec_fn=None):
        self.proc = subprocess.Popen(
            dctms_command("serve", *args, "--host", "127.0.0.1", "--port", "0"),
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
