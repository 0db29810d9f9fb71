"""Replica adds over persistent HTTP/1.1 connections of their own, written and read without a
client library's per-request machinery (aiohttp's request, response, payload and connection
objects cost a replicated append more event-loop time than the add's socket send itself).

Per node a pool of up to ``connections`` keep-alive connections. An add takes an idle one,
else opens one, else is pipelined on the least busy one (up to ``depth`` requests out on a
connection; past that it waits for an answer): a node answers a connection's requests in
order (HTTP/1.1), so the n-th answer read is the n-th request's. Only a complete answer
settles its request: a connection that breaks, or ends an answer short, fails every request
still out on it as ``unreachable`` (unknown: the node may have stored them), never as
success. A request whose caller stopped waiting (its timeout) still has its answer read, to
keep the order; its connection takes no more requests and closes once drained (what is
queued behind a slow answer would wait for it). A connection with a request out longer than
``request_timeout_s`` is closed (the backstop; callers time their adds themselves)."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

from node.client.errors import ReplicaError
from node.client.http1 import IDLE_CLOSE_S, MAX_ANSWER_HEAD, BadAnswer, parse_answer_head

# How often connections with requests out are checked against the backstop timeout.
SWEEP_INTERVAL_S = 1.0
# A body at least this large is written after the head rather than joined to it (a copy).
JOIN_LIMIT = 64 * 1024

UNREACHABLE = "unreachable"  # connection refused or reset, no (complete) answer
BAD_ANSWER = "bad_answer"  # an answer that is not HTTP/1.1 as the nodes send it

Answer = tuple[int, bytes]  # status, body


class _Connection(asyncio.Protocol):
    """One keep-alive connection: its requests out, in order, and the answer being read."""

    def __init__(self, pool: _NodePool) -> None:
        self._pool = pool
        self.transport: asyncio.Transport | None = None
        self.out: collections.deque[tuple[asyncio.Future[Answer], float]] = collections.deque()
        self.reusable = True  # takes new requests
        self.idle_since = time.monotonic()
        self._buffer = bytearray()
        self._status = 0
        self._length = -1  # the body length of the answer being read (-1: its head is not in)
        self._closes = False  # the answer being read says Connection: close

    # --- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        self.reusable = False
        failed = bool(self.out)
        self._fail(f"connection lost: {exc!r}" if exc else "connection closed by the node")
        self._pool.lost(self, failed or exc is not None)

    def eof_received(self) -> bool:
        return False  # nothing more will come: close (connection_lost fails what is out)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while self.out:
            if self._length < 0:
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(buffer) > MAX_ANSWER_HEAD:
                        self.abort(BAD_ANSWER, "an answer head past its limit")
                    return
                if not self._head(bytes(buffer[:end])):
                    return
                del buffer[: end + 4]
            if len(buffer) < self._length:
                return
            body = bytes(buffer[: self._length])
            del buffer[: self._length]
            self._length = -1
            future, _sent = self.out.popleft()
            if not future.done():
                future.set_result((self._status, body))
            if self._closes:
                self.reusable = False  # the node closes after this answer
            self._pool.answered(self)
        if buffer:  # an answer nobody asked for: the stream cannot be trusted
            self.abort(BAD_ANSWER, "bytes past the answers of the requests sent")

    def _head(self, head: bytes) -> bool:
        """Takes an answer's status, length and Connection from its head; False (and the
        connection aborted) when it is not an answer of a known length."""
        try:
            answer = parse_answer_head(head)
        except BadAnswer as error:
            self.abort(BAD_ANSWER, str(error))
            return False
        if answer.length is None:  # the nodes' answers to adds all carry a Content-Length
            self.abort(BAD_ANSWER, "an answer without a Content-Length")
            return False
        self._status, self._length, self._closes = answer.status, answer.length, answer.closes
        return True

    # --- the pool's side -------------------------------------------------------------------

    def send(self, head: bytes, body: bytes) -> asyncio.Future[Answer]:
        assert self.transport is not None
        future: asyncio.Future[Answer] = self._pool.loop.create_future()
        self.out.append((future, time.monotonic()))
        if len(body) < JOIN_LIMIT:
            self.transport.write(head + body)  # one send
        else:
            self.transport.write(head)
            self.transport.write(body)
        return future

    def stopped_waiting(self) -> None:
        """A caller stopped waiting for its answer (its timeout): what is sent after it would
        wait for that answer too, so the connection takes no more; closed at once when no
        other caller waits on it (as a client library closes a connection it gave up on)."""
        self.reusable = False
        if all(future.done() for future, _sent in self.out):
            self.abort(UNREACHABLE, "the caller stopped waiting")
        self._pool.answered(self)

    def abort(self, code: str, message: str) -> None:
        """Closes at once, failing every request out with ``code``."""
        self.reusable = False
        if self.out:
            self._pool.owner.unreachable(self._pool.node_id)
        self._fail(message, code)
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, message: str, code: str = UNREACHABLE) -> None:
        node = self._pool.node_id
        while self.out:
            future, _sent = self.out.popleft()
            if not future.done():
                future.set_exception(ReplicaError(node, code, 0, message))
                future.exception()  # its caller may have stopped waiting: no warning then


class _NodePool:
    """The connections to one node."""

    def __init__(self, owner: AddPipes, node_id: str) -> None:
        self.owner = owner
        self.node_id = node_id
        self.loop = asyncio.get_running_loop()
        self.connections: list[_Connection] = []
        self.opening = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def _least_busy(self) -> tuple[_Connection | None, int]:
        """The usable connection with the fewest requests out, and how many are usable (one
        that takes no more requests leaves its place; one idle too long is closed here)."""
        best: _Connection | None = None
        usable = 0
        now = time.monotonic()
        for conn in list(self.connections):
            if not conn.reusable:
                continue
            if not conn.out and now - conn.idle_since > IDLE_CLOSE_S:
                conn.abort(UNREACHABLE, "idle")
                continue
            usable += 1
            if best is None or len(conn.out) < len(best.out):
                best = conn
        return best, usable

    def idle(self) -> _Connection | None:
        """A usable connection with no request out, or None (no waiting, no opening)."""
        best, _usable = self._least_busy()
        return best if best is not None and not best.out else None

    async def connection(self, host: str, port: int) -> _Connection:
        """A connection with room for one more request (opened, chosen or waited for)."""
        owner = self.owner
        while True:
            best, usable = self._least_busy()
            if best is not None and not best.out:
                return best
            if usable + self.opening < owner.connections:
                return await self._open(host, port)
            if best is not None and len(best.out) < owner.depth:
                return best
            waiter = self.loop.create_future()
            self.waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self.waiters:
                    self.waiters.remove(waiter)

    async def _open(self, host: str, port: int) -> _Connection:
        self.opening += 1
        try:
            _transport, conn = await self.loop.create_connection(
                lambda: _Connection(self), host, port
            )
        except OSError as error:
            self.owner.unreachable(self.node_id)
            raise ReplicaError(self.node_id, UNREACHABLE, 0, repr(error)) from None
        finally:
            self.opening -= 1
            self._wake()
        if conn.transport is None:  # closed before it could be used
            raise ReplicaError(self.node_id, UNREACHABLE, 0, "connection closed at once")
        self.connections.append(conn)
        self.owner.watch()
        return conn

    def answered(self, conn: _Connection) -> None:
        if not conn.out:
            conn.idle_since = time.monotonic()
            if not conn.reusable and conn.transport is not None:
                conn.transport.close()
        self._wake()

    def lost(self, conn: _Connection, failed: bool) -> None:
        if conn in self.connections:
            self.connections.remove(conn)
        if failed:
            self.owner.unreachable(self.node_id)
        self._wake()

    def _wake(self) -> None:
        """Every waiter looks again (few ever wait: only past connections x depth)."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def sweep(self, now: float, timeout_s: float) -> None:
        """Closes connections whose oldest request is older than ``timeout_s``, and those
        idle too long or drained after a caller stopped waiting."""
        for conn in list(self.connections):
            if conn.out:
                if now - conn.out[0][1] > timeout_s:
                    conn.abort(UNREACHABLE, f"no answer in {timeout_s} s")
            elif not conn.reusable or now - conn.idle_since > IDLE_CLOSE_S:
                conn.abort(UNREACHABLE, "idle")

    def close(self) -> None:
        for conn in list(self.connections):
            conn.abort(UNREACHABLE, "the client closed")
        self.connections.clear()
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(ReplicaError(self.node_id, UNREACHABLE, 0, "client closed"))
                waiter.exception()


