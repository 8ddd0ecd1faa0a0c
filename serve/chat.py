"""Chat messages to prompt token ids with the model folder's own chat template: the runner's
``encode_chat`` (as mlx-lm builds a chat prompt); the server never formats a conversation itself."""

from __future__ import annotations

from dctms.runner.tokenize import Tokenizer, encode_chat
from dctms.schema.errors import DctmsError
from dctms.serve.protocol import ApiError


def encode_messages(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` through the template with the generation prompt; a template that
    refuses the conversation (e.g. a role it does not know) is the request's fault: HTTP 400."""
    try:
        return encode_chat(tokenizer, messages)
    except DctmsError as err:
        raise ApiError(400, str(err), "messages", "chat_template_failed") from None


def warm_chat_template(tokenizer: Tokenizer) -> None:
    """Load the template's machinery (transformers) before serving, so the first chat request
    does not pay for it and a template that cannot be loaded refuses the start."""
    if tokenizer.has_chat_template:
        encode_chat(tokenizer, [{"role": "user", "content": "hello"}])
