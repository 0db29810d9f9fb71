"""Requests that other web sites make a browser send are refused.

Any page a browser shows may POST to any address the browser reaches, loopback included,
without asking (no CORS preflight) when the body is ``text/plain``, a form or has no type;
and DNS rebinding points a name the page controls at this node, so that the page also reads
the answers. Without an admin token nothing else stood in the way. So, for aiohttp's routes
(``refuse_cross_site``) and the fast lane alike (``Guard``):

- Host: the host of the ``Host`` header is one of the node's own: loopback, the address the
  client connected to, ``http_host``, the machine's host name, or one of ``allowed_hosts``
  ("*": any). A rebinding page's requests carry the page's own name.
- Origin: a state-changing request that carries ``Origin`` (browsers send it with every
  one) comes from the node's own origin (the status page) or one of ``allowed_origins``,
  whose responses then carry CORS headers.
- Content type: a state-changing request under /api/v1/ with a body sends JSON, but for the
  entry routes (octet-stream or batch frames: they check their own types).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from node.http.errors import ApiError
from node.http.middleware import GUARDED_PREFIX, MUTATING
from node.http.state import SETTINGS
from node.settings import Settings
from node.wire import JSON_CONTENT_TYPE, media_type

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ANY = "*"
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# Routes whose bodies are entries, not JSON (ledgers.add, streams.add, put_entry).
ENTRY_ROUTES = frozenset(
    {
        "/api/v1/ledgers/{lid}/entries",
        "/api/v1/ledgers/{lid}/entries/{eid}",
        "/api/v1/streams/{name}/entries",
    }
)
# What a page of an allowed origin may send and read (CORS).
CORS_METHODS = "GET, HEAD, PUT, POST, DELETE"
CORS_REQUEST_HEADERS = "Authorization, Content-Type, X-Request-Id, X-Write-Token"
CORS_EXPOSED_HEADERS = "X-Request-Id, X-Next-Position, Retry-After"
CORS_MAX_AGE_S = "600"


def host_of(header: str) -> str:
    """The host of a Host header ("name:port", "[v6]:port"), lower case, no final dot."""
    host = header[1 : header.find("]")] if header.startswith("[") else header.partition(":")[0]
    return host.lower().rstrip(".")


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(text.partition("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # a dual-stack socket's view of an IPv4 client
    return address


def _is_json(content_type: str) -> bool:
    media = media_type(content_type)
    suffixed = media.startswith("application/") and media.endswith("+json")
    return media == JSON_CONTENT_TYPE or suffixed


class Guard:
    """The node's own names and the allowed origins, from the settings; no DNS lookup (the
    names a client may use but the machine does not know go in ``allowed_hosts``)."""

    def __init__(self, settings: Settings) -> None:
        names = {name.lower().rstrip(".") for name in settings.allowed_hosts}
        self.any_host = ANY in names
        self.suffixes = tuple(name for name in names if name.startswith("."))
        names |= {suffix[1:] for suffix in self.suffixes}  # ".domain" is the domain too
        names |= LOOPBACK_NAMES | {socket.gethostname().lower()}
        if settings.http_host not in WILDCARD_BINDS:
            names.add(settings.http_host.lower().strip("[]"))  # an address, or a name
        self.names = frozenset(names)
        self.any_origin = ANY in settings.allowed_origins
        self.origins = frozenset(settings.allowed_origins)

    def host_allowed(self, header: str | None, sockname: Any) -> bool:
        """Whether ``header`` names this node; ``sockname`` is the connection's local end."""
        if header is None or self.any_host:
            return True  # only HTTP/1.0 clients omit Host; browsers always send it
        host = host_of(header)
        if host in self.names or (self.suffixes and host.endswith(self.suffixes)):
            return True
        address = _address(host)
        if address is None:
            return False
        local = _address(sockname[0]) if isinstance(sockname, tuple) and sockname else None
        return address.is_loopback or address == local

    def same_origin(self, origin: str, host: str | None) -> bool:
        return host is not None and origin.partition("://")[2].lower() == host.lower()

    def cross_origin_allowed(self, origin: str) -> bool:
        return self.any_origin or origin.lower().rstrip("/") in self.origins

    def refusal(
        self, method: str, host: str | None, origin: str | None, sockname: Any
    ) -> ApiError | None:
        """The Host and Origin rules, for any request."""
        if not self.host_allowed(host, sockname):
            return ApiError(
                403,
                "host_not_allowed",
                f"Host {(host or '')[:100]!r} is not a name of this node; add it to allowed_hosts",
            )
        if (
            method in MUTATING
            and origin is not None
            and not self.same_origin(origin, host)
            and not self.cross_origin_allowed(origin)
        ):
            return ApiError(
                403,
                "origin_not_allowed",
                f"requests from pages of {origin[:100]!r} may not change state; "
                "add the origin to allowed_origins",
            )
        return None


GUARD = web.AppKey("guard", Guard)


def install(app: web.Application) -> None:
    app[GUARD] = Guard(app[SETTINGS])
    app.on_response_prepare.append(_cors_headers)


def _cross_origin(request: web.Request) -> str | None:
    """The request's Origin when it is another origin this node allows."""
    origin = request.headers.get("Origin")
    guard = request.app[GUARD]
    if origin is None or guard.same_origin(origin, request.headers.get("Host")):
        return None
    return origin if guard.cross_origin_allowed(origin) else None


@web.middleware
async def refuse_cross_site(request: web.Request, handler: Handler) -> web.StreamResponse:
    headers = request.headers
    error = request.app[GUARD].refusal(
        request.method,
        headers.get("Host"),
        headers.get("Origin"),
        request.transport.get_extra_info("sockname") if request.transport else None,
    )
    if error is not None:
        raise error
    preflight = request.method == "OPTIONS" and "Access-Control-Request-Method" in headers
    if preflight and _cross_origin(request) is not None:
        return web.Response(status=204)  # its CORS headers come in _cors_headers
    # A body without a type is taken as JSON (not a form).
    if _takes_json(request) and not _is_json(headers.get("Content-Type", JSON_CONTENT_TYPE)):
        raise ApiError(
            415,
            "unsupported_media_type",
            f"this route takes {JSON_CONTENT_TYPE}, not {headers['Content-Type'][:100]!r}",
        )
    return await handler(request)


def _takes_json(request: web.Request) -> bool:
    """A state change under /api/v1/ with a body, on a route whose body is JSON (a 404 or
    405 answers as such, whatever the body)."""
    match = request.match_info
    resource = match.route.resource
    return (
        request.method in MUTATING
        and request.path.startswith(GUARDED_PREFIX)
        and request.body_exists
        and match.http_exception is None
        and resource is not None
        and resource.canonical not in ENTRY_ROUTES
    )


async def _cors_headers(request: web.BaseRequest, response: web.StreamResponse) -> None:
    if not isinstance(request, web.Request):
        return  # a malformed request answered before routing: no Origin to answer
    origin = _cross_origin(request)
    if origin is None:
        return
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Vary"] = "Origin"
    response.headers["Access-Control-Expose-Headers"] = CORS_EXPOSED_HEADERS
    if request.method == "OPTIONS":
        response.headers["Access-Control-Allow-Methods"] = CORS_METHODS
        response.headers["Access-Control-Allow-Headers"] = CORS_REQUEST_HEADERS
        response.headers["Access-Control-Max-Age"] = CORS_MAX_AGE_S
