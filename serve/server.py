"""Bind the listening socket ourselves (a clear one-line error when the port is taken, and port 0
for an ephemeral one), then let uvicorn serve the app until Ctrl-C / SIGTERM."""

from __future__ import annotations

import signal
import socket
import sys
import threading

from dctms.schema.errors import DctmsError


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


def run(app, sock: socket.socket, log_level: str = "warning") -> None:
    """Serve until a signal; uvicorn closes connections (up to 5 s for streams still running),
    then the app's lifespan stops the worker."""
    import uvicorn

    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=log_level in ("info", "debug"),
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    print(f"dctms serve: listening on http://{host}:{port} (Ctrl-C stops)", file=sys.stderr,
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
