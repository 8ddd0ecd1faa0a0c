"""Bind the listening socket ourselves (a clear one-line error when the port is taken, and port 0
for an ephemeral one), then let uvicorn serve the app until Ctrl-C / SIGTERM.

Two things uvicorn (0.54, h11) does not do on its own are added here, at the protocol level:
- a deadline for the request head: uvicorn starts no timer until a request's head is complete, so a
  client that sends half its headers (slowloris) or nothing at all holds a connection for ever.
  Here a connection on which no response is under way is closed ``HEADER_TIMEOUT_S`` after it got
  there (connected, or its last response sent), whatever the client trickles meanwhile; the body
  then has its own deadline (``dctms.serve.body``);
- JSON for the 400 that h11's parser answers for a malformed request (uvicorn writes plain text).
And at shutdown the worker withdraws its work first (queued requests get 503, a running stream an
error event), so connections finish at once instead of being cancelled by uvicorn's timeout.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import threading
from collections.abc import Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from dctms.schema.errors import DctmsError
from dctms.serve.security import error_body

HEADER_TIMEOUT_S = 5.0
MAX_HEAD_BYTES = 16 * 1024  # h11's own default for an incomplete head, stated here


def bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise DctmsError(f"--port {port} is not a TCP port (0-65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise DctmsError(f"--host {host!r}: {err.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise DctmsError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for every stretch in which no response is under
    way, and a JSON body on its 400 for requests h11 cannot parse."""

    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch(fresh=True)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch(fresh=False)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch(fresh=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    def _busy(self) -> bool:
        """A request is being answered: its body and its response have their own limits."""
        return self.cycle is not None and not self.cycle.response_complete

    def _watch(self, fresh: bool) -> None:
        if self._busy() or self.transport.is_closing():
            self._cancel()
        elif fresh or self._deadline is None:
            self._cancel()
            self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._expire)

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self._busy() and not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(error_body(400, f"malformed HTTP request: {msg}", "bad_http")).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=body), h11.EndOfMessage()):  # fmt: skip
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:
            pass  # a response was already under way: nothing more can be said on this connection
        self.transport.close()


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]):
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()  # withdraw the work first: every connection can then finish at once
        await super().shutdown(sockets)


def run(app, sock: socket.socket, log_level: str = "warning",
        on_shutdown: Callable[[], None] = lambda: None) -> None:
    """Serve until a signal; ``on_shutdown`` runs as the shutdown begins, then uvicorn closes the
    connections (up to 5 s for responses still being sent), then the app's lifespan ends."""
    config = uvicorn.Config(
        app,
        http=GuardedH11,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        ws="none",  # no WebSocket routes: an Upgrade header is ignored, the request served as HTTP
        log_level=log_level,
        access_log=log_level in ("info", "debug"),
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    server = _Server(config, on_shutdown)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"dctms serve: listening on http://{shown}:{port} (Ctrl-C stops)", file=sys.stderr,
          flush=True)
    # uvicorn shuts down gracefully on SIGINT and SIGTERM, then re-raises the signal under the
    # handler that was there before it: make SIGTERM's, like SIGINT's, a KeyboardInterrupt, so the
    # command ends the same clean way (exit 0) instead of being killed by the re-raised signal.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        server.run(sockets=[sock])
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
