"""Read replies (stream, cursor and ledger range reads) bounded in bytes, under a node-wide
budget.

Without this a read gathered all it was asked for: 10,000 entries of 100 KiB made a reply of
1 GiB, built three times over (the payloads, their frames, the frames joined), and four such
reads at once passed 12 GB of RSS. Here:

- a reply holds at most ``max_read_reply_bytes`` of frames (an entry larger than that goes
  alone); one cut short there says so with ``X-Truncated: true``, and where to go on:
  ``X-Next-Position`` for streams and cursors, ``X-Next-Entry-Id`` for ledger ranges;
- the frames take their bytes from a node-wide budget, ``max_read_bytes_in_flight``, as
  the entries are read (like request bodies, node/http/bodies.py, in a budget of their own,
  so that reads and adds never starve each other). A reply that finds no room ends there,
  cut as above; one that holds nothing yet waits ``request_budget_wait_s`` for room, then
  gets 503 ``overloaded`` with ``Retry-After``. A long poll holds nothing while it waits;
- the bytes go back once the reply is written to the socket. A client that stops taking
  its reply for ``reply_write_timeout_s`` has its connection closed, so that it cannot hold
  budget for ever.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from types import TracebackType

from aiohttp import web

from node.http.errors import ApiError
from node.http.rawreply import write_whole
from node.http.state import READ_BUDGET, SETTINGS
from node.settings import MiB

log = logging.getLogger(__name__)

TRUNCATED_HEADER = "X-Truncated"  # "true" on a reply the byte bound or the budget cut short
# The budget is taken in steps of at least this much: fewer takes than entries.
BUDGET_STEP = 1 * MiB
WRITE_CHUNK = 256 * 1024  # frames are gathered into writes of about this size
# A reply up to this size, written to a transport with nothing pending, never waits on the
# client: asyncio's transports pause their writers above 64 KiB.
UNBLOCKED_REPLY = 64 * 1024


class ReplyBytes:
    """The frames of one read reply, against the reply's bound and the node's read budget;
    an async context manager that gives the budget back at its end."""

    def __init__(self, app: web.Application, frame_header: int) -> None:
        settings = app[SETTINGS]
        self._budget = app[READ_BUDGET]
        self._bound = settings.max_read_reply_bytes
        self._wait_s = settings.request_budget_wait_s
        self._frame_header = frame_header
        self.size = 0  # bytes of the frames admitted
        self._held = 0  # bytes taken from the budget, at least ``size``
        self.cut = False  # an entry was left out: more may be read from where it ends

    async def admit(self, payload_size: int) -> bool:
        """Whether the frame of an entry of ``payload_size`` bytes goes into the reply;
        False ends the reply before it (and marks it cut)."""
        size = self.size + self._frame_header + payload_size
        if self.size and size > self._bound:
            self.cut = True
            return False
        if size > self._held:
            # Never more than the reply can use: the bound, or its one larger entry.
            step = min(max(size - self._held, BUDGET_STEP), max(size, self._bound) - self._held)
            if not self._budget.try_take(step):
                if self.size:  # no waiting with entries in hand: they go as they are
                    self.cut = True
                    return False
                if not await self._budget.take(step, self._wait_s):
                    raise ApiError(
                        503,
                        "overloaded",
                        f"read replies in flight fill max_read_bytes_in_flight "
                        f"({self._budget.capacity} bytes); retry shortly",
                    )
            self._held += step
        self.size = size
        return True

    async def __aenter__(self) -> ReplyBytes:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._budget.give_back(self._held)
        self._held = 0


async def send(
    request: web.Request,
    reply: ReplyBytes,
    content_type: str,
    pieces: Iterable[bytes],
    headers: dict[str, str],
) -> web.StreamResponse:
    """Write the reply's frames (``pieces``: frame headers and payloads, in order), a chunk
    at a time; the reply's budget is held until they are written."""
    if reply.cut:
        headers[TRUNCATED_HEADER] = "true"
    transport = request.transport
    if reply.size <= UNBLOCKED_REPLY and transport and not transport.get_write_buffer_size():
        # It cannot wait on the client: the transport takes it below its high-water mark.
        # So no timer, and one write (single entry reads: either costs a fifth of their CPU).
        body = b"".join(pieces)
        written = write_whole(
            request, 200, [("Content-Type", content_type), *headers.items()], body
        )
        if written is not None:
            return written
        small = web.Response(body=body, headers=headers, content_type=content_type)
        await small.prepare(request)
        await small.write_eof()
        return small
    response = web.StreamResponse(headers=headers)
    response.content_type = content_type
    response.content_length = reply.size
    timeout_s = request.app[SETTINGS].reply_write_timeout_s
    await response.prepare(request)  # the head waits for the first bytes of the body
    try:
        chunk: list[bytes] = []
        size = 0
        for piece in pieces:
            chunk.append(piece)
            size += len(piece)
            if size >= WRITE_CHUNK:
                async with asyncio.timeout(timeout_s):
                    await response.write(b"".join(chunk))
                chunk, size = [], 0
        async with asyncio.timeout(timeout_s):
            await response.write_eof(b"".join(chunk))
    except TimeoutError:
        log.info(
            "%s %s: the client took none of its reply for %s s; closing",
            request.method,
            request.path,
            timeout_s,
        )
        if transport is not None:
            transport.abort()  # its unsent bytes go with it
    return response
