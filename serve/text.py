"""Streaming detokenisation: the text of each new token, never half a character.

A byte-level tokenizer may split one UTF-8 character over several tokens; decoding token by token
would emit replacement characters. So the whole sequence is decoded each time and only the text
past what was already sent goes out, held back while it ends in an incomplete character (U+FFFD).
The concatenation of the pieces is exactly ``decode(all tokens)``.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], hidden: AbstractSet[int] = frozenset()):
        self._decode = decode
        self._hidden = hidden  # e.g. the stop token: generated, never shown
        self._ids: list[int] = []
        self._sent = 0

    def push(self, token: int) -> str:
        """The new text after ``token`` (may be empty while a character is incomplete)."""
        if token not in self._hidden:
            self._ids.append(token)
        text = self._decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        return self._take(text)

    def finish(self) -> str:
        """Whatever was held back (an incomplete character at the very end stays as U+FFFD)."""
        return self._take(self._decode(self._ids))

    def _take(self, text: str) -> str:
        piece = text[self._sent :]
        self._sent = max(self._sent, len(text))
        return piece
