"""Every error leaves the node as ``{"code": "<stable code>", "message": "..."}``."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from node.http.jsonreply import json_bytes
from node.offload import errors as offload_errors
from node.storage import errors as storage_errors
from node.streams import manager as stream_errors
from node.wire import JSON_CONTENT_TYPE

log = logging.getLogger(__name__)

StorageErrorType = type[storage_errors.StorageError]


@dataclass(frozen=True, slots=True)
class Status:
    """One status of the API's errors: what it means (its description in /openapi.json),
    the engine's errors answered with it, and the code of aiohttp's own refusals with it."""

    description: str
    errors: tuple[StorageErrorType, ...] = ()
    aiohttp_code: str | None = None


# Every error status, in one table. 400: the request is malformed (a schema of /openapi.json
# says so); 422: well formed, but the stream as it is now, or a rule between two values,
# refuses it.
STATUSES: dict[int, Status] = {
    400: Status(
        "Malformed id, query, body or frame (against this document's schemas); an empty "
        "batch (empty_batch); a reserved ledger property (reserved_property); a malformed "
        "header of the replica protocol (invalid_header) or query flag (invalid_query); an "
        "X-Forwarded-By that names no node of the fleet (invalid_header); a malformed "
        "X-Producer-Id or X-Sequence-Id, or one without the other (invalid_producer_id, "
        "invalid_sequence_id, invalid_producer_headers); a "
        "local ledger id in the fleet's range of replicated ledgers (reserved_ledger_id); an "
        "audit snapshot's or file's name that names none (invalid_path: no path leaves the "
        "snapshot directory)",
        (
            storage_errors.InvalidArgument,
            stream_errors.MalformedPosition,
            stream_errors.InvalidPolicy,
            stream_errors.InvalidName,
        ),
        "bad_request",
    ),
    401: Status(
        "Missing bearer token (when an admin token is configured: state changes, fencing "
        "reads included)",
        aiohttp_code="unauthorized",
    ),
    403: Status(
        "Wrong bearer token (forbidden) or write token (write_token_mismatch); a Host "
        "that is not one of the node's names (host_not_allowed, on any route); a state change "
        "from another site's page (origin_not_allowed)",
        (storage_errors.WriteTokenMismatch,),
        "forbidden",
    ),
    404: Status(
        "No such ledger, entry or route; an autorecovery route on a node without a metadata "
        "store (replication_off); no such audit snapshot or file in it; no persisted append "
        "of a stream's producer (producer_not_found)",
        (
            storage_errors.LedgerNotFound,
            storage_errors.EntryNotFound,
            stream_errors.StreamNotFound,
            stream_errors.CursorNotFound,
            stream_errors.ProducerNotFound,
        ),
        "not_found",
    ),
    416: Status(
        "A Range an audit snapshot's file cannot satisfy, or more than one range "
        "(range_not_satisfiable; Content-Range gives the file's size)",
    ),
    405: Status("The route takes other methods (Allow names them)", (), "method_not_allowed"),
    408: Status(
        "The body stopped arriving for body_read_timeout_s (body_timeout); the connection closes",
        aiohttp_code="request_timeout",
    ),
    409: Status(
        "Closed or fenced ledger, conflicting entry, or an existing ledger; a ledger of a "
        "stream, which only the stream API changes (owned_by_stream); an append past entry id "
        "2^63 - 1 (ledger_full: nothing of it is added); an audit snapshot directory that is "
        "not empty (snapshot_exists); a plain add, a close or a delete of a replicated ledger "
        "(replicated_ledger); a replica add to a local ledger (not_replicated); an "
        "autorecovery call naming another metadata store (metadata_mismatch), or refused by "
        "the cluster's state (replicas_disagree, copy_mismatch, lock_lost, not_enough_nodes); "
        "producer headers on a stream that does not deduplicate (deduplication_off), or a "
        "batch whose sequence ids are partly stored already (sequence_overlap)",
        (
            stream_errors.DeduplicationOff,
            stream_errors.SequenceConflict,
            storage_errors.ReplicatedLedger,
            storage_errors.NotReplicated,
            storage_errors.LedgerExists,
            storage_errors.LedgerClosed,
            storage_errors.LedgerFenced,
            storage_errors.LedgerFull,
            storage_errors.EntryConflict,
        ),
    ),
    413: Status(
        "Entry or request too large (a declared Content-Length is refused before the "
        "body), or more entries than max_entries_per_batch (too_many_entries), or an audit "
        "summary past audit_result_max_bytes",
        (storage_errors.EntryTooLarge,),
        "request_too_large",
    ),
    415: Status(
        "Unsupported content type: entries not as octet-stream or a batch, or a JSON "
        "route's body not application/json",
        aiohttp_code="unsupported_media_type",
    ),
    422: Status(
        "Well formed, but refused for what it means: a position not in the stream or past "
        "its end (invalid_position), a minimum rollover time above the maximum (invalid_policy), "
        "a range whose from is after its to (invalid_range), an audit snapshot target outside "
        "the snapshot directory (invalid_target), an audit summary whose status disagrees "
        "with its counts, that finished ahead of the node's clock or that has no check "
        "(invalid_summary); a replica add whose X-Replicated breaks 65535 >= E >= Qw >= Qa "
        ">= 1 (invalid_replication), whose X-Lac is past its last entry (invalid_lac) or that "
        "lacks X-Lac or X-Entry-Id (missing_header); fence=1 "
        "on a LAC read without replicated=1 (invalid_flags); a stream's replication "
        "breaking E >= Qw >= Qa (invalid_policy), or other than 1/1/1 on a node without a "
        "metadata store (replication_off)",
        (
            stream_errors.InvalidPosition,
            stream_errors.ConflictingPolicies,
            stream_errors.ReplicationOff,
        ),
    ),
    429: Status(
        "A new producer on a stream that tracks stream_dedup_max_producers already "
        "(too_many_producers): one is forgotten once idle for "
        "stream_dedup_producer_inactivity_minutes",
        (stream_errors.TooManyProducers,),
    ),
    421: Status(
        "X-Expect-Node names another node than this one (wrong_node): the caller's address "
        "now belongs to another node",
    ),
    431: Status("Request headers too large", (), "headers_too_large"),
    500: Status(
        "An entry failed its CRC check (corrupt_record), an I/O error met a read (io_error: "
        "the entry may exist), or the WAL failed; an audit snapshot directory "
        "off the entry logs' file system (snapshot_failed)",
        (storage_errors.JournalFailed, storage_errors.CorruptRecord, storage_errors.StorageIoError),
    ),
    502: Status(
        "An offloaded object is missing or damaged (offload_object_unreadable), or the "
        "object store answered an error (offload_store_error)",
        (
            offload_errors.OffloadObjectUnreadable,
            offload_errors.OffloadFailed,
            offload_errors.ObjectStoreError,
        ),
    ),
    503: Status(
        "Back-pressure, read-only node, shutting down, request bodies (or read replies) "
        "in flight filling max_request_bytes_in_flight (max_read_bytes_in_flight): "
        "overloaded, max_connections connections open (too_many_connections), or the object "
        "store unreachable (offload_store_unavailable), or the metadata store unreachable "
        "when a replicated ledger's deletion, autorecovery or a stream's new ledger asks it, "
        "or with this node's own registration missing from it (metadata_unavailable), "
        "an autorecovery step the nodes did not answer (entry_unavailable, recovery_failed); "
        "a replicated stream whose owner did not answer a forwarded request "
        "(owner_unreachable), that moved to another node (not_owner), an append whose "
        "ledger a takeover fenced or whose owner went silent (append_outcome_unknown: it may "
        "or may not be in the stream), fewer writable nodes than its ensemble "
        "(not_enough_nodes), a takeover whose recovery of the stream's last ledgers too few "
        "replicas answered (recovery_failed); see Retry-After",
        (
            stream_errors.NotOwner,
            stream_errors.RecoveryFailed,
            stream_errors.AppendOutcomeUnknown,
            stream_errors.MetadataUnavailable,
            stream_errors.NotEnoughNodes,
            storage_errors.Backpressure,
            storage_errors.StorageClosed,
            storage_errors.NodeReadOnly,
            offload_errors.ObjectStoreUnavailable,
        ),
    ),
    504: Status(
        "The object store did not answer within offload_operation_timeout_s "
        "(offload_store_timeout)",
        (offload_errors.ObjectStoreTimeout,),
    ),
    507: Status(
        "A data disk is full: the node is read-only; or an audit snapshot found no "
        "space (disk_full)",
        (storage_errors.DiskFull,),
    ),
}
# An engine error's status (by its exact class: DiskFull is a NodeReadOnly of its own status).
STATUS: dict[StorageErrorType, int] = {
    error: status for status, row in STATUSES.items() for error in row.errors
}
# The code of aiohttp's own refusals (an unknown route, a head too large), by status.
HTTP_CODES = {status: row.aiohttp_code for status, row in STATUSES.items() if row.aiohttp_code}
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
        content_type=JSON_CONTENT_TYPE,
        headers=headers,
    )


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
