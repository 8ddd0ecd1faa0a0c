"""A POST's JSON body, taken in defensively: the media type, the size, the time, then the JSON.

- Only ``application/json`` (parameters such as ``charset=utf-8`` allowed) is read: a web page may
  send ``text/plain``, form or multipart bodies to 127.0.0.1 without asking first (no CORS
  preflight), but not ``application/json`` — so a cross-site request is refused (415) unread.
- At most ``max_bytes`` (413: up front from Content-Length, or as a chunked body passes the limit),
  all of it within ``timeout_s`` of the request's head (408): a client that trickles its body holds
  a connection for seconds, not forever.
- Strict JSON in UTF-8: no NaN or Infinity, nesting at most ``MAX_DEPTH`` levels (a body nested
  100,000 deep is refused, not a RecursionError), and no lone UTF-16 surrogate in any string
  (``"\\ud800"`` is valid JSON but no text: the tokenizer cannot encode it).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from dctms.serve.protocol import ApiError
from dctms.serve.security import error_body

MAX_DEPTH = 64  # the deepest real request (chat content parts) is 5 levels
BODY_TIMEOUT_S = 10.0


class BodyError(ApiError):
    """A refusal of the body itself; ``close``: the connection is not worth keeping (the rest of
    an over-long or too-slow body would still be on its way)."""

    def __init__(self, status: int, message: str, code: str, close: bool = False):
        super().__init__(status, message, None, code)
        self.close = close

    def body(self) -> dict:
        return error_body(self.status, self.message, self.code)


class ClientGone(Exception):
    """The client closed the connection before its body arrived: nobody to answer."""


def check_media_type(value: str | None) -> None:
    media = (value or "").split(";")[0].strip().lower()
    if media != "application/json":
        shown = value if value else "none"
        raise BodyError(415, f"the request body must be Content-Type: application/json, got {shown}",
                        "unsupported_media_type")


async def read_body(receive, headers: dict[bytes, bytes], max_bytes: int,
                    stopping: asyncio.Event, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The whole body from ASGI ``receive``, within the size and time limits; a body still on its
    way when the server begins to stop (``stopping``) is refused with 503 at once."""
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await _receive_unless(receive, stopping)
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > max_bytes:
                    raise _too_large(max_bytes)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
    except TimeoutError:
        raise BodyError(408, f"the request body did not arrive within {timeout_s:g} s",
                        "body_timeout", close=True) from None


async def _receive_unless(receive, stopping: asyncio.Event) -> dict:
    if stopping.is_set():
        raise _stopping()
    message = asyncio.ensure_future(receive())
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait((message, stop), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if not message.done():
        message.cancel()
        raise _stopping()
    return message.result()


def _stopping() -> BodyError:
    return BodyError(503, "the server is shutting down", "shutting_down", close=True)


def _too_large(max_bytes: int) -> BodyError:
    return BodyError(413, f"the request body is larger than {max_bytes} bytes (--max-body-bytes)",
                     "body_too_large", close=True)


def parse_json(raw: bytes) -> Any:
    """The body's JSON value, or a 400; pure CPU work, run off the event loop."""
    try:
        text = raw.decode("utf-8")
        value = json.loads(text, parse_constant=_not_json)
    except RecursionError:
        raise _malformed("nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise _malformed(str(err)) from None
    _check_value(value)
    return value


def _malformed(why: str) -> ApiError:
    return ApiError(400, f"malformed JSON in the request body: {why}")


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _check_value(value: Any) -> None:
    """Nesting depth and lone surrogates, iteratively (no recursion on hostile input)."""
    stack = [(value, "$", 1)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                raise _malformed(f"nested deeper than {MAX_DEPTH} levels at {path}")
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key, f"{path} (a key)")
                    stack.append((child, f"{path[:60]}.{key[:20]}", depth + 1))  # bounded
            else:
                stack.extend((child, f"{path[:60]}[{i}]", depth + 1) for i, child in enumerate(item))
        elif isinstance(item, str):
            _check_text(item, path)


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(400, f"{path[:80]!a} holds a lone UTF-16 surrogate "
                            f"({text[err.start]!a}), which is no character") from None
