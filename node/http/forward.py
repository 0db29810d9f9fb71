"""One hop to a stream's owner: a node that does not own a stream passes the request on.

With a metadata store every node answers every stream route, but one node owns each stream
(``stream-owners/<name>``). A node that is not the owner sends the request, as it came, to
the owner's URL and streams the owner's answer back: plain HTTP clients need to know
nothing of ownership. The forwarded request carries ``X-Forwarded-By: <node id>``; a
request that carries it and still reaches a non-owner is refused (503 ``not_owner``) by
the caller rather than sent on: ownership is moving, and a second hop could go round in a
circle.

What goes to the owner: the method, the path and query string as they were received (not
re-encoded), the body, and the client's headers but the hop-by-hop ones (RFC 9110 7.6.1:
Connection and the headers it names, Keep-Alive, Transfer-Encoding, TE, Trailer, Upgrade,
Proxy-*), Host and Content-Length (the owner's, recomputed), ``X-Expect-Node`` (it named
this node, which checked it; the owner would answer 421), ``Expect`` (this node answered
it and holds the body) and ``X-Request-Id`` (this node's id for the request, so that both
nodes' logs name it alike). Authorization passes unchanged: the owner checks the admin
token as this node did.

What comes back: the owner's status, its headers but the hop-by-hop ones, and its body.
An answer of a known length up to ``WHOLE_ANSWER_MAX`` (64 KiB: a tail read's, an append's,
an error) is read whole and written to the client at once, before the handler returns (the
middlewares' metrics and log line come after it); a larger one streams chunk by chunk as it
arrives (a read can hold ``max_read_reply_bytes`` of frames: nothing large is held whole).
The owner's own errors (404, 409, a 503 of its own) pass through as it gave them.

The client: reads (GETs without a body, long polls among them) and appends go over keep-alive
connections of their own (forwardpipe.py: a tailing consumer's entries and a producer's
appends cross this hop, and aiohttp's client objects cost each more event-loop time than the
hop's sends); every other request goes through aiohttp's pooled client.

When the owner does not answer: no connection (refused, unreachable, the connect timeout)
or, for any request but an append, a connection that broke or stayed silent before the
answer (its head; or its whole body, when read whole) -> 503 ``owner_unreachable``
(retryable: the owner's lease runs out, another node takes the stream over). A refused
connection to an owner the node remembered is asked about once more first (the stream
routes): an owner that stopped cleanly revoked its lease, and the node asked takes the
stream over at once. An append (``POST .../entries``) whose
connection broke or timed out after it was sent may have been appended by the owner: 503
``append_outcome_unknown``, never "failed" (a retry may append it twice). A break in the
middle of a streamed answer's body aborts the client's connection: the client sees a
truncated answer, never a complete-looking wrong one.

Timeouts: a connection within ``stream_forward_connect_timeout_s``; then the owner may be
silent ``stream_forward_timeout_s``, plus a long poll's ``waitMs`` (at most
``max_long_poll_ms``), before the head of its answer and between its chunks. Nothing bounds
the whole: a large answer to a slow client is bounded by ``reply_write_timeout_s``.

Replicated streams' appends take aiohttp's route, not the fast lane (fastlane.py), so that
``forward`` is the one place that sends requests on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Final, Protocol, TypeVar

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from node import logs
from node.client.http1 import AnswerHead, address
from node.client.protocol import EXPECT_NODE_HEADER
from node.http.connections import cancelled_on_hangup
from node.http.errors import ApiError
from node.http.forwardpipe import Pipe, PipeBroken, Pipes, request_head
from node.http.middleware import REQUEST_ID_HEADER
from node.http.rawreply import write_whole
from node.http.replies import UNBLOCKED_REPLY
from node.http.state import METRICS, SETTINGS
from node.metrics import Metrics
from node.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")

FORWARDED_BY: Final = "X-Forwarded-By"
OWNER_UNREACHABLE: Final = "owner_unreachable"
APPEND_OUTCOME_UNKNOWN: Final = "append_outcome_unknown"
NOT_OWNER: Final = "not_owner"
OUTCOMES = ("ok", "unreachable", "unknown")  # storage_node_stream_forwarded_requests_total

# Hop-by-hop headers (RFC 9110 7.6.1, with the obsolete Proxy-Connection), Host and
# Content-Length (each hop's own); any Proxy-* header is dropped too.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "host",
        "content-length",
    }
)
# This node's business, not the owner's: X-Expect-Node named this node (checked by the
# middleware); Expect: 100-continue was answered here, and the body is in hand (sent on, it
# would cost a round trip waiting for the owner's 100); X-Forwarded-By and X-Request-Id are
# set here.
_REQUEST_ONLY = frozenset(
    {EXPECT_NODE_HEADER.lower(), "expect", FORWARDED_BY.lower(), REQUEST_ID_HEADER.lower()}
)
# aiohttp's client adds these when absent: the owner must see what the client sent, no more
# (a missing Content-Type is a 415 there, not an octet-stream append).
_NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
# Idle pooled connections to owners are closed after this: well under the nodes'
# keepalive_timeout_s (75 s), so that a node never reuses one its owner is closing.
POOL_KEEPALIVE_S = 15.0
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# An answer up to this size is read whole and passed on in one write (a 503 to see whether it
# says not_owner); a larger one streams. Below asyncio's 64 KiB high-water mark: the write of
# one never waits on the client (node/http/replies.py).
WHOLE_ANSWER_MAX = UNBLOCKED_REPLY


def forwarded(request: web.BaseRequest) -> bool:
    """Whether the request came from another node already (one hop at most: a non-owner
    answers it 503 ``not_owner`` instead of sending it on)."""
    return FORWARDED_BY in request.headers


def is_append(method: str, path: str) -> bool:
    """An append (``POST /api/v1/streams/{name}/entries``): the one stream request that is
    not idempotent, whose lost answer leaves its outcome unknown."""
    return method == "POST" and path.partition("?")[0].endswith("/entries")


def _end_to_end(headers: Iterable[tuple[str, str]], also: frozenset[str]) -> CIMultiDict[str]:
    """``headers`` without the hop-by-hop ones (those Connection names too) and ``also``;
    every value of a repeated header kept, in order."""
    items = list(headers)
    named = {
        token.strip().lower()
        for name, value in items
        if name.lower() == "connection"
        for token in value.split(",")
    }
    kept: CIMultiDict[str] = CIMultiDict()
    for name, value in items:
        key = name.lower()
        if key in HOP_BY_HOP or key in named or key in also or key.startswith("proxy-"):
            continue
        kept.add(name, value)
    return kept


def request_headers(headers: Iterable[tuple[str, str]], node_id: str) -> CIMultiDict[str]:
    """The client's headers as the owner gets them."""
    kept = _end_to_end(headers, _REQUEST_ONLY)
    kept[FORWARDED_BY] = node_id
    rid = logs.request_id.get()
    if rid:
        kept[REQUEST_ID_HEADER] = rid
    return kept


