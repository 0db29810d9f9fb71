"""The fast lane: adds answered straight from the socket, beside aiohttp.

Every connection starts here. A request that is plainly an add is answered here, through
the very functions aiohttp's routes call (``ledgers.add``, ``streams.add``): a complete head
of ``POST /api/v1/ledgers/{id}/entries`` or ``POST /api/v1/streams/{name}/entries`` in
HTTP/1.1, one Content-Length no larger than ``http_fast_lane_max_body``, no
Transfer-Encoding, Expect or Upgrade, no duplicate or malformed header, no Origin and a Host
of this node's (``crosssite.py``), the admin token when one is set, and room in the body
budget at once. The first request that is anything else
hands the connection, with every byte not yet answered, to aiohttp's request handler for
good: aiohttp then applies all its rules and error answers, to that request and to all
that follow on the connection. So the lane only ever answers requests that aiohttp would
route to the same function; it never has to reproduce aiohttp's refusals.

Why: aiohttp's web stack (request and response objects, the router, four middlewares) costs
about as much event-loop time per request as the add itself; for one-entry adds it was
the ceiling (``python -m node bench http --peer redis``).

What aiohttp's server did for these requests and the lane does too:
- the request id (X-Request-Id echoed when sane, else made), ``http_request_duration_seconds``
  by route template, the access log line (DEBUG; WARNING for 5xx), errors as JSON;
- the body budget (taken before the body is read; given back after the answer);
- the header, body and keep-alive timeouts (a sweep once a second: a head still incomplete
  after ``header_timeout_s`` closes the connection, a body after ``body_read_timeout_s``
  gets 408, an idle connection closes after ``keepalive_timeout_s``);
- requests on one connection answered in order, one at a time (pipelining is read ahead,
  up to a bound, then reading pauses);
- graceful shutdown: the runner's ``pre_shutdown`` and ``shutdown`` close idle connections
  and let answers in progress finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from node import logs
from node.client import protocol
from node.http import ledgers, streams
from node.http.crosssite import GUARD
from node.http.errors import RETRY_AFTER_S, ApiError, error_body, storage_status
from node.http.middleware import (
    CLIENT_CLOSED_REQUEST,
    access_log,
    next_request_id,
    token_refusal,
    valid_client_request_id,
)
from node.http.rawreply import PHRASES, SERVER_HEADER, http_date
from node.http.state import BUDGET, METRICS, SETTINGS
from node.storage.adds import PendingAdd
from node.storage.errors import StorageError
from node.streams.dedup import DUPLICATE_HEADER, PRODUCER_HEADER, SEQUENCE_HEADER
from node.streams.model import ID_DIGITS
from node.wire import JSON_CONTENT_TYPE, RAW_CONTENT_TYPES, media_type

log = logging.getLogger(__name__)

LEDGER_ROUTE = "/api/v1/ledgers/{lid}/entries"
STREAM_ROUTE = "/api/v1/streams/{name}/entries"
_LEDGER_ADD = re.compile(rf"/api/v1/ledgers/{ID_DIGITS}/entries".encode())
# Names that need no percent-decoding (the stream name rule, model.NAME, in its plain form).
_STREAM_ADD = re.compile(rb"/api/v1/streams/([A-Za-z0-9][A-Za-z0-9._-]{0,254})/entries")
_HEADER_LINES = re.compile(
    rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t\x20-\x7e\x80-\xff]*"
    rb"(?:\r\n[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t\x20-\x7e\x80-\xff]*)*"
)
_DIGITS = re.compile(rb"[0-9]{1,18}")
_REFUSED_HEADERS = (b"transfer-encoding", b"expect", b"upgrade")
MAX_HEAD = 8 * 1024  # a longer head goes to aiohttp, which has the limits and the 431
READ_AHEAD = 256 * 1024  # pipelined bytes buffered while answering; then reading pauses
SWEEP_INTERVAL_S = 1.0  # how often the timeouts are checked
_WRITE_TOKEN = ledgers.WRITE_TOKEN_HEADER.lower().encode()
_REPLICATED = protocol.REPLICATED_HEADER.lower().encode()
_EXPECT_NODE = protocol.EXPECT_NODE_HEADER.lower().encode()
_PRODUCER = PRODUCER_HEADER.lower().encode()
_SEQUENCE = SEQUENCE_HEADER.lower().encode()
_DUPLICATE = b"%s: true\r\n" % DUPLICATE_HEADER.encode()
_JSON_CONTENT_TYPE = JSON_CONTENT_TYPE.encode()


class _Add:
    """A parsed add request: its route, the ledger id or stream name, its headers."""

    __slots__ = ("body_at", "headers", "key", "length", "path", "route")

    def __init__(
        self, route: str, path: bytes, key: bytes, headers: dict[bytes, bytes], body_at: int
    ) -> None:
        self.route = route
        self.path = path.decode()
        self.key = key
        self.headers = headers
        self.length = int(headers[b"content-length"])
        self.body_at = body_at


def parse_add(buffer: bytes | bytearray, head_end: int) -> _Add | None:
    """The add whose head ends at ``head_end`` (before its blank line); None when the
    request is not one the lane answers (aiohttp gets it)."""
    head = bytes(buffer[:head_end])
    line_end = head.find(b"\r\n")
    if line_end < 0:
        return None  # no header at all, so no Content-Length either
    request_line = head[:line_end].split(b" ")
    if len(request_line) != 3 or request_line[0] != b"POST" or request_line[2] != b"HTTP/1.1":
        return None
    target = request_line[1]
    if match := _LEDGER_ADD.fullmatch(target):
        route = LEDGER_ROUTE
    elif match := _STREAM_ADD.fullmatch(target):
        route = STREAM_ROUTE
    else:
        return None
    # Every header line well formed, in one pass of the regex engine: an obs-fold, a bare
    # LF or a control byte sends the request to aiohttp's parser, which decides.
    if not _HEADER_LINES.fullmatch(head, line_end + 2):
        return None
    headers: dict[bytes, bytes] = {}
    for line in head[line_end + 2 :].split(b"\r\n"):
        name, _, value = line.partition(b":")
        key = name.lower()
        if key in headers:
            return None  # duplicates have rules (Content-Length above all): aiohttp's
        headers[key] = value.strip(b" \t")
    length = headers.get(b"content-length")
    if length is None or not _DIGITS.fullmatch(length):
        return None
    if any(name in headers for name in _REFUSED_HEADERS):
        return None
    return _Add(route, target, match.group(1), headers, head_end + 4)


def _header(add: _Add, name: bytes) -> str:
    """A header's value as aiohttp's parser gives it to the routes."""
    return add.headers.get(name, b"").decode("utf-8", "surrogateescape")


def _optional(add: _Add, name: bytes) -> str | None:
    return _header(add, name) if name in add.headers else None


def _content_type(add: _Add) -> str:
    return media_type(_header(add, b"content-type"))


def _token(add: _Add) -> str | None:
    return _header(add, _WRITE_TOKEN) if _WRITE_TOKEN in add.headers else None


def _getter(add: _Add) -> ledgers.HeaderGetter:
    """The add's headers as the routes read them (name -> value or None)."""

    def header(name: str) -> str | None:
        key = name.lower().encode()
        return _header(add, key) if key in add.headers else None

    return header


