"""Every error leaves the node as ``{"code": "<stable code>", "message": "..."}``."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from node.http.jsonreply import JSON_TYPE, json_bytes
from node.offload import errors as offload_errors
from node.storage import errors as storage_errors
from node.streams import manager as stream_errors

log = logging.getLogger(__name__)

STATUS: dict[type[storage_errors.StorageError], int] = {
    storage_errors.LedgerNotFound: 404,
    storage_errors.EntryNotFound: 404,
    storage_errors.LedgerExists: 409,
    storage_errors.LedgerClosed: 409,
    storage_errors.LedgerFenced: 409,
    storage_errors.LedgerFull: 409,
    storage_errors.EntryConflict: 409,
    storage_errors.EntryTooLarge: 413,
    storage_errors.InvalidArgument: 400,
    storage_errors.WriteTokenMismatch: 403,
    storage_errors.Backpressure: 503,
    storage_errors.StorageClosed: 503,
    storage_errors.NodeReadOnly: 503,
    storage_errors.DiskFull: 507,
    stream_errors.StreamNotFound: 404,
    stream_errors.CursorNotFound: 404,
    # 400: the request is malformed (a schema of /openapi.json says so); 422: well formed,
    # but the stream as it is now, or a rule between two values, refuses it.
    stream_errors.MalformedPosition: 400,
    stream_errors.InvalidPosition: 422,
    stream_errors.InvalidPolicy: 400,
    stream_errors.ConflictingPolicies: 422,
    stream_errors.InvalidName: 400,
    storage_errors.JournalFailed: 500,
    storage_errors.CorruptRecord: 500,
    offload_errors.OffloadObjectUnreadable: 502,
    offload_errors.OffloadFailed: 502,
    offload_errors.ObjectStoreError: 502,
    offload_errors.ObjectStoreUnavailable: 503,
    offload_errors.ObjectStoreTimeout: 504,
}
RETRY_AFTER_S = "1"  # Backpressure clears within a checkpoint, a second or so


class ApiError(Exception):
    """An error raised by the HTTP layer itself (bad ids, frames, content types)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class ClientAborted(Exception):
    """The client hung up before its request was read: nobody is left to answer."""


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    headers = dict(headers or {})
    if status == 503:
        headers["Retry-After"] = RETRY_AFTER_S
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="storage-node"'

    return web.Response(
        status=status,
        body=error_body(code, message),
        content_type=JSON_TYPE,
        headers=headers,
    )


HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    415: "unsupported_media_type",
    431: "headers_too_large",
}


def storage_status(error: storage_errors.StorageError, method: str, path: str) -> int:
    """The status of a storage error; the unexpected ones are logged."""
    status = STATUS.get(type(error), 500)
    if status >= 500 and not isinstance(
        error, storage_errors.Backpressure | storage_errors.StorageClosed
    ):
        log.error("request %s %s failed: %s", method, path, error)
    return status


def error_body(code: str, message: str) -> bytes:
    return json_bytes({"code": code, "message": message})


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e.status, e.code, e.message)
    except storage_errors.StorageError as e:
        status = storage_status(e, request.method, request.path)
        return error_response(status, e.code, e.message)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = HTTP_CODES.get(e.status, f"http_{e.status}")
        kept = {k: v for k, v in e.headers.items() if k == "Allow"}  # 405 must say what works
        return error_response(e.status, code, e.reason or code, kept)
