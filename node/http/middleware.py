"""Request middleware: request ids and structured access logs, metrics, authentication."""

from __future__ import annotations

import hmac
import itertools
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from node import logs
from node.client.protocol import EXPECT_NODE_HEADER, NODE_ID_HEADER, WRONG_NODE
from node.http.errors import ApiError, ClientAborted, error_response
from node.http.state import METRICS, SETTINGS

log = logging.getLogger("node.http.access")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REQUEST_ID_HEADER = "X-Request-Id"
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")  # echoed back and logged: keep it tame
# Ids the node makes: this process's pid and start time, then a counter (unique per node
# and cheap: a uuid4 per request costs a urandom call on the hot path).
_ID_PREFIX = f"{os.getpid():x}{int(time.time()) & 0xFFFFFF:06x}-"
_ID_COUNTER = itertools.count(1)
MUTATING = frozenset({"PUT", "POST", "DELETE", "PATCH"})
GUARDED_PREFIX = "/api/v1/"
# Reads that need the admin token too: the settings name host paths, endpoints, buckets.
GUARDED_READS = frozenset({"/api/v1/config/server_config"})
# The query flag of a fencing read (an entry or LAC read of a recovery): it fences the ledger,
# or creates an unknown one fenced, before it answers, so it is a state change.
FENCE_FLAG = "fence"
# Reads under these need it as well: an audit snapshot's files hold the node's data.
GUARDED_READ_PREFIXES = ("/api/v1/audit/snapshots/",)
# nginx's status for a client that closed the connection before the answer: in the metrics
# it tells a careless client from a failing node (it never goes on the wire).
CLIENT_CLOSED_REQUEST = 499


def next_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):x}"


def valid_client_request_id(given: str) -> bool:
    return _CLIENT_REQUEST_ID.fullmatch(given) is not None


def access_log(method: str, path: str, status: int, elapsed: float) -> None:
    """The request's line in the access log: DEBUG, or WARNING for a server error."""
    level = logging.WARNING if status >= 500 else logging.DEBUG
    if log.isEnabledFor(level):
        log.log(
            level,
            "%s %s %d %.1f ms",
            method,
            path,
            status,
            elapsed * 1000,
            extra={
                "method": method,
                "path": path,
                "status": status,
                "duration_ms": round(elapsed * 1000, 3),
            },
        )


@web.middleware
async def request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Tag the request (and every log line made while serving it) with an id, time it,
    count it by route template and status, and log one line for it."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    rid = given if valid_client_request_id(given) else next_request_id()
    token = logs.request_id.set(rid)
    started = time.perf_counter()
    status = 500
    response: web.StreamResponse
    try:
        expected = request.headers.get(EXPECT_NODE_HEADER)
        if expected is not None and expected != request.app[SETTINGS].id:
            response = wrong_node(expected, request.app[SETTINGS].id)
        else:
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
        request.app[METRICS].observe_request(request.method, route, status, elapsed)
        access_log(request.method, request.path, status, elapsed)
        logs.request_id.reset(token)


def wrong_node(expected: str, node_id: str) -> web.Response:
    """421 for a request meant for another node: its caller reached this one at an address
    that node had (a pod's IP reused), and must not take this node's answer for that one's."""
    return error_response(421, WRONG_NODE, f"this is node {node_id!r}, not {expected[:100]!r}")


async def _node_id_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[NODE_ID_HEADER] = request.app[SETTINGS].id


def install_node_id(app: web.Application) -> None:
    """Every reply names the node that gave it (X-Node-Id): a client of replicated ledgers
    counts a node's answer only from the node it meant."""
    app.on_response_prepare.append(_node_id_header)


def token_refusal(authorization: str, admin_token: bytes) -> ApiError | None:
    """Why a request with this Authorization header does not carry the admin token (401
    without a bearer token, 403 with another one); None when it does. The one check of the
    routes (``require_admin_token``) and the fast lane, which gives it the header as aiohttp
    would (undecodable bytes kept as surrogates, compared as the bytes they were)."""
    scheme, _, presented = authorization.partition(" ")
    if scheme.lower() != "bearer" or not presented:
        return ApiError(401, "unauthorized", "this request needs 'Authorization: Bearer <token>'")
    if not hmac.compare_digest(presented.strip().encode("utf-8", "surrogateescape"), admin_token):
        return ApiError(403, "forbidden", "the bearer token is not the admin token")
    return None


def needs_admin_token(request: web.BaseRequest) -> bool:
    """Whether the admin token, when one is set, guards this request: every state change
    under /api/v1/, a fencing read included (whatever its method or its flag's spelling: the
    route refuses a flag other than 0 or 1, and none but 0 may pass here unchecked), and the
    reads of GUARDED_READS and under GUARDED_READ_PREFIXES."""
    if request.path in GUARDED_READS or request.path.startswith(GUARDED_READ_PREFIXES):
        return True
    if not request.path.startswith(GUARDED_PREFIX):
        return False
    return request.method in MUTATING or request.query.get(FENCE_FLAG, "0") != "0"


@web.middleware
async def require_admin_token(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With an admin token configured, the requests of ``needs_admin_token`` need it."""
    secret = request.app[SETTINGS].admin_token
    if secret is not None and needs_admin_token(request):
        authorization = request.headers.get("Authorization", "")
        refusal = token_refusal(authorization, secret.get_secret_value().encode())
        if refusal is not None:
            raise refusal
    return await handler(request)
