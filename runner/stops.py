"""Stop strings over the generated text: where a generation ends, what text it shows, and why.

The ids so far are decoded whole each time (a byte-level tokenizer may split one character over
several tokens, and a stop string may span several tokens), the text is searched for the earliest
stop string, and only text that can no longer become part of one is released: a tail that could be
the beginning of a stop string is held back until the next token settles it, and dropped with the
stop string when it completes. The released pieces add up to ``text``: everything generated before
the first stop string (or all of it), never the stop string itself. The runner's stop *tokens*
(end of sequence) end a generation on their own; passing them as ``hidden`` keeps their text out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Literal

FinishReason = Literal["stop", "length"]


class StopText:
    """One generation's text, token by token; ``stopped`` once a stop string has appeared."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stops: Iterable[str] = (),
        hidden: AbstractSet[int] = frozenset(),
    ):
        self.stops: tuple[str, ...] = tuple(stops)
        if any(not isinstance(s, str) or not s for s in self.stops):
            raise ValueError("a stop string must be a non-empty string")
        self._decode = decode
        self._hidden = hidden
        self._ids: list[int] = []
        self._text = ""  # the visible text so far (cut before the stop string once found)
        self._sent = 0  # characters of _text released
        self.stopped_at: str | None = None  # the stop string found, once found

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    @property
    def text(self) -> str:
        """The text so far, without a stop string (released or not)."""
        return self._text

    def push(self, token: int) -> str:
        """The text that ``token`` releases: empty while a character is incomplete or the tail
        could begin a stop string; nothing more once a stop string was found."""
        if self.stopped:
            return ""
        if token not in self._hidden:
            self._ids.append(token)
        text = self._decode(self._ids)
        cut, found = earliest_stop(text, self.stops)
        if found is not None:
            self.stopped_at, self._text = found, text[:cut]
            return self._release(cut)
        self._text = text
        if text.endswith("\ufffd"):  # an incomplete character: wait for its other bytes
            return ""
        return self._release(len(text) - held_tail(text, self.stops))

    def finish(self) -> str:
        """Whatever is still held back once generation has ended (no stop string to come)."""
        return self._release(len(self._text))

    def _release(self, end: int) -> str:
        piece = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        return piece


def earliest_stop(text: str, stops: Sequence[str]) -> tuple[int, str | None]:
    """Where the first stop string in ``text`` begins and which one it is ((len, None): none)."""
    best, found = len(text), None
    for s in stops:
        at = text.find(s)
        if at != -1 and (found is None or at < best):
            best, found = at, s
    return best, found


def held_tail(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that is the beginning of a stop string."""
    longest = min(len(text), max((len(s) - 1 for s in stops), default=0))
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0


def finish_reason(tokens: Sequence[int], eos_ids: AbstractSet[int], stopped: bool) -> FinishReason:
    """OpenAI's finish reason: "stop" at an end-of-sequence token or a stop string, else "length"
    (the request's max_tokens or the plan's M ended it)."""
    if stopped or (tokens and tokens[-1] in eos_ids):
        return "stop"
    return "length"