class Sent:
    """A request written on a connection: ``future`` is the node's answer to it; whoever
    gives up on it calls ``stop_waiting`` (``answer`` does both)."""

    __slots__ = ("_conn", "future")

    def __init__(self, conn: _Connection, head: bytes, body: bytes) -> None:
        self._conn = conn
        self.future = conn.send(head, body)

    def stop_waiting(self) -> None:
        self._conn.stopped_waiting()

    async def answer(self) -> Answer:
        try:
            return await self.future
        except asyncio.CancelledError:
            self.stop_waiting()
            raise


class AddPipes:
    """The replica-add connections of one client, to every node. ``unreachable(node_id)`` is
    called when a connection to the node fails (the registry forgets its address)."""

    def __init__(
        self,
        *,
        connections: int,
        depth: int,
        request_timeout_s: float,
        unreachable: Callable[[str], None],
    ) -> None:
        self.connections = connections
        self.depth = depth
        self._timeout_s = request_timeout_s
        self.unreachable = unreachable
        # By node id and address: a node that moved is a new pool (the old one's connections
        # drain and close as idle), never a request to its old address.
        self._pools: dict[tuple[str, str, int], _NodePool] = {}
        self._sweep: asyncio.TimerHandle | None = None

    async def request(self, node_id: str, host: str, port: int, head: bytes, body: bytes) -> Answer:
        """The node's answer (status, body) to ``head`` and ``body``, sent on one of its
        connections; ReplicaError ``unreachable`` when no complete answer came."""
        key = node_id, host, port
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _NodePool(self, node_id)
        conn = await pool.connection(host, port)
        return await Sent(conn, head, body).answer()

    def send_now(self, node_id: str, host: str, port: int, head: bytes, body: bytes) -> Sent | None:
        """``request``'s first half: the request written before this returns, on an open
        connection with nothing out. None when there is none (``request`` then opens one or
        waits)."""
        pool = self._pools.get((node_id, host, port))
        conn = None if pool is None else pool.idle()
        return None if conn is None else Sent(conn, head, body)

    def watch(self) -> None:
        if self._sweep is None:
            loop = asyncio.get_running_loop()
            self._sweep = loop.call_later(SWEEP_INTERVAL_S, self._check)

    def _check(self) -> None:
        self._sweep = None
        now = time.monotonic()
        for key, pool in list(self._pools.items()):
            pool.sweep(now, self._timeout_s)
            if not pool.connections and not pool.opening and not pool.waiters:
                del self._pools[key]
        if self._pools:
            self.watch()

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
