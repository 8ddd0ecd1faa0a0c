"""Text to token ids and back with the model folder's own tokenizer, chat like mlx-lm.

Plain text goes through ``tokenizers`` (tokenizer.json). A chat prompt is rendered with the
tokenizer's chat template by transformers' ``apply_chat_template`` -- the call mlx-lm's generate
makes -- and then encoded without adding special tokens again, as mlx-lm does. End-of-sequence ids
follow mlx-lm's loader: generation_config.json's ``eos_token_id`` when it has one, else config.json's,
plus the tokenizer's own eos token.
"""

from __future__ import annotations

import json
from pathlib import Path

from dctms.schema.errors import DctmsError

CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


class Tokenizer:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        path = self.folder / "tokenizer.json"
        if not path.is_file():
            raise DctmsError(f"{folder}: no tokenizer.json; pass token ids with --tokens")
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as err:  # the tokenizers library raises its own exception type
            raise DctmsError(f"{path}: cannot load tokenizer: {err}") from None
        self._config = _tokenizer_config(self.folder)
        self._chat = None  # transformers' tokenizer, loaded on the first chat prompt

    @property
    def eos_ids(self) -> set[int]:
        """This folder's end-of-sequence ids (``eos_ids``)."""
        return eos_ids(self.folder, self)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._config.get("chat_template")) or any(
            (self.folder / name).is_file() for name in CHAT_TEMPLATE_FILES
        )

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def eos_token(self) -> str | None:
        value = self._config.get("eos_token")
        if isinstance(value, dict):  # transformers' serialised AddedToken
            value = value.get("content")
        return value if isinstance(value, str) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, unlike encode, releases the GIL (tokenizers 0.23): a long prompt tokenised
        # on a server's worker thread then does not stall its event loop. The same ids.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def render_chat(self, messages: list[dict]) -> str:
        """The chat template applied with the generation prompt, as text."""
        try:
            return self.chat_tokenizer().apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as err:  # jinja2 errors, or the template's own raise_exception
            raise DctmsError(f"{self.folder}: the chat template fails: {err}") from None

    def chat_tokenizer(self):
        """transformers' tokenizer of the folder (what applies its chat template), loaded once."""
        if self._chat is None:
            import os

            # transformers warns on import that PyTorch is absent: irrelevant to a tokenizer.
            os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
            from transformers import AutoTokenizer

            try:
                self._chat = AutoTokenizer.from_pretrained(str(self.folder))
            except Exception as err:  # transformers raises many exception types here
                raise DctmsError(f"{self.folder}: cannot load the chat template: {err}") from None
        return self._chat


def encode_chat(
    tokenizer: Tokenizer, messages: list[dict] | str, system_prompt: str | None = None
) -> list[int]:
    """Token ids of a chat, as mlx-lm's generate builds them: ``messages`` (or one user message's
    text), after an optional system message, through the chat template with the generation prompt,
    encoded without adding special tokens. A tokenizer without a chat template encodes the
    messages' contents as plain text instead (mlx-lm does the same)."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    chat = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    chat += messages
    if not tokenizer.has_chat_template:
        return tokenizer.encode("\n".join(str(m.get("content", "")) for m in chat))
    return tokenizer.encode(tokenizer.render_chat(chat), add_special_tokens=False)


def eos_ids(folder: Path, tokenizer: Tokenizer | None = None) -> set[int]:
    """End-of-sequence ids, mlx-lm's rule: generation_config.json's ``eos_token_id`` (an id or a
    list) replaces config.json's; the tokenizer's eos token is added."""
    folder = Path(folder)
    ids = _ids(_json(folder / "generation_config.json").get("eos_token_id"))
    if not ids:
        ids = _ids(_json(folder / "config.json").get("eos_token_id"))
    if tokenizer is not None and tokenizer.eos_token is not None:
        token = tokenizer.token_id(tokenizer.eos_token)
        if token is not None:
            ids.add(token)
    return ids


def _ids(value: object) -> set[int]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _tokenizer_config(folder: Path) -> dict:
    return _json(folder / "tokenizer_config.json")


def parse_token_list(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise DctmsError(f"--tokens wants comma-separated integers, got {text!r}") from None
    if not ids:
        raise DctmsError("--tokens is empty")
    return ids
