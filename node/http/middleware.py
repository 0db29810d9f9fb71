"""Request middleware: request ids and structured access logs, metrics, authentication."""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from node import logs
from node.http.errors import ApiError, ClientAborted
from node.http.state import METRICS, SETTINGS

log = logging.getLogger("node.http.access")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REQUEST_ID_HEADER = "X-Request-Id"
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")  # echoed back and logged: keep it tame
MUTATING = frozenset({"PUT", "POST", "DELETE", "PATCH"})
GUARDED_PREFIX = "/api/v1/"
# nginx's status for a client that closed the connection before the answer: in the metrics
# it tells a careless client from a failing node (it never goes on the wire).
CLIENT_CLOSED_REQUEST = 499


@web.middleware
async def request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Tag the request (and every log line made while serving it) with an id, time it,
    count it by route template and status, and log one line for it."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    rid = given if _CLIENT_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex[:16]
    token = logs.request_id.set(rid)
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        if not response.prepared:
            response.headers[REQUEST_ID_HEADER] = rid
        return response
    except web.HTTPException as e:
        status = e.status
        raise
    except (ClientAborted, ConnectionError) as e:  # mid-body, or while the answer streamed
        status = CLIENT_CLOSED_REQUEST
        log.info("client hung up during %s %s: %s", request.method, request.path, e)
        # aiohttp finds the connection gone when it writes this, and drops it quietly.
        return web.Response(status=status)
    finally:
        elapsed = time.perf_counter() - started
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        request.app[METRICS].http_request_duration.labels(
            request.method, route, str(status)
        ).observe(elapsed)
        level = logging.WARNING if status >= 500 else logging.DEBUG
        if log.isEnabledFor(level):
            log.log(
                level,
                "%s %s %d %.1f ms",
                request.method,
                request.path,
                status,
                elapsed * 1000,
                extra={
                    "method": request.method,
                    "path": request.path,
                    "status": status,
                    "duration_ms": round(elapsed * 1000, 3),
                },
            )
        logs.request_id.reset(token)


@web.middleware
async def require_admin_token(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With an admin token configured, every state change under /api/v1/ needs it."""
    secret = request.app[SETTINGS].admin_token
    if (
        secret is not None
        and request.method in MUTATING
        and request.path.startswith(GUARDED_PREFIX)
    ):
        header = request.headers.get("Authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented:
            raise ApiError(
                401, "unauthorized", "this request needs 'Authorization: Bearer <token>'"
            )
        if not hmac.compare_digest(presented.strip().encode(), secret.get_secret_value().encode()):
            raise ApiError(403, "forbidden", "the bearer token is not the admin token")
    return await handler(request)
