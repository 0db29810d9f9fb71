"""Request bodies under a node-wide memory budget, read against a timeout.

Without this, aiohttp's ``request.read()`` raises the connection's read buffer to
``max_request_size`` and buffers whatever arrives: 40 connections that each declare a 60 MiB
body, send 16 MiB and stop hold 640 MiB (more with the buffer's growth), and nothing ever
times out. Here the memory of bodies is bounded by ``max_request_bytes_in_flight`` whatever
the number of connections:

- a declared ``Content-Length`` above ``max_request_size`` is refused (413) before any of
  the body is read; a route marked ``limited_by(setting)`` has that smaller bound (the audit
  result: a summary of a few KiB, kept and served to anyone);
- a body takes its declared size from the budget before it is read (a chunked body takes it
  as it arrives); when the budget has no room it waits ``request_budget_wait_s``, then gets
  503 with ``Retry-After``. A body that fits goes ahead of bigger ones that wait, so stalled
  large bodies cannot starve small adds;
- a connection whose body is not being read keeps at most aiohttp's read buffer (the
  transport pauses), so waiting bodies cost next to nothing;
- a body that stays silent for ``body_read_timeout_s`` gets 408 and its connection closes;
- a client that hangs up mid-body is a client abort (logged at INFO, counted as 499), not a
  server error.

The body read here is what ``request.read()`` then returns to the handlers; its bytes go
back to the budget when the handler is done with them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from node import logs
from node.http.budget import BodyBudget
from node.http.errors import ApiError, ClientAborted, error_response
from node.http.middleware import REQUEST_ID_HEADER
from node.http.state import BUDGET, METRICS, SETTINGS
from node.settings import MiB, Settings

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# A chunked body takes budget in steps of this much: fewer waits than one per chunk, and
# little more held than the body has.
CHUNKED_BUDGET_STEP = 1 * MiB
LIMIT_ATTRIBUTE = "body_limit_setting"  # on a handler: the setting bounding its body
H = TypeVar("H")


def limited_by(setting: str) -> Callable[[H], H]:
    """Bound the body of the decorated handler by ``setting`` (bytes), refused like one above
    ``max_request_size``; place it under the route decorator."""

    def mark(handler: H) -> H:
        setattr(handler, LIMIT_ATTRIBUTE, setting)
        return handler

    return mark


def _limit(request: web.Request, settings: Settings) -> tuple[str, int]:
    """The setting that bounds this request's body, and its value."""
    name = getattr(request.match_info.handler, LIMIT_ATTRIBUTE, None)
    if name is not None and getattr(settings, name) < settings.max_request_size:
        return name, int(getattr(settings, name))
    return "max_request_size", settings.max_request_size


class _BodyTimedOut(ApiError):
    pass


@web.middleware
async def bounded_body(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Read the request's body (if it has one) within the budget and the timeout; the
    handler's ``request.read()`` returns it."""
    if not request.body_exists:
        return await handler(request)
    settings = request.app[SETTINGS]
    budget = request.app[BUDGET]
    declared = request.content_length
    limit_name, limit = _limit(request, settings)
    if declared is not None and declared > limit:
        raise ApiError(
            413,
            "request_too_large",
            f"the body declares {declared} bytes; {limit_name} is {limit}",
        )
    held = 0
    try:
        if declared:
            held = await _take(request, budget, declared)
            # Its bytes are counted: buffer up to all of them rather than pause the socket
            # every 128 KiB (the body ends at its declared length, so no more can come).
            request.content.set_read_chunk_size(declared)
        chunks: list[bytes] = []
        received = 0
        while chunk := await _next_chunk(request, settings.body_read_timeout_s):
            received += len(chunk)
            if received > limit:  # chunked: no length was declared
                raise ApiError(
                    413,
                    "request_too_large",
                    f"the body passed {limit_name} ({limit} bytes)",
                )
            if received > held:
                step = max(received - held, CHUNKED_BUDGET_STEP)
                held += await _take(request, budget, min(step, limit - held))
            chunks.append(chunk)
        # aiohttp's read() returns what is set here instead of reading (and buffering) again.
        request._read_bytes = b"".join(chunks)
        del chunks
        return await handler(request)
    except _BodyTimedOut as e:
        return await _answer_and_close(request, e)
    finally:
        budget.give_back(held)
        request.app[METRICS].request_body_bytes.set(budget.in_use)


async def _take(request: web.Request, budget: BodyBudget, size: int) -> int:
    settings = request.app[SETTINGS]
    if not await budget.take(size, settings.request_budget_wait_s):
        raise ApiError(
            503,
            "overloaded",
            f"request bodies in flight fill max_request_bytes_in_flight "
            f"({settings.max_request_bytes_in_flight} bytes); retry shortly",
        )
    request.app[METRICS].request_body_bytes.set(budget.in_use)
    return size


async def _next_chunk(request: web.Request, timeout_s: float) -> bytes:
    """The next bytes of the body (b"" at its end)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.content.readany()
    except TimeoutError:
        raise _BodyTimedOut(
            408, "body_timeout", f"no byte of the body came for {timeout_s} s"
        ) from None
    except ConnectionError as e:
        raise ClientAborted(str(e) or type(e).__name__) from None
    except RequestPayloadError as e:
        raise ApiError(400, "bad_request", f"malformed body: {e}") from None


async def _answer_and_close(request: web.Request, error: ApiError) -> web.StreamResponse:
    """Answer, then close at once: aiohttp would otherwise linger, reading the rest of a
    body that its client stopped sending."""
    response = error_response(error.status, error.code, error.message)
    if (request_id := logs.request_id.get()) is not None:
        response.headers[REQUEST_ID_HEADER] = request_id
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()  # the transport sends what it holds, then closes
    return response
