"""Forwarded reads (GETs without a body) and appends over keep-alive HTTP/1.1 connections of
their own, written and read without a client library's per-request machinery: a tailing
consumer on a node that does not own its stream waits on a long poll the node forwards, and a
producer's appends sent to any node cross the same hop; aiohttp's client objects (request,
response, payload, connection) cost each more event-loop time than the hop's socket sends (as
for replica adds: node/client/addpipe.py).

One request at a time on a connection (a long poll holds it; nothing is pipelined behind
one). The answer must carry a Content-Length or chunks (every stream route's does); its head
comes first (``head()``), then its body chunk by chunk (``chunk()``), reading paused while more
than ``BUFFERED_MAX`` bytes wait for the client. A connection goes back to the idle pool
only after a whole answer that did not say ``Connection: close``; one that broke, or whose
caller stopped (a hang-up, a timeout), is closed, so that no stale bytes meet the next
request. Idle connections are closed after ``IDLE_CLOSE_S`` (under the owner's keep-alive).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterable

from node.client.http1 import (
    IDLE_CLOSE_S,
    MAX_ANSWER_HEAD,
    AnswerHead,
    BadAnswer,
    parse_answer_head,
)

BUFFERED_MAX = 256 * 1024  # answer bytes held for a slow client before reading pauses
# A chunked body's framing: what comes next
_SIZE, _DATA, _DATA_END, _TRAILER, _WHOLE = range(5)


class PipeBroken(Exception):
    """The connection broke, or the answer is not one this client reads (no Content-Length,
    not HTTP/1.1), before the whole answer came."""


def request_head(
    target: str, host: str, headers: Iterable[tuple[str, str]], body: bytes | None = None
) -> bytes:
    """A request's head: a GET's, or with ``body`` a POST's (its Content-Length), of
    ``target`` (path and query string, encoded) with ``headers``."""
    method = "GET" if body is None else "POST"
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")


class Pipe(asyncio.Protocol):
    """One keep-alive connection to a node, one request at a time."""

    def __init__(self, pool: Pipes, key: tuple[str, int]) -> None:
        self._pool = pool
        self._key = key
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.idle_since = time.monotonic()
        self._head_buffer = bytearray()
        self._head: asyncio.Future[AnswerHead] | None = None  # the answer's, while one is out
        self._left = -1  # body bytes still to come (-1: the head is not in)
        self._chunked = False  # the body comes in chunks: _left is the current chunk's rest
        self._framing = _SIZE  # chunked: what the bytes in _head_buffer are
        self._closes = False
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None  # chunk() waiting for bytes
        self._error: PipeBroken | None = None

    # --- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        answered = self._head is None or self._head.done()
        closed = "it closed the connection" + ("" if answered else " without answering")
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        self._break(f"the connection failed ({reason})" if exc else closed)
        self._pool.lost(self)

    def eof_received(self) -> bool:
        return False  # nothing more will come: close (connection_lost fails what is out)

    def data_received(self, data: bytes) -> None:
        if self._head is None or self._error is not None:
            self.abort("bytes nobody asked for")  # the stream cannot be trusted any more
            return
        if self._left < 0 and not self._head.done():
            buffer = self._head_buffer
            buffer += data
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > MAX_ANSWER_HEAD:
                    self.abort("an answer head past its limit")
                return
            try:
                head = parse_answer_head(bytes(buffer[:end]), keep_headers=True)
            except BadAnswer as error:
                self.abort(str(error))
                return
            self._closes = head.closes
            data = bytes(buffer[end + 4 :])
            buffer.clear()
            self._chunked = head.length is None
            self._left = 0 if head.length is None else head.length
            self._framing = _SIZE
            self._head.set_result(head)
        if self._chunked:
            self._dechunk(data)
        elif len(data) > self._left:
            self.abort("bytes past the answer's Content-Length")
            return
        elif data:
            self._left -= len(data)
            self._push(data)
        self._wake()

    def _dechunk(self, data: bytes) -> None:
        """Chunked framing (RFC 9112 7.1): the chunks' data go on, their framing does not."""
        if self._framing == _WHOLE and data:
            self.abort("bytes past the answer's last chunk")
            return
        buffer = self._head_buffer
        buffer += data
        while buffer and self._error is None:
            if self._framing == _DATA:
                take = min(len(buffer), self._left)
                self._push(bytes(buffer[:take]))
                del buffer[:take]
                self._left -= take
                if self._left:
                    return
                self._framing = _DATA_END
                continue
            end = buffer.find(b"\r\n")
            if end < 0:
                if len(buffer) > MAX_ANSWER_HEAD:
                    self.abort("a chunk's framing past its limit")
                return
            line = bytes(buffer[:end])
            del buffer[: end + 2]
            if self._framing == _DATA_END:
                if line:
                    self.abort("a chunk longer than its size")
                self._framing = _SIZE
            elif self._framing == _SIZE:
                size = line.partition(b";")[0].strip()
                try:
                    self._left = int(size, 16)
                except ValueError:
                    self.abort(f"a bad chunk size: {size[:20]!r}")
                    return
                self._framing = _DATA if self._left else _TRAILER
            elif not line:  # the empty line after the trailers: the answer is whole
                self._framing = _WHOLE
                if buffer:
                    self.abort("bytes past the answer's last chunk")

    def _push(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > BUFFERED_MAX and self.transport is not None:
            self.transport.pause_reading()
            self._paused = True

    @property
    def _whole(self) -> bool:
        """Whether the answer's body is all in."""
        if self._chunked:
            return self._framing == _WHOLE
        return self._left == 0

    # --- the caller's side -----------------------------------------------------------------

    @property
    def out(self) -> bool:
        """Whether a request is out whose answer was not read whole."""
        return self._head is not None

    def send(self, head: bytes, body: bytes = b"") -> None:
        assert self.transport is not None and self._head is None
        self._head = self._loop.create_future()
        if body:
            self.transport.writelines((head, body))  # one send, the body not copied
        else:
            self.transport.write(head)

    async def head(self) -> AnswerHead:
        """The answer's head, once in."""
        assert self._head is not None
        return await self._head

    async def chunk(self) -> bytes:
        """The next piece of the body; b"" once it is whole (the connection then goes back
        to the pool, or is closed if the answer said so)."""
        while not self._chunks:
            if self._whole:  # even if the connection closed since
                self._done()
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        piece = self._chunks.popleft()
        self._buffered -= len(piece)
        if self._paused and self._buffered <= BUFFERED_MAX and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return piece

    def whole(self) -> bytes | None:
        """The body if it is all in (the usual small answer, come in one read), else None."""
        if not self._whole:
            return None
        body = b"".join(self._chunks) if len(self._chunks) != 1 else self._chunks[0]
        self._chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._done()
        return body

    async def body(self) -> bytes:
        """The rest of the body, whole."""
        pieces = []
        while piece := await self.chunk():
            pieces.append(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def abort(self, why: str) -> None:
        """Closes at once: what is out fails (a caller that stopped waiting calls this)."""
        self._break(why)
        if self.transport is not None:
            self.transport.abort()

    def _done(self) -> None:
        self._head = None
        self._left = -1
        self._chunked = False
        if self._closes or self.transport is None:
            self.abort("the answer closed the connection")
        else:
            self._pool.idle(self)

    def _break(self, why: str) -> None:
        if self._error is None:
            self._error = PipeBroken(why)
        if self._head is not None and not self._head.done():
            self._head.set_exception(self._error)
            self._head.exception()  # its caller may have stopped waiting: no warning then
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Pipes:
    """The idle pipes of one node to every other node, LIFO (the warmest)."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[Pipe]] = {}
        self._busy: set[Pipe] = set()

    async def connection(self, host: str, port: int) -> Pipe:
        """An idle connection to ``host``:``port``, else a new one (OSError if refused)."""
        key = host, port
        idle = self._idle.get(key, [])
        now = time.monotonic()
        while idle:
            pipe = idle.pop()
            if pipe.transport is not None and now - pipe.idle_since < IDLE_CLOSE_S:
                self._busy.add(pipe)
                return pipe
            pipe.abort("idle")
        loop = asyncio.get_running_loop()
        _transport, pipe = await loop.create_connection(lambda: Pipe(self, key), host, port)
        if pipe.transport is None:
            raise ConnectionResetError("the connection closed at once")
        self._busy.add(pipe)
        return pipe

    def idle(self, pipe: Pipe) -> None:
        self._busy.discard(pipe)
        pipe.idle_since = time.monotonic()
        self._idle.setdefault(pipe._key, []).append(pipe)

    def lost(self, pipe: Pipe) -> None:
        self._busy.discard(pipe)
        idle = self._idle.get(pipe._key)
        if idle is not None and pipe in idle:
            idle.remove(pipe)

    def close(self) -> None:
        for pipe in [*self._busy, *(p for idle in self._idle.values() for p in idle)]:
            pipe.abort("the node stops")
        self._idle.clear()
        self._busy.clear()