def _failure(error: Exception, path: str) -> tuple[int, bytes]:
    """The status and JSON body of an add that failed."""
    if isinstance(error, ApiError):
        return error.status, error_body(error.code, error.message)
    if isinstance(error, StorageError):
        return storage_status(error, "POST", path), error_body(error.code, error.message)
    log.error("request POST %s failed", path, exc_info=error)
    return 500, error_body("internal_error", str(error) or type(error).__name__)


class Lanes:
    """The lanes of one server: what they share, and the sweep of their timeouts."""

    def __init__(
        self,
        app: web.Application,
        connections: dict[Any, asyncio.Transport],
        aiohttp_handler: Callable[[], asyncio.Protocol],
    ) -> None:
        settings = app[SETTINGS]
        self.app = app
        self.metrics = app[METRICS]
        self.budget = app[BUDGET]
        self.max_body = min(settings.http_fast_lane_max_body, settings.max_request_size)
        self.admin_token = (
            settings.admin_token.get_secret_value().encode() if settings.admin_token else None
        )
        self.guard = app[GUARD]
        self.node_id = settings.id
        # With replicated streams, the lane answers appends to the streams this node owns;
        # the others go through aiohttp's route, which takes a stream over or forwards to
        # its owner (the lane does neither).
        self.router = app.get(streams.STREAM_ROUTER)
        self.node_id_header = b"%s: %s\r\n" % (
            protocol.NODE_ID_HEADER.encode(),
            settings.id.encode("utf-8", "surrogateescape"),
        )
        self.header_timeout = settings.header_timeout_s
        self.body_timeout = settings.body_read_timeout_s
        self.keepalive_timeout = settings.keepalive_timeout_s
        self.connections = connections  # aiohttp's: its pre_shutdown and shutdown see lanes
        self.aiohttp_handler = aiohttp_handler
        self.open: set[FastLane] = set()
        self._sweep: asyncio.TimerHandle | None = None

    def made(self, lane: FastLane, transport: asyncio.Transport) -> None:
        self.open.add(lane)
        self.connections[lane] = transport
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(SWEEP_INTERVAL_S, self.sweep)

    def lost(self, lane: FastLane) -> None:
        self.open.discard(lane)
        self.connections.pop(lane, None)

    def sweep(self) -> None:
        now = asyncio.get_running_loop().time()
        for lane in list(self.open):
            lane.check_timeouts(now)
        self._sweep = (
            asyncio.get_running_loop().call_later(SWEEP_INTERVAL_S, self.sweep)
            if self.open
            else None
        )


