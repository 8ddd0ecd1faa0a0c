"""Who may talk to the server: the Host header (against DNS rebinding) and the API key (and, first,
headers of a sane size).

A web page on any site can make a browser send requests to 127.0.0.1, and with DNS rebinding it can
even read the answers: its own name resolves to 127.0.0.1, so the browser's same-origin rule sees one
origin. What gives it away is the Host header, which carries the page's name, not ours: a request
whose Host is not one of the server's names is refused (403) before anything else. The port is not
checked: an SSH tunnel or a proxy legitimately presents another one. The API key, when there is one,
is compared in constant time (401 otherwise). Both checks wrap every route, unknown ones included.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Iterable, Mapping

from dctms.schema.errors import DctmsError

API_KEY_ENV = "DCTMS_API_KEY"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
ANY_HOST = "*"
# A head that arrives in pieces is cut at 16 KiB by h11 (``server.MAX_HEAD_BYTES``); one that
# arrives in a single read can be larger, and is refused here.
MAX_HEADER_BYTES = 16 * 1024
# Headers whose second copy could make two readers disagree (which Host? which media type?).
SINGLE_HEADERS = (b"host", b"authorization", b"content-type")


def resolve_api_key(option: str | None, environ: Mapping[str, str]) -> str | None:
    """``--api-key`` if given, else ``$DCTMS_API_KEY`` if set and not empty; None: no key.
    A key must be printable ASCII without spaces: it has to survive an HTTP header."""
    if option is not None:
        key, source = option, "--api-key"
    else:
        key, source = environ.get(API_KEY_ENV) or None, API_KEY_ENV
        if key is None:
            return None
    if not key or not all("!" <= c <= "~" for c in key):
        raise DctmsError(f"{source}: a key must be 1 or more printable ASCII characters, no spaces")
    return key


def exposure_warning(bind_host: str, api_key: str | None) -> str | None:
    """A line to print when the server is reachable from other machines without a key."""
    if api_key is not None or _is_loopback(bind_host):
        return None
    return (f"dctms serve: warning: listening on {bind_host} without an API key (--api-key or "
            f"${API_KEY_ENV}): anyone who can reach it may generate")


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind_host: str, extra: Iterable[str]) -> frozenset[str]:
    """The names a request's Host may carry: loopback's, the bound address, ``--allowed-host``
    (given as a Host value: a name, an IPv4 address or an [IPv6] one, a port ignored)."""
    names = {*LOOPBACK_NAMES, host_name(bind_host) or bind_host.lower()}
    for value in extra:
        name = ANY_HOST if value == ANY_HOST else host_name(value)
        if name is None or any(c.isspace() for c in value):
            raise DctmsError(f"--allowed-host {value!r}: expected a host name, "
                             "an IPv4 address or an [IPv6] one")
        names.add(name)
    return frozenset(names)


def host_name(value: str) -> str | None:
    """The name in a Host value (name, IPv4, [IPv6], each with an optional :port), lower-cased
    and without a final dot; None when it is no Host value. A bare IPv6 address is taken whole."""
    host = value.strip().lower()
    if host.count(":") > 1 and not host.startswith("["):
        return host  # a bare IPv6 address (as --host takes it)
    if host.startswith("["):
        name, close, port = host[1:].partition("]")
        if not close or (port and not port.startswith(":")):
            return None
        port = port[1:]
    else:
        name, _, port = host.partition(":")
    if (port and not port.isdigit()) or not name:
        return None
    return name.removesuffix(".") or None  # "localhost." is the same name, fully qualified


def host_allowed(header: str, names: frozenset[str]) -> bool:
    """``header`` (a request's Host value) names this server."""
    if ANY_HOST in names:
        return True
    if header.strip().count(":") > 1 and not header.strip().startswith("["):
        return False  # an IPv6 address must be in brackets in a Host header
    return host_name(header) in names


class Guard:
    """ASGI middleware for every HTTP request: headers too large (431) or repeated (400), then
    the Host check (403), then the API key (401)."""

    def __init__(self, app, names: frozenset[str], api_key: str | None):
        self.app = app
        self.names = names
        self.expected = f"bearer {api_key}".encode() if api_key is not None else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            await reject(send, 431, f"the request's headers exceed {MAX_HEADER_BYTES} bytes",
                         "headers_too_large")
            return
        names = [name for name, _ in scope["headers"]]
        for name in SINGLE_HEADERS:
            if names.count(name) > 1:
                await reject(send, 400, f"the {name.decode()} header is repeated",
                             "repeated_header")
                return
        headers = dict(scope["headers"])  # lower-cased names, each at most once (above)
        host = headers.get(b"host", b"").decode("latin-1")
        if not host_allowed(host, self.names):
            await reject(send, 403, f"Host {host!r} is not one of this server's names; a proxy "
                                    "or another name needs --allowed-host NAME", "host_not_allowed")
            return
        if self.expected is not None and not self._authorised(headers.get(b"authorization")):
            await reject(send, 401, "a valid API key is required: Authorization: Bearer KEY",
                         "invalid_api_key", {"www-authenticate": "Bearer"})
            return
        await self.app(scope, receive, send)

    def _authorised(self, value: bytes | None) -> bool:
        if value is None:
            return False
        scheme, _, key = value.partition(b" ")
        given = scheme.lower() + b" " + key.strip()
        return hmac.compare_digest(given, self.expected)


def error_body(status: int, message: str, code: str) -> dict:
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    if status in (401, 403):
        kind = "authentication_error" if status == 401 else "permission_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


async def reject(send, status: int, message: str, code: str,
                 headers: Mapping[str, str] | None = None) -> None:
    """A JSON error answered straight from ASGI, before any route runs."""
    body = json.dumps(error_body(status, message, code)).encode()
    # Close afterwards: an unread body (a refused upload) is not worth reading.
    fields = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
              (b"connection", b"close")]
    fields += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": fields})
    await send({"type": "http.response.body", "body": body})
