"""Chat messages to prompt token ids, with the model folder's own chat template (the runner's
tokenizer does the templating; the server never formats a conversation itself)."""

from __future__ import annotations

from dctms.runner.tokenize import Tokenizer
from dctms.serve.protocol import ApiError


def encode_messages(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    raise ApiError(
        501,
        "chat templates are not supported by this dctms yet; use /v1/completions",
        "messages",
        "chat_unsupported",
    )