class FastLane(asyncio.Protocol):
    """One connection, while it sends nothing but adds."""

    def __init__(self, lanes: Lanes) -> None:
        self._lanes = lanes
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._pending: _Add | None = None  # parsed, its body still arriving
        self._held = 0  # budget bytes of the pending or answered body
        self._answering: asyncio.Future[Any] | None = None  # the answer in progress
        self._starting = False  # within _start
        self._waiting_since = 0.0  # when a head began to arrive (0: none is arriving)
        self._last_byte = 0.0  # when the last byte of a pending body came
        self._idle_since = self._loop.time()
        self._closing = False  # answer what is in progress, then close
        self._eof = False  # the client sent all it will send
        self._paused = False
        self._own_host: bytes | None = None  # the last Host header found to be this node's

    # --- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self._lanes.made(self, transport)  # type: ignore[arg-type]

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lanes.lost(self)
        add = self._pending
        if self._answering is None and add is not None:  # gone in the middle of a body
            self._give_back()
            log.info("client hung up during POST %s: %s", add.path, exc or "connection closed")
            self._lanes.metrics.observe_request("POST", add.route, CLIENT_CLOSED_REQUEST, 0.0)
        self._transport = None

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._pending is not None:
            self._last_byte = self._loop.time()
        if self._answering is None:
            self._next()
        elif len(self._buffer) > READ_AHEAD and not self._paused and self._transport:
            self._paused = True
            self._transport.pause_reading()

    def eof_received(self) -> bool:
        # The client sent all it will: answer what is complete, then close.
        self._eof = True
        if self._answering is None:
            self._next()
        return True  # keep the transport open for the answer; closed after it

    # --- the runner's shutdown (aiohttp calls these on every connection) -------------------

    def close(self) -> None:
        self._closing = True
        if self._answering is None and self._transport is not None:
            self._transport.close()

    async def shutdown(self, timeout: float | None) -> None:  # noqa: ASYNC109 (aiohttp's signature)
        self._closing = True
        if self._answering is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._answering), timeout)
        if self._transport is not None:
            self._transport.close()

    # --- requests ------------------------------------------------------------------------

    def _next(self) -> None:
        """Answer the request at the head of the buffer if it is complete, hand the
        connection to aiohttp if it is not an add, or wait for more bytes."""
        transport = self._transport
        if transport is None:
            return
        buffer = self._buffer
        add = self._pending
        if add is None:
            if not buffer:
                self._waiting_since = 0.0
                self._idle_since = self._loop.time()
                if self._closing or self._eof:
                    transport.close()
                return
            head_end = buffer.find(b"\r\n\r\n", 0, MAX_HEAD + 4)
            if head_end < 0:
                if len(buffer) > MAX_HEAD:
                    self._hand_off()
                elif self._closing or self._eof:
                    transport.close()  # a partial head and no more to come
                elif not self._waiting_since:
                    self._waiting_since = self._loop.time()
                return
            add = parse_add(buffer, head_end)
            if add is None or not self._admitted(add):
                self._hand_off()
                return
            self._pending = add
            self._last_byte = self._loop.time()
        end = add.body_at + add.length
        if len(buffer) < end:
            if self._closing or self._eof:
                transport.close()  # a partial body and no more to come
            return
        body = bytes(buffer[add.body_at : end])
        del buffer[:end]
        self._pending = None
        self._waiting_since = 0.0
        self._start(add, body)

    def _admitted(self, add: _Add) -> bool:
        """Whether the lane takes the add: aiohttp answers the rest (refusals included)."""
        lanes = self._lanes
        if add.length > lanes.max_body or not self._same_site(add):
            return False
        router = lanes.router
        if add.route is STREAM_ROUTE and router is not None and not router.owns(add.key.decode()):
            return False
        expected = add.headers.get(_EXPECT_NODE)
        if expected is not None and _header(add, _EXPECT_NODE) != lanes.node_id:
            return False  # aiohttp's middleware answers 421 wrong_node
        token = lanes.admin_token
        if token is not None and token_refusal(_header(add, b"authorization"), token):
            return False  # aiohttp's route answers the refusal
        budget = lanes.budget
        if budget.in_use + add.length > budget.capacity:
            return False  # aiohttp waits for room (request_budget_wait_s), then says 503
        budget.in_use += add.length
        self._held = add.length
        lanes.metrics.request_body_bytes.set(budget.in_use)
        return True

    def _same_site(self, add: _Add) -> bool:
        """No Origin (a page's request: aiohttp judges it and answers CORS) and a Host of
        this node's (crosssite.py)."""
        if b"origin" in add.headers:
            return False
        host = add.headers.get(b"host")
        if host is None or host == self._own_host:
            return True
        assert self._transport is not None
        sockname = self._transport.get_extra_info("sockname")
        if not self._lanes.guard.host_allowed(host.decode("latin-1"), sockname):
            return False
        self._own_host = host
        return True

    def _give_back(self) -> None:
        if self._held:
            budget = self._lanes.budget
            budget.give_back(self._held)
            self._held = 0
            self._lanes.metrics.request_body_bytes.set(budget.in_use)

    def _hand_off(self) -> None:
        """From here on aiohttp serves the connection, starting with the buffered bytes."""
        transport = self._transport
        assert transport is not None and self._answering is None
        self._give_back()
        self._lanes.lost(self)
        handler = self._lanes.aiohttp_handler()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        data, self._buffer = bytes(self._buffer), bytearray()
        self._transport = None
        if self._paused:
            transport.resume_reading()
        if data:
            handler.data_received(data)
        if self._eof:
            handler.eof_received()

    def _start(self, add: _Add, body: bytes) -> None:
        """Answer ``add``: one raw entry for a ledger without a task or a coroutine (the hot
        path: a callback on its WAL write), anything else in a task."""
        started = time.perf_counter()
        given = add.headers.get(b"x-request-id", b"").decode("latin-1")
        rid = given if valid_client_request_id(given) else next_request_id()
        context = logs.request_id.set(rid)
        self._starting = True
        try:
            if add.route is LEDGER_ROUTE and _content_type(add) in RAW_CONTENT_TYPES:
                app = self._lanes.app
                replicated = _REPLICATED in add.headers
                try:
                    if replicated:
                        pending = ledgers.begin_replica_add(app, int(add.key), _getter(add), body)
                    else:
                        pending = ledgers.begin_add(app, int(add.key), _token(add), body)
                except Exception as e:
                    self._respond(add, rid, started, *_failure(e, add.path))
                    return
                if pending is not None:
                    self._answering = pending.future
                    finish = ledgers.finish_replica_add if replicated else ledgers.finish_add
                    pending.future.add_done_callback(
                        functools.partial(self._finish, add, rid, started, pending, finish)
                    )
                    return
            self._answering = self._loop.create_task(self._answer(add, body, rid, started))
        finally:
            self._starting = False
            logs.request_id.reset(context)

    def _finish(
        self,
        add: _Add,
        rid: str,
        started: float,
        pending: PendingAdd,
        finish: Callable[[web.Application, PendingAdd, float], bytes],
        _done: object,
    ) -> None:
        context = logs.request_id.set(rid)
        try:
            status, reply = 201, finish(self._lanes.app, pending, started)
        except Exception as e:
            status, reply = _failure(e, add.path)
        self._respond(add, rid, started, status, reply)
        logs.request_id.reset(context)

    async def _answer(self, add: _Add, body: bytes, rid: str, started: float) -> None:
        logs.request_id.set(rid)  # the task runs in a copy of the context _start set it in
        extra = b""
        try:
            reply, duplicate = await self._add(add, body)
            status = 201
            if duplicate:
                status, extra = 200, _DUPLICATE
        except Exception as e:
            status, reply = _failure(e, add.path)
        self._respond(add, rid, started, status, reply, extra)

    def _respond(
        self, add: _Add, rid: str, started: float, status: int, reply: bytes, extra: bytes = b""
    ) -> None:
        lanes = self._lanes
        self._give_back()
        if status == 503:
            extra += b"Retry-After: %s\r\n" % RETRY_AFTER_S.encode()
        close = self._closing or b"close" in add.headers.get(b"connection", b"").lower()
        if close:
            extra += b"Connection: close\r\n"
        transport = self._transport
        if transport is None or transport.is_closing():
            status = CLIENT_CLOSED_REQUEST  # nobody is left to answer (as aiohttp counts it)
        else:
            transport.write(
                b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
                b"Date: %s\r\nServer: %s\r\nX-Request-Id: %s\r\n%s%s\r\n%s"
                % (
                    status,
                    PHRASES[status],
                    _JSON_CONTENT_TYPE,
                    len(reply),
                    http_date(),
                    SERVER_HEADER,
                    rid.encode(),
                    lanes.node_id_header,
                    extra,
                    reply,
                )
            )
        elapsed = time.perf_counter() - started
        lanes.metrics.observe_request("POST", add.route, status, elapsed)
        access_log("POST", add.path, status, elapsed)
        self._answering = None
        if transport is None:
            return
        if close:
            self._closing = True
            transport.close()
            return
        if self._paused:
            self._paused = False
            transport.resume_reading()
        if self._starting:
            # Answered within _start (refused at once): go on from the loop, not by
            # recursion, or a client pipelining refused requests would deepen the stack.
            self._loop.call_soon(self._next)
        else:
            self._next()

    async def _add(self, add: _Add, body: bytes) -> tuple[bytes, bool]:
        """The reply, and whether it answers a duplicate append (node.streams.dedup)."""
        app = self._lanes.app
        if add.route is LEDGER_ROUTE:
            if _REPLICATED in add.headers:
                return await ledgers.replica_add(
                    app, int(add.key), _content_type(add), _getter(add), body
                ), False
            return await ledgers.add(
                app, int(add.key), _content_type(add), _token(add), body
            ), False
        headers = add.headers
        producer = streams.NO_PRODUCER
        if _PRODUCER in headers or _SEQUENCE in headers:
            producer = _optional(add, _PRODUCER), _optional(add, _SEQUENCE)
        return await streams.add(app, add.key.decode(), _content_type(add), body, producer)

    def check_timeouts(self, now: float) -> None:
        """The sweep's visit: close what waited too long (as aiohttp's timeouts do)."""
        transport = self._transport
        if transport is None or self._answering is not None:
            return
        lanes = self._lanes
        if self._pending is not None:
            if now - self._last_byte > lanes.body_timeout:
                self._time_out_body(self._pending)
        elif self._waiting_since:
            if now - self._waiting_since > lanes.header_timeout:
                log.info(
                    "closed a connection: no complete request head in %s s", lanes.header_timeout
                )
                transport.close()
        elif now - self._idle_since > lanes.keepalive_timeout:
            transport.close()

    def _time_out_body(self, add: _Add) -> None:
        """408 through the usual answer, which closes the connection after it (the rest of
        the body will not come) and gives the budget back."""
        timeout = self._lanes.body_timeout
        self._pending = None  # answered: its hang-up is no client abort
        self._closing = True
        reply = error_body("body_timeout", f"no byte of the body came for {timeout} s")
        self._respond(add, next_request_id(), time.perf_counter() - timeout, 408, reply)
