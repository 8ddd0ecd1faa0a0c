"""Chat like mlx-lm: the tokenizer's chat template, a system prompt, the raw-text escape hatch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_QWEN2

from dctms.runner.tokenize import Tokenizer, encode_chat
from dctms.toolkit.tiny_model import write_tiny_model

TEMPLATE = (
    "{% for m in messages %}{{ '<|endoftext|>' if loop.first else '' }}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# The runner tests' tiny qwen2, with room for a chat prompt.
CONFIG = {**TINY_QWEN2, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory) -> Path:
    folder = write_tiny_model(tmp_path_factory.mktemp("chat") / "m", CONFIG)
    (folder / "tokenizer_config.json").write_text(
        json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|endoftext|>",
            "chat_template": TEMPLATE,
        })
    )
    return folder


def mlx_lm_chat_ids(folder: Path, prompt: str, system: str | None) -> list[int]:
    """What mlx_lm.generate's main() feeds the model for --prompt (and --system-prompt)."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(folder)
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": prompt})
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_encode_chat_equals_mlx_lm(chat_folder: Path, system: str | None) -> None:
    tok = Tokenizer(chat_folder)
    assert tok.has_chat_template
    ids = encode_chat(tok, "What is 2+2?", system)
    assert ids == mlx_lm_chat_ids(chat_folder, "What is 2+2?", system)
    assert ids[0] == 256  # the template's special token, encoded as one id
    text = tok.decode(ids)
    assert "user: What is 2+2?\nassistant:" in text
    assert ("system: Be brief." in text) is (system is not None)


def test_without_a_template_the_text_is_encoded_plainly(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "m", CONFIG)
    tok = Tokenizer(folder)
    assert not tok.has_chat_template
    assert encode_chat(tok, "hi there") == tok.encode("hi there") == list(b"hi there")


def test_a_failing_template_is_one_line(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "m", CONFIG)
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ raise_exception('no system role') }}"})
    )
    from dctms.schema.errors import DctmsError

    with pytest.raises(DctmsError, match="chat template fails: .*no system role"):
        encode_chat(Tokenizer(folder), "hi")


@pytest.mark.slow
def test_run_prompt_uses_the_template_unless_told_not_to(chat_folder: Path, tmp_path: Path) -> None:
    from dctms.schema.io import write_plan
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions, compile_plan

    plan = compile_plan(open_model(chat_folder), CompileOptions(64, 4, prefill_chunk=16))
    write_plan(plan, tmp_path / "p.plan")

    def prompt_tokens(*extra: str) -> int:
        report = tmp_path / "r.json"
        proc = subprocess.run(
            [sys.executable, "-m", "dctms.cli.main", "run", str(tmp_path / "p.plan"), "--model",
             str(chat_folder), "--prompt", "hello", "--report", str(report), "--ignore-eos",
             *extra],
            capture_output=True, text=True,
        )
        assert proc.returncode == 0, proc.stderr
        assert "PyTorch" not in proc.stderr
        return len(json.loads(report.read_text())["prompt_tokens"])

    chat = len(mlx_lm_chat_ids(chat_folder, "hello", None))
    system = len(mlx_lm_chat_ids(chat_folder, "hello", "Be brief."))
    assert prompt_tokens() == chat
    assert prompt_tokens("--system-prompt", "Be brief.") == system
    assert prompt_tokens("--ignore-chat-template") == len(b"hello")