def response_headers(headers: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    """The owner's answer's headers as the client gets them."""
    return _end_to_end(headers, frozenset())


def _wait_s(target: str, settings: Settings) -> float:
    """How long the owner may hold the request before its answer begins, beyond the usual:
    a long poll's ``waitMs`` (at most ``max_long_poll_ms``; one the owner will refuse
    counts as the longest, which costs nothing since the refusal is immediate)."""
    query = URL(target, encoded=True).query
    longest = settings.max_long_poll_ms / 1000
    given = query.get("waitMs")
    if given is None:
        return 0.0
    return min(int(given), settings.max_long_poll_ms) / 1000 if given.isdigit() else longest


class OwnerMoved(Exception):
    """The node a request was forwarded to answered 503 ``not_owner``: it does not own the
    stream (any more), and did nothing with the request. Safe to send again, appends too,
    once the owner is looked up afresh (a caller that caches owners forgets this one)."""

    def __init__(self, url: str) -> None:
        super().__init__(f"{url} does not own the stream")
        self.url = url


class _NotConnected(Exception):
    """No connection to the owner could be made: nothing was sent."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(repr(error))
        self.error = error


class _OwnerLost(Exception):
    """The node a request was forwarded to lost the stream before it answered."""

    def __str__(self) -> str:
        return "it lost the stream (its lease ended) before answering"


async def _unless(call: Awaitable[T], lost: Awaitable[None]) -> T:
    """``call``'s answer, or _OwnerLost (``call`` cancelled) if ``lost`` comes first.
    ``call`` runs in the caller's task (as asyncio.timeout does): a task of its own and a
    wait on both cost the answer two more turns of a busy event loop."""
    task = asyncio.current_task()
    assert task is not None
    watch = asyncio.ensure_future(lost)
    fired = False

    def on_lost(_: asyncio.Future[None]) -> None:
        nonlocal fired
        fired = True
        task.cancel()

    watch.add_done_callback(on_lost)
    try:
        return await call
    except asyncio.CancelledError:
        if fired and task.uncancel() == 0:
            raise _OwnerLost() from None
        raise
    finally:
        watch.remove_done_callback(on_lost)
        watch.cancel()


def _whole(request: web.Request, answer: _Answer, raise_moved: bool) -> bool:
    """Whether the owner's answer is passed on whole (read, then written at once) rather
    than streamed: one of a known length up to WHOLE_ANSWER_MAX (a tail read's, an append's:
    one write of the reply instead of a head and chunks, the forward's cost on a tail read's
    latency), for a client that has taken all it was sent before (the reply's write cannot
    wait on it; replies.send's rule). A 503 that may say not_owner is read whole whatever
    the client's state: it is not written to the client then."""
    length = answer.length
    if length is None or length > WHOLE_ANSWER_MAX:
        return False
    if raise_moved and answer.status == 503:
        return True
    transport = request.transport
    return transport is not None and not transport.get_write_buffer_size()


class _Answer(Protocol):
    """The owner's answer as the relay reads it: aiohttp's response (_ClientAnswer), or a
    read pipe's (_PipeAnswer). Its body's reads raise _OwnerSilent on a break or a stall."""

    @property
    def status(self) -> int: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def headers(self) -> Iterable[tuple[str, str]]: ...
    @property
    def length(self) -> int | None: ...  # of the body, None when not known ahead (chunked)

    async def body(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...


class _ClientAnswer:
    def __init__(self, answer: aiohttp.ClientResponse) -> None:
        self._answer = answer
        self.status, self.reason = answer.status, answer.reason
        self.headers = answer.headers.items()
        chunked = "chunked" in answer.headers.get("Transfer-Encoding", "").lower()
        self.length = None if chunked else answer.content_length

    async def body(self) -> bytes:
        try:
            return await self._answer.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            raise _OwnerSilent(error) from error

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            try:
                chunk = await self._answer.content.readany()
            except (aiohttp.ClientError, TimeoutError, OSError) as error:
                raise _OwnerSilent(error) from error
            if not chunk:
                return
            yield chunk


class _PipeAnswer:
    """An answer on a read pipe; at most ``silence_s`` between two pieces of its body."""

    def __init__(self, pipe: Pipe, head: AnswerHead, silence_s: float) -> None:
        self._pipe, self._silence_s = pipe, silence_s
        self.status, self.reason, self.headers = head.status, head.reason, head.headers
        self.length = head.length

    async def body(self) -> bytes:
        whole = self._pipe.whole()
        if whole is not None:  # no timer to set and cancel
            return whole
        try:
            async with asyncio.timeout(self._silence_s):
                return await self._pipe.body()
        except (PipeBroken, TimeoutError) as error:
            raise _OwnerSilent(error) from error

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            try:
                async with asyncio.timeout(self._silence_s):
                    chunk = await self._pipe.chunk()
            except (PipeBroken, TimeoutError) as error:
                raise _OwnerSilent(error) from error
            if not chunk:
                return
            yield chunk


def _code(body: bytes) -> str | None:
    """The code of a JSON error body (the node's shape), or None."""
    try:
        found = json.loads(body)
    except ValueError:
        return None
    code = found.get("code") if isinstance(found, dict) else None
    return code if isinstance(code, str) else None


def in_words(error: BaseException) -> str:
    """Why a request to another node got no answer, as an operator reads it: the OS's
    reason or the timeout that ran out, not an exception's repr."""
    if isinstance(error, _NotConnected):
        if isinstance(error.error, OSError) and not isinstance(error.error, TimeoutError):
            return f"could not connect ({_os_reason(error.error)})"
        return in_words(error.error)
    if isinstance(error, aiohttp.ClientConnectorError):
        return f"could not connect ({_os_reason(error.os_error)})"
    if isinstance(error, aiohttp.ConnectionTimeoutError):
        return "could not connect within stream_forward_connect_timeout_s"
    if isinstance(error, TimeoutError):  # aiohttp's read timeouts are TimeoutErrors too
        return "silent for longer than stream_forward_timeout_s"
    if isinstance(error, aiohttp.ServerDisconnectedError):
        return "it closed the connection without answering"
    if isinstance(error, OSError):
        return f"the connection failed ({_os_reason(error)})"
    return str(error) or type(error).__name__


def _os_reason(error: OSError) -> str:
    return os.strerror(error.errno) if error.errno else error.strerror or str(error)


class _OwnerSilent(Exception):
    """The owner's answer broke off or stalled after its head came."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(repr(error))
        self.error = error


class Forwarder:
    """The client side of forwarding, one per node: aiohttp's pooled session (made on the
    app's startup, closed on its cleanup), shared by every forwarded request."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self._settings = settings
        self._node_id = settings.id
        self._session: aiohttp.ClientSession | None = None
        self._pipes = Pipes()
        counter = metrics.stream_forwarded_requests
        # Every outcome's series from the start (0), on the nodes that forward: rate()
        # sees the first failure.
        self._outcomes = {outcome: counter.labels(outcome) for outcome in OUTCOMES}

    def _count(self, outcome: str) -> None:
        self._outcomes[outcome].inc()

    async def start(self) -> None:
        # No bound on connections: each forwarded request holds one of the node's own
        # (max_connections bounds those), and a pool limit would queue appends behind long
        # polls. No total timeout: each request gets its own (_timeout).
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=POOL_KEEPALIVE_S
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,  # bytes pass as the owner sent them, Content-Encoding too
            skip_auto_headers=_NO_AUTO_HEADERS,
            cookie_jar=aiohttp.DummyCookieJar(),  # one client's cookies never reach another
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._pipes.close()

    def _timeout(self, target: str) -> aiohttp.ClientTimeout:
        """Connect within ``stream_forward_connect_timeout_s``; then no silence longer than
        ``stream_forward_timeout_s`` (plus, before the head, the long poll's wait)."""
        settings = self._settings
        return aiohttp.ClientTimeout(
            total=None,
            sock_connect=settings.stream_forward_connect_timeout_s,
            sock_read=settings.stream_forward_timeout_s + _wait_s(target, settings),
        )

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the Forwarder is not started (install(app) starts it)")
        return self._session

    def _failure(
        self, error: BaseException, url: str, append: bool, connected: bool | None = None
    ) -> ApiError:
        """The 503 for an owner that did not answer, counted. ``connected``: whether the
        request may have reached it (by default, any aiohttp error but a failed connect)."""
        if connected is None:
            connected = not isinstance(
                error, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError
            )
        if append and connected:
            self._count("unknown")
            log.warning("append forwarded to %s: no answer (%r); outcome unknown", url, error)
            return ApiError(
                503,
                APPEND_OUTCOME_UNKNOWN,
                f"the stream's owner at {url} did not answer the append: {in_words(error)}; "
                "the append may or may not be in the stream",
            )
        self._count("unreachable")
        log.info("request forwarded to %s: no answer (%r)", url, error)
        return ApiError(
            503,
            OWNER_UNREACHABLE,
            f"the stream's owner at {url} did not answer: {in_words(error)}",
        )

    async def forward(
        self,
        request: web.Request,
        base_url: str,
        *,
        raise_moved: bool = False,
        owner_lost: Callable[[], Awaitable[None]] | None = None,
    ) -> web.StreamResponse:
        """Send ``request`` to the owner at ``base_url`` (``http://host:port``) and stream
        its answer back; 503 ``owner_unreachable`` or ``append_outcome_unknown`` when it
        does not answer. ``raise_moved``: OwnerMoved when that node answers 503 not_owner
        (instead of passing that answer on) or refuses the connection, for a caller that
        remembers owners to ask again. ``owner_lost``: returns once that node no longer owns
        the stream; before the head of the answer, that ends the wait the same way (a paused
        owner's lease runs out long before the forward's timeout)."""
        target = request.raw_path  # path and query string as received, still encoded
        url = base_url.rstrip("/") + target
        append = is_append(request.method, target)
        body = await request.read()
        headers = request_headers(request.headers.items(), self._node_id)
        piped = append or (request.method == "GET" and not body)
        where = address(base_url) if piped else None
        if where is not None:
            piped_body = body if append else None
            return await self._piped(
                request, base_url, where, headers, piped_body, raise_moved, owner_lost
            )
        session = self._open()
        data = body if body or request.method in _BODY_METHODS else None
        # A long poll forwarded ends with its client (as on the owner): the owner's
        # connection closes and its long poll ends too. Appends run to their end.
        hangup = (
            cancelled_on_hangup(request) if request.method == "GET" else contextlib.nullcontext()
        )
        try:
            with hangup:
                sent = session.request(
                    request.method,
                    URL(url, encoded=True),
                    headers=headers,
                    data=data,
                    timeout=self._timeout(target),
                    allow_redirects=False,
                )
                answer = await (sent if owner_lost is None else _unless(sent, owner_lost()))
        except _OwnerLost:
            raise self._failure(_OwnerLost(), base_url, append) from None
        except aiohttp.ClientConnectorError as error:
            # Nothing listens there (the owner stopped; its key may be gone with its lease
            # revoked): nothing was sent, so a caller that remembered it may ask again.
            if raise_moved:
                self._count("unreachable")
                raise OwnerMoved(base_url) from None
            raise self._failure(error, base_url, append) from None
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            raise self._failure(error, base_url, append) from None
        async with answer:
            return await self._answer(request, _ClientAnswer(answer), base_url, append, raise_moved)

    async def _answer(
        self,
        request: web.Request,
        answer: _Answer,
        base_url: str,
        append: bool,
        raise_moved: bool,
    ) -> web.StreamResponse:
        """The owner's answer passed on: a small one read whole, then given as one reply
        (OwnerMoved instead if it says not_owner, with ``raise_moved``: nothing has reached
        the client if the owner breaks off meanwhile, which gets the 503 of an owner that did
        not answer, not a cut answer); any other streamed (_relay)."""
        if not _whole(request, answer, raise_moved):
            return await self._relay(request, answer, base_url)
        try:
            body = await answer.body()
        except _OwnerSilent as error:
            raise self._failure(error.error, base_url, append, connected=True) from None
        self._count("ok")
        if raise_moved and answer.status == 503 and _code(body) == NOT_OWNER:
            raise OwnerMoved(base_url)
        headers = response_headers(answer.headers)
        written = write_whole(request, answer.status, headers.items(), body)
        if written is not None:
            return written
        rid = logs.request_id.get()
        if rid:  # the middleware names only replies not yet prepared; the owner echoed it
            headers[REQUEST_ID_HEADER] = rid
        reply = web.Response(status=answer.status, reason=answer.reason, body=body, headers=headers)
        # Written here, not by aiohttp once the handler and the middlewares have returned
        # (their metrics and logs would come first): a tail read's entry is on its way sooner.
        await reply.prepare(request)
        await reply.write_eof()
        return reply

    async def _piped(
        self,
        request: web.Request,
        base_url: str,
        where: tuple[str, int, bytes],
        headers: CIMultiDict[str],
        body: bytes | None,
        raise_moved: bool,
        owner_lost: Callable[[], Awaitable[None]] | None,
    ) -> web.StreamResponse:
        """``forward`` over a pipe (forwardpipe.py): a GET without a body, or an append
        (``body``; its lost answer is 503 append_outcome_unknown, as over aiohttp's client)."""
        host, port, host_header = where
        target = request.raw_path
        append = body is not None
        settings = self._settings
        pipe: Pipe | None = None
        # As on the owner, a long poll ends with its client: the pipe closes, and the owner's
        # long poll ends too. An append runs to its end.
        hangup = contextlib.nullcontext() if append else cancelled_on_hangup(request)
        try:
            with hangup:
                try:
                    async with asyncio.timeout(settings.stream_forward_connect_timeout_s):
                        pipe = await self._pipes.connection(host, port)
                except TimeoutError:
                    raise _NotConnected(aiohttp.ConnectionTimeoutError()) from None
                except OSError as error:
                    if raise_moved:  # nothing listens there: as forward() says
                        self._count("unreachable")
                        raise OwnerMoved(base_url) from None
                    raise _NotConnected(error) from None
                head = request_head(target, host_header.decode(), headers.items(), body)
                pipe.send(head, body or b"")
                async with asyncio.timeout(
                    settings.stream_forward_timeout_s + _wait_s(target, settings)
                ):
                    answer_head = await (
                        pipe.head() if owner_lost is None else _unless(pipe.head(), owner_lost())
                    )
            answer = _PipeAnswer(pipe, answer_head, settings.stream_forward_timeout_s)
            return await self._answer(request, answer, base_url, append, raise_moved)
        except _NotConnected as error:
            raise self._failure(error, base_url, append, connected=False) from None
        except (PipeBroken, TimeoutError, _OwnerLost) as error:
            raise self._failure(error, base_url, append) from None
        finally:
            if pipe is not None and pipe.out:  # the answer was not read whole: never reused
                pipe.abort("its answer was left unread")

    async def _relay(
        self, request: web.Request, answer: _Answer, base_url: str
    ) -> web.StreamResponse:
        reply = web.StreamResponse(status=answer.status, reason=answer.reason)
        reply.headers.extend(response_headers(answer.headers))
        rid = logs.request_id.get()
        if rid:  # the middleware names only replies not yet prepared; the owner echoed it
            reply.headers[REQUEST_ID_HEADER] = rid
        if answer.length is not None:
            reply.content_length = answer.length  # the client knows when it is whole
        write_timeout_s = self._settings.reply_write_timeout_s
        outcome = "ok"  # the owner answered (a client that then hung up or stalled: still ok)
        try:
            await reply.prepare(request)
            async for chunk in answer.chunks():
                async with asyncio.timeout(write_timeout_s):
                    await reply.write(chunk)
            await reply.write_eof()
        except _OwnerSilent as error:
            outcome = "unreachable"
            log.warning(
                "%s %s: the owner at %s broke off its answer (%s); closing the client's connection",
                request.method,
                request.path,
                base_url,
                error,
            )
            _abort(request)
        except TimeoutError:
            log.info(
                "%s %s: the client took none of its reply for %s s; closing",
                request.method,
                request.path,
                write_timeout_s,
            )
            _abort(request)
        finally:
            self._count(outcome)
        return reply


def _abort(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()  # unsent bytes go with it: the client sees the answer cut


FORWARDER = web.AppKey("forwarder", Forwarder)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    forwarder = app[FORWARDER]
    await forwarder.start()
    yield
    await forwarder.close()


def install(app: web.Application) -> Forwarder:
    """One Forwarder for the app (``app[FORWARDER]``): its session opens on startup and
    closes on cleanup."""
    forwarder = Forwarder(app[SETTINGS], app[METRICS])
    app[FORWARDER] = forwarder
    app.cleanup_ctx.append(_lifecycle)
    return forwarder
