"""The bound on open connections (``max_connections``, long polls included).

Every connection holds a descriptor, and so does every file the node opens: a journal
rotation, an entry log, a RocksDB table. Without a bound, clients that open connections
(unauthenticated long polls are enough) take the last descriptors of the process, and the
node's own files fail with EMFILE. Past the bound a new connection is answered at once with
503 ``too_many_connections`` (``Retry-After``, ``Connection: close``) and closed; the
connections already open go on as before.

The answer is written once the request's first bytes came (or ``REFUSAL_WAIT_S`` passed),
and those bytes are read: a socket closed with unread bytes sends a reset, which may reach
the client before the answer does. At most ``REFUSALS_WAITING`` refused connections wait so
at a time; past that they are answered and closed at once, so that a flood of refusals holds
few descriptors too. A refused ``GET /heartbeat`` gets its usual 200 instead: the liveness
probe asks whether the event loop answers, which it does, and a flood of connections must
not have the node restarted (readiness, ``is_ready``, is refused like the rest).

aiohttp counts a connection until its handler returns, even after its client hung up; a
long poll would then hold its place (and its waiter) until its timeout, up to
``max_long_poll_ms`` after its client left. Long polls run ``cancelled_on_hangup``: their
handler ends with the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from node.http.errors import RETRY_AFTER_S, ClientAborted, error_body
from node.metrics import Metrics
from node.wire import JSON_CONTENT_TYPE, TEXT_CONTENT_TYPE

log = logging.getLogger(__name__)

REFUSAL_WAIT_S = 1.0  # a refused connection's request is awaited this long, then answered
REFUSALS_WAITING = 64  # refused connections awaiting their request at once; more: answered now
HEARTBEAT = b"GET /heartbeat "
HEARTBEAT_ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: 3\r\n"
    b"Connection: close\r\n\r\nOK\n" % TEXT_CONTENT_TYPE.encode()
)


class ConnectionLimit:
    """Whether the server takes one more connection, and the refusal when it does not."""

    def __init__(self, max_connections: int, connections: dict[Any, Any], metrics: Metrics):
        self.max_connections = max_connections
        self._connections = connections  # aiohttp's Server's: every connection open
        self._refused = metrics.http_refused_connections
        self._refusing = False  # logged once per spell of refusals
        self.waiting = 0  # refused connections awaiting their request
        metrics.http_connections.set_function(lambda: len(connections))
        body = error_body(
            "too_many_connections",
            f"the node has max_connections ({max_connections}) connections open; "
            f"try again in {RETRY_AFTER_S} s",
        )
        self.answer = (
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: %s\r\n"
            b"Content-Length: %d\r\nRetry-After: %s\r\nConnection: close\r\n\r\n%s"
            % (JSON_CONTENT_TYPE.encode(), len(body), RETRY_AFTER_S.encode(), body)
        )

    def full(self) -> bool:
        if len(self._connections) < self.max_connections:
            self._refusing = False
            return False
        if not self._refusing:
            self._refusing = True
            log.warning(
                "max_connections (%d) connections open: refusing new ones with 503",
                self.max_connections,
            )
        return True

    def refusal(self) -> asyncio.Protocol:
        self._refused.inc()
        return _Refused(self)


class _Refused(asyncio.Protocol):
    """A connection past the bound: the 503, then the close."""

    def __init__(self, limit: ConnectionLimit) -> None:
        self._limit = limit
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._waits = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        if self._limit.waiting >= REFUSALS_WAITING:
            self._answer()
            return
        self._limit.waiting += 1
        self._waits = True
        self._timer = asyncio.get_running_loop().call_later(REFUSAL_WAIT_S, self._answer)

    def data_received(self, data: bytes) -> None:
        self._answer(HEARTBEAT_ANSWER if data.startswith(HEARTBEAT) else self._limit.answer)

    def eof_received(self) -> bool:
        self._answer()
        return False

    def _answer(self, answer: bytes | None = None) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        transport.write(answer or self._limit.answer)
        transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._waits:
            self._limit.waiting -= 1
            self._waits = False
        self._transport = None


class HangupCancels:
    """Part of the server's request handler: with ``cancel_on_hangup`` set, the request
    being handled is cancelled when its connection is lost (``hung_up`` does it)."""

    cancel_on_hangup = False
    cancelled_by_hangup = False
    _task_handler: asyncio.Task[None] | None
    _manager: web.Server | None

    def hung_up(self) -> None:
        """From the handler's connection_lost, before aiohttp forgets its task."""
        if not self.cancel_on_hangup or self._task_handler is None:
            return
        self.cancelled_by_hangup = True
        # A server with handler_cancellation (aiohttp's test server) cancels it itself.
        if self._manager is None or not self._manager.handler_cancellation:
            self._task_handler.cancel()


@contextlib.contextmanager
def cancelled_on_hangup(request: web.BaseRequest) -> Iterator[None]:
    """Within it, the request's handler is cancelled if its client hangs up: nobody waits
    for what a long poll would answer. It ends as any request whose client left does
    (ClientAborted: status 499 in the metrics and the access log)."""
    protocol = request.protocol
    if not isinstance(protocol, HangupCancels):  # a server other than the node's
        yield
        return
    protocol.cancel_on_hangup = True
    try:
        yield
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if not protocol.cancelled_by_hangup or task is None or task.uncancel():
            raise  # (also) cancelled by something else: shutdown, a timeout
        raise ClientAborted("the client hung up during a long poll") from None
    finally:
        protocol.cancel_on_hangup = False
