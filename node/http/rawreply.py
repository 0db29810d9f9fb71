"""Small replies written straight to the client's transport, head and body in one write,
beside aiohttp's response objects.

aiohttp's way to a reply (a Response, its header multidict, the prepare hooks, the payload
writer, write_eof) costs 0.1 ms of event-loop time on this kind of machine: a tailing
consumer's entry pays it on every long poll answered, and again on the node that relays the
owner's answer. Here the head is built from what the reply needs and the bytes go out at
once; the handler returns a ``Written``, which aiohttp takes as a response already sent.

Only where aiohttp would have sent the same bytes: an HTTP/1.1 request whose body was read
whole (a GET's, or a forwarded append's: aiohttp discards an unread body before the next
request, and a reply sent ahead of that would be answered out of turn), not a HEAD (GET
routes take it too; its reply has no body), without an Origin header (the cross-origin
headers come from aiohttp's prepare hook: such a request takes aiohttp's way), for a status
that has a body (not 1xx, 204 or 304), to a transport with nothing waiting to go (the write
cannot be held up by the client). Keep-alive by default, as aiohttp's reply. What the
prepare hooks and the request-id middleware add to every reply is added here too: X-Node-Id
and X-Request-Id.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from email.utils import formatdate
from http import HTTPStatus

from aiohttp import HttpVersion11, web
from aiohttp.abc import AbstractStreamWriter

from node import logs
from node.client.protocol import NODE_ID_HEADER
from node.http.middleware import REQUEST_ID_HEADER
from node.http.state import SETTINGS

SERVER_HEADER = b"storage-node"
PHRASES = {status.value: status.phrase.encode() for status in HTTPStatus}
# Headers a raw reply sets itself: any the caller passes are left out.
_OWN = frozenset(
    name.lower() for name in ("Content-Length", "Date", "Server", NODE_ID_HEADER, REQUEST_ID_HEADER)
)

_NO_BODY = frozenset({204, 304})  # statuses whose replies carry no body (nor its length)

_date = b""
_date_second = -1


def http_date() -> bytes:
    """Now as an HTTP Date header's value, made once a second."""
    global _date, _date_second
    now = int(time.time())
    if now != _date_second:
        _date_second = now
        _date = formatdate(now, usegmt=True).encode()
    return _date


def _node_id(request: web.Request) -> bytes:
    return request.app[SETTINGS].id.encode("utf-8", "surrogateescape")


class Written(web.StreamResponse):
    """A reply whose bytes ``write_whole`` wrote: aiohttp neither prepares nor ends it, and
    keeps the connection open as the request asked."""

    def __init__(self, status: int, size: int, keep_alive: bool) -> None:
        super().__init__(status=status)
        self._size = size
        self._kept = keep_alive

    @property
    def prepared(self) -> bool:
        return True

    @property
    def keep_alive(self) -> bool:
        return self._kept

    @property
    def body_length(self) -> int:
        return self._size

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        return None

    async def write_eof(self, data: bytes = b"") -> None:
        return None


def write_whole(
    request: web.Request,
    status: int,
    headers: Iterable[tuple[str, str]],
    body: bytes,
) -> Written | None:
    """``body`` with ``status`` and ``headers`` written to the client now, when the request
    allows it (the module's rules); None when it does not, and nothing was written (the
    caller then replies through aiohttp)."""
    transport = request.transport
    if (
        request.method == "HEAD"  # its reply has no body: aiohttp's leaves it out
        or request.can_read_body  # some of its body unread
        or status < 200
        or status in _NO_BODY
        or request.version != HttpVersion11
        or "Origin" in request.headers
        or transport is None
        or transport.is_closing()
        or transport.get_write_buffer_size()
    ):
        return None
    keep_alive = request.keep_alive
    lines = [
        b"HTTP/1.1 %d %s" % (status, PHRASES.get(status, b"")),
        b"Content-Length: %d" % len(body),
        b"Date: " + http_date(),
        b"Server: " + SERVER_HEADER,
        b"%s: %s" % (NODE_ID_HEADER.encode(), _node_id(request)),
    ]
    rid = logs.request_id.get()
    if rid:
        lines.append(b"%s: %s" % (REQUEST_ID_HEADER.encode(), rid.encode()))
    for name, value in headers:
        if name.lower() not in _OWN:
            lines.append(b"%s: %s" % (name.encode("latin-1"), value.encode("latin-1")))
    if not keep_alive:
        lines.append(b"Connection: close")
    lines.append(b"\r\n")
    transport.write(b"\r\n".join(lines) + body)
    return Written(status, len(body), keep_alive)
