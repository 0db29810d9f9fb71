"""The OpenAPI 3 document of the whole HTTP API, served at /openapi.json.

Paths and parameters are written here; every JSON body's schema comes from node/http/models.py,
the types the handlers validate with and reply through. A test checks that the document names
exactly the routes the application registers, and schemathesis fuzzes the live server
against it."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from node import __version__
from node.client import protocol
from node.http import fragments, models
from node.http.audit import LOG_NAME, SNAPSHOT_FILES, SNAPSHOT_NAME, SNAPSHOTS_PATH
from node.http.errors import STATUSES
from node.http.jsonreply import json_response
from node.http.state import SETTINGS
from node.http.streams import STREAM_PAGE_DEFAULT, STREAM_PAGE_MAX
from node.settings import Settings
from node.storage.index import MAX_ID
from node.streams.dedup import DUPLICATE_HEADER, PRODUCER_HEADER, SEQUENCE_HEADER
from node.wire import (
    BATCH_CONTENT_TYPE,
    BATCH_LAYOUT,
    CSS_CONTENT_TYPE,
    HTML_CONTENT_TYPE,
    JAVASCRIPT_CONTENT_TYPE,
    JSON_CONTENT_TYPE,
    OCTET_CONTENT_TYPE,
    RANGE_CONTENT_TYPE,
    RANGE_LAYOUT,
    STREAM_CONTENT_TYPE,
    STREAM_LAYOUT,
    TEXT_CONTENT_TYPE,
)

routes = web.RouteTableDef()

BINARY = {"schema": {"type": "string", "format": "binary"}}  # a media type's bytes


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON_CONTENT_TYPE: {"schema": schema}}}


def _header(description: str) -> dict[str, Any]:
    return {"description": description, "schema": {"type": "string"}}


# A read reply cut short by max_read_reply_bytes or the read budget (node/http/replies.py).
TRUNCATED = {
    "X-Truncated": _header(
        '"true": the reply holds fewer entries than asked for although more are there; '
        "read on from where it says"
    )
}


def _errors(*statuses: int) -> dict[str, Any]:
    """Error responses: the listed statuses, and any other as the same JSON shape."""
    responses = {str(s): _json(_ref("Error"), STATUSES[s].description) for s in statuses}
    responses["default"] = _json(_ref("Error"), "Any other error")
    return responses


def _id(name: str, where: str = "path", description: str = "", minimum: int = 0) -> dict[str, Any]:
    return {
        "name": name,
        "in": where,
        "required": where == "path",
        "description": description,
        "schema": {"type": "integer", "minimum": minimum, "maximum": MAX_ID},
        "example": 0,
    }


LID = _id("lid", description="Ledger id")
EID = _id("eid", description="Entry id")


def _optional_header(name: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "header",
        "required": False,
        "description": description,
        "schema": {"type": "string"},
    }


WRITE_TOKEN = _optional_header(
    "X-Write-Token", "The ledger's write token, when it was created with one"
)
MUTATION_ERRORS = (400, 401, 403, 404, 408, 409, 413, 415, 503, 507)


# The bookie protocol of replicated ledgers (node/client/protocol.py names the headers). Its
# request headers are described in words, not as parameters: their rules tie several
# together (X-Lac comes with X-Replicated, E >= Qw >= Qa), which no parameter schema states.
REPLICA_ADD_HEADERS = (
    f"With `{protocol.REPLICATED_HEADER}: E/Qw/Qa` ({protocol.MAX_QUORUM} >= E >= Qw >= Qa "
    ">= 1) the add is a replica "
    "add of a replicated ledger at the writer's ids, the ledger created replicated (and "
    f"journaled) by its first: `{protocol.ENTRY_ID_HEADER}` the body's first id (one entry, "
    "or a batch's consecutive ids; a range body carries its own ids), "
    f"`{protocol.LAC_HEADER}` the writer's last add confirmed (required; past the add's "
    f"last entry it is 422 {protocol.INVALID_LAC}, but on a recovery's re-add), "
    f"`{protocol.LAC_LENGTH_HEADER}` the ledger's bytes up to it, "
    f"`{protocol.RECOVERY_ADD_HEADER}: 1` a recovery's re-add (taken on a fenced ledger, "
    "never a closed or deleted one). The same bytes again at an id: 201; other bytes: 409 "
    "entry_conflict; a fenced ledger: 409 ledger_fenced; a local ledger: 409 not_replicated; "
    "a plain add to a replicated ledger: 409 replicated_ledger. A malformed header is 400, "
    "a missing X-Lac or X-Entry-Id or quorums out of order or out of bounds 422."
)
EXPECT_NODE_TEXT = (
    f"Any request may carry `{protocol.EXPECT_NODE_HEADER}: <node id>`: another node answers "
    f"421 wrong_node. Every reply carries `{protocol.NODE_ID_HEADER}`."
)
NODE_ID_REPLY = {
    protocol.NODE_ID_HEADER: _header("The id of the node that answered (on every reply)")
}


def _flag(name: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "description": description,
        "schema": {"type": "string", "enum": ["0", "1"]},
    }


FENCE = _flag(
    "fence",
    "1: a recovery's fencing read: the fence is journaled and durable before the answer "
    "(an entry read: before the lookup); a ledger the node does not know is created fenced. "
    "A state change: with an admin token set, it needs the token (401, 403), as writes do",
)
# offset and limit of the stream lists (GET /api/v1/streams, /api/v1/status/streams).
STREAM_PAGE = [
    {
        "name": "offset",
        "in": "query",
        "required": False,
        "schema": {
            "type": "integer",
            "minimum": 0,
            "maximum": MAX_ID,  # as the route parses it (parse_id)
            "default": 0,
        },
    },
    {
        "name": "limit",
        "in": "query",
        "required": False,
        "schema": {
            "type": "integer",
            "minimum": 1,
            "maximum": STREAM_PAGE_MAX,
            "default": STREAM_PAGE_DEFAULT,
        },
    },
]
OFFLOAD_READ_ERRORS = (502, 503, 504)  # reads of an offloaded ledger: the object store


def _body(name: str, required: bool) -> dict[str, Any]:
    return {"required": required, "content": {JSON_CONTENT_TYPE: {"schema": _ref(name)}}}


def _ledger_paths(max_long_poll_ms: int) -> dict[str, Any]:
    ledger = _json(_ref("Ledger"), "Ledger metadata")
    create_body = _body("CreateLedger", required=False)
    octet_body = {
        "required": True,
        "content": {OCTET_CONTENT_TYPE: BINARY},
    }
    return {
        "/api/v1/ledgers": {
            "get": {
                "summary": "List ledgers",
                "responses": {
                    "200": _json(_ref("LedgerList"), "Ledgers"),
                    **_errors(),
                },
            },
            "post": {
                "summary": "Create a ledger with a node-allocated id",
                "requestBody": create_body,
                "responses": {"201": ledger, **_errors(*MUTATION_ERRORS)},
            },
        },
        "/api/v1/ledgers/{lid}": {
            "parameters": [LID],
            "get": {
                "summary": "Ledger metadata",
                "responses": {"200": ledger, **_errors(400, 404)},
            },
            "put": {
                "summary": "Create a ledger with a client-chosen id (idempotent)",
                "requestBody": create_body,
                "responses": {
                    "200": ledger,
                    "201": ledger,
                    **_errors(*MUTATION_ERRORS),
                },
            },
            "delete": {
                "summary": "Delete a ledger: its entries are unreadable at once",
                "parameters": [WRITE_TOKEN],
                "responses": {
                    "204": {"description": "Deleted"},
                    **_errors(400, 401, 403, 404, 409, 503),
                },
            },
        },
        "/api/v1/ledgers/{lid}/close": {
            "parameters": [LID],
            "post": {
                "summary": "Seal the ledger",
                "parameters": [WRITE_TOKEN],
                "responses": {"200": ledger, **_errors(400, 401, 403, 404, 409, 503)},
            },
        },
        "/api/v1/ledgers/{lid}/fence": {
            "parameters": [LID],
            "post": {
                "summary": "Fence the ledger: no more adds",
                "parameters": [WRITE_TOKEN],
                "responses": {"200": ledger, **_errors(400, 401, 403, 404, 409, 503)},
            },
        },
        "/api/v1/ledgers/{lid}/entries/{eid}": {
            "parameters": [LID, EID],
            "put": {
                "summary": "Add an entry at a chosen id; 201 once durable",
                "parameters": [WRITE_TOKEN],
                "requestBody": octet_body,
                "responses": {
                    "201": _json(_ref("AddResult"), "Durable"),
                    **_errors(*MUTATION_ERRORS),
                },
            },
            "get": {
                "summary": "The entry's payload (404 entry_not_found or ledger_not_found "
                "only when the index has no such key; an unreadable entry is 500)",
                "description": "With fence=1 (a recovery's read) the reader may send "
                f"`{protocol.REPLICATED_HEADER}: E/Qw/Qa`: a ledger the fence creates knows "
                f"its quorums. A replicated ledger serves every id it holds. {EXPECT_NODE_TEXT}",
                "parameters": [FENCE],
                "responses": {
                    "200": {
                        "description": "Payload",
                        "headers": {
                            protocol.LAC_HEADER: _header(
                                "The ledger's LAC: the writer's for a replicated ledger"
                            ),
                            **NODE_ID_REPLY,
                        },
                        "content": {OCTET_CONTENT_TYPE: BINARY},
                    },
                    **_errors(400, 401, 403, 404, 409, 421, 500, *OFFLOAD_READ_ERRORS, 507),
                },
            },
        },
        "/api/v1/ledgers/{lid}/entries": {
            "parameters": [LID],
            "post": {
                "summary": f"Append one entry, or a batch ({BATCH_LAYOUT}, repeated); with "
                f"{protocol.REPLICATED_HEADER}, a replica add at the writer's ids: one entry, "
                f"a batch, or a range ({RANGE_LAYOUT}, repeated), the ledger created "
                "replicated by its first",
                "description": f"{REPLICA_ADD_HEADERS} {EXPECT_NODE_TEXT}",
                "parameters": [WRITE_TOKEN],
                "requestBody": {
                    "required": True,
                    "content": {
                        OCTET_CONTENT_TYPE: BINARY,
                        BATCH_CONTENT_TYPE: BINARY,
                        RANGE_CONTENT_TYPE: BINARY,
                    },
                },
                "responses": {
                    "201": {
                        **_json(
                            {"oneOf": [_ref("AddResult"), _ref("BatchResult")]},
                            "Durable: the entry id, or every entry id of the batch (a replica "
                            "add: its first and last, and the writer's LAC)",
                        ),
                        "headers": NODE_ID_REPLY,
                    },
                    **_errors(*MUTATION_ERRORS, 421, 422),
                },
            },
            "get": {
                "summary": f"A range of entries as frames ({RANGE_LAYOUT})",
                "parameters": [
                    _id("from", "query", "First entry id (default 0)"),
                    _id(
                        "to",
                        "query",
                        "Last entry id (default: the highest durable entry, past the LAC too)",
                    ),
                ],
                "responses": {
                    "200": {
                        "description": "Frames, at most max_read_reply_bytes of them",
                        "headers": {
                            **TRUNCATED,
                            "X-Next-Entry-Id": _header(
                                "On a reply cut short (X-Truncated): the entry id to read on from"
                            ),
                        },
                        "content": {RANGE_CONTENT_TYPE: BINARY},
                    },
                    **_errors(400, 404, 422, *OFFLOAD_READ_ERRORS),
                },
            },
        },
        "/api/v1/ledgers/{lid}/lac": {
            "parameters": [LID],
            "get": {
                "summary": "The LAC; with `after`, wait until it passes `after`; with "
                "`replicated=1`, a replica's view of a replicated ledger",
                "parameters": [
                    _id("after", "query", "Wait for the LAC to pass this id", minimum=-1),
                    {
                        **_id("timeoutMs", "query", "At most this long"),
                        "schema": {"type": "integer", "minimum": 0, "maximum": max_long_poll_ms},
                    },
                    _flag(
                        "replicated",
                        "1: the writer's LAC as the adds carried it, the highest entry id "
                        "held here and whether the ledger is fenced (a recovery's LAC read)",
                    ),
                    FENCE,
                ],
                "description": f"fence=1 needs replicated=1 (else 422 invalid_flags); with "
                f"both, `{protocol.REPLICATED_HEADER}: E/Qw/Qa` gives the quorums of a ledger "
                "the fence creates (it answers lac -1, lastEntryId -1, fenced). Without fence, "
                f"an unknown ledger is 404 ledger_not_found. {EXPECT_NODE_TEXT}",
                "responses": {
                    "200": {
                        **_json(
                            {"oneOf": [_ref("Lac"), _ref("ReplicaLac")]},
                            "The LAC (ReplicaLac with replicated=1)",
                        ),
                        "headers": NODE_ID_REPLY,
                    },
                    **_errors(400, 401, 403, 404, 409, 421, 422, 503, 507),
                },
            },
        },
    }


def _admin_paths() -> dict[str, Any]:
    text = {"description": "Text", "content": {TEXT_CONTENT_TYPE: {"schema": {"type": "string"}}}}
    read_only = _json(_ref("ReadOnlyState"), "Read-only mode")
    suspension = _json(_ref("Suspension"), "Suspension")
    string_map = {"type": "object", "additionalProperties": {"type": "string"}}
    return {
        "/heartbeat": {"get": {"summary": "Liveness", "responses": {"200": text}}},
        "/api/v1/bookie/info": {
            "get": {
                "summary": "Free and total bytes of the data disks",
                "responses": {
                    "200": _json(_ref("Space"), "Space"),
                    **_errors(),
                },
            }
        },
        "/api/v1/bookie/state": {
            "get": {
                "summary": "The node's state",
                "responses": {
                    "200": _json(_ref("BookieState"), "State"),
                    **_errors(),
                },
            }
        },
        "/api/v1/bookie/state/readonly": {
            "get": {"summary": "Read-only mode", "responses": {"200": read_only, **_errors()}},
            "put": {
                "summary": "Turn read-only mode on or off",
                "requestBody": _body("ReadOnlyBody", required=True),
                "responses": {"200": read_only, **_errors(400, 401, 403)},
            },
        },
        "/api/v1/bookie/is_ready": {
            "get": {"summary": "Readiness", "responses": {"200": text, **_errors(503)}}
        },
        "/api/v1/bookie/list_disk_file": {
            "get": {
                "summary": "The node's files, tab separated, by kind",
                "parameters": [
                    {
                        "name": "file_type",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": ["journal", "entrylog", "index"]},
                    }
                ],
                "responses": {"200": _json(string_map, "Files"), **_errors(400)},
            }
        },
        "/api/v1/bookie/last_log_mark": {
            "get": {
                "summary": "The checkpoint mark of the journal",
                "responses": {"200": _json(string_map, "Mark"), **_errors()},
            }
        },
        "/api/v1/config/server_config": {
            "get": {
                "summary": "Every setting (secrets masked)",
                "responses": {"200": _json({"type": "object"}, "Settings"), **_errors()},
            }
        },
        "/api/v1/bookie/gc": {
            "put": {
                "summary": "Run garbage collection now (forceMajor/forceMinor override suspension)",
                "requestBody": _body("GcRequest", required=False),
                "responses": {
                    "200": _json({"type": "string"}, "Triggered"),
                    **_errors(400, 401, 403),
                },
            },
            "get": {
                "summary": "Whether a forced GC is pending or running",
                "responses": {"200": _json(_ref("ForceGcState"), "is_in_force_gc"), **_errors()},
            },
        },
        "/api/v1/bookie/gc_details": {
            "get": {
                "summary": "GC status (BookKeeper's fields, plus progress and errors)",
                "responses": {
                    "200": _json({"type": "array", "items": _ref("GcStatus")}, "Status"),
                    **_errors(),
                },
            }
        },
        "/api/v1/bookie/gc/suspend_compaction": {
            "get": {
                "summary": "Whether major and minor compaction are suspended",
                "responses": {"200": suspension, **_errors()},
            },
            "put": {
                "summary": "Suspend major and/or minor compaction",
                "requestBody": _body("SuspendCompaction", required=True),
                "responses": {"200": suspension, **_errors(400, 401, 403)},
            },
        },
        "/api/v1/bookie/gc/resume_compaction": {
            "put": {
                "summary": "Resume major and/or minor compaction",
                "requestBody": _body("ResumeCompaction", required=True),
                "responses": {"200": suspension, **_errors(400, 401, 403)},
            }
        },
        "/metrics": {
            "get": {"summary": "Prometheus metrics", "responses": {"200": text, **_errors()}}
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "responses": {"200": _json({"type": "object"}, "OpenAPI 3")},
            }
        },
    }


def _stream_paths(max_long_poll_ms: int) -> dict[str, Any]:
    name = {
        "name": "name",
        "in": "path",
        "required": True,
        "example": "orders",
        "schema": {"type": "string", "pattern": models.NAME_PATTERN},
    }
    cursor = {
        "name": "cursor",
        "in": "path",
        "required": True,
        "example": "c1",
        "schema": {"type": "string", "pattern": models.NAME_PATTERN},
    }
    position = {"type": "string", "pattern": models.POSITION_PATTERN}
    read_params = [
        {
            "name": "limit",
            "in": "query",
            "required": False,
            "schema": {"type": "integer", "minimum": 1, "maximum": 10_000},
        },
        {
            "name": "waitMs",
            "in": "query",
            "required": False,
            "schema": {"type": "integer", "minimum": 0, "maximum": max_long_poll_ms},
        },
    ]
    frames = {
        "description": f"Frames: {STREAM_LAYOUT}; at most max_read_reply_bytes of them",
        "headers": {
            **TRUNCATED,
            "X-Next-Position": _header("The position to read on from (absent: nothing read)"),
        },
        "content": {STREAM_CONTENT_TYPE: BINARY},
    }
    stream = _json(_ref("Stream"), "Stream")
    cursor_json = _json(_ref("Cursor"), "Cursor")
    policies = _body("StreamPolicies", required=False)
    position_body = _body("PositionBody", required=True)
    return {
        "/api/v1/streams": {
            "get": {
                "summary": "The streams, a page at a time in name order (with a metadata "
                "store, the fleet's)",
                "parameters": STREAM_PAGE,
                "responses": {"200": _json(_ref("StreamList"), "Streams"), **_errors(400)},
            },
        },
        "/api/v1/streams/{name}": {
            "parameters": [name],
            "put": {
                "summary": "Create a stream or update its policies",
                "requestBody": policies,
                "responses": {
                    "200": stream,
                    "201": stream,
                    **_errors(400, 401, 403, 422, 503, 507),
                },
            },
            "get": {
                "summary": "Ledgers, sizes, cursors, backlog",
                "responses": {"200": stream, **_errors(400, 404)},
            },
            "delete": {
                "summary": "Delete the stream and its ledgers",
                "responses": {"204": {"description": "Deleted"}, **_errors(400, 401, 403, 404)},
            },
        },
        "/api/v1/streams/{name}/entries": {
            "parameters": [name],
            "post": {
                "summary": "Append one entry (octet-stream) or a batch",
                # The producer headers are described in words, as the replica add's are:
                # they go together, which no parameter schema states.
                "description": "On a stream whose deduplication policy is on, "
                f"`{PRODUCER_HEADER}` (1-255 of [A-Za-z0-9._-]) and `{SEQUENCE_HEADER}` "
                "(a decimal in [0, 2^63-1]; a batch's first id), always together, make the "
                "append land once however often it is sent: ids the stream holds are "
                f"answered 200 with `{DUPLICATE_HEADER}: true` and nothing is written "
                "(docs/api.md). One of them alone, or a malformed one, is 400; on a stream "
                "without deduplication 409 deduplication_off; a batch partly stored 409 "
                "sequence_overlap; a producer past the stream's cap 429 too_many_producers.",
                "requestBody": {
                    "required": True,
                    "content": {
                        OCTET_CONTENT_TYPE: BINARY,
                        BATCH_CONTENT_TYPE: BINARY,
                    },
                },
                "responses": {
                    "200": {
                        **_json(
                            {"oneOf": [_ref("DuplicateAppended"), _ref("DuplicateBatch")]},
                            "A duplicate (producer headers): where it was stored",
                        ),
                        "headers": {DUPLICATE_HEADER: _header("true")},
                    },
                    "201": _json(
                        {"oneOf": [_ref("Appended"), _ref("AppendedBatch")]},
                        "Durable: the position, or every position of the batch",
                    ),
                    **_errors(*MUTATION_ERRORS, 429),
                },
            },
            "get": {
                "summary": "Read forward from a position, long-polling at the end",
                "parameters": [
                    {"name": "from", "in": "query", "required": False, "schema": position},
                    *read_params,
                ],
                "responses": {"200": frames, **_errors(400, 404, 422, *OFFLOAD_READ_ERRORS)},
            },
        },
        "/api/v1/streams/{name}/producers/{producerId}": {
            "parameters": [
                name,
                {
                    "name": "producerId",
                    "in": "path",
                    "required": True,
                    "example": "billing-1",
                    "schema": {"type": "string", "pattern": models.NAME_PATTERN},
                },
            ],
            "get": {
                "summary": "A producer's last sequence id the stream holds (where it resumes)",
                "responses": {
                    "200": _json(_ref("ProducerSequence"), "Its highest id and that entry's place"),
                    **_errors(400, 404, 409),
                },
            },
        },
        "/api/v1/streams/{name}/cursors/{cursor}": {
            "parameters": [name, cursor],
            "put": {
                "summary": "Create a cursor at earliest, latest or a position",
                "requestBody": _body("CreateCursor", required=False),
                "responses": {
                    "200": cursor_json,
                    "201": cursor_json,
                    **_errors(400, 401, 403, 404, 422, 503),
                },
            },
            "get": {
                "summary": "Mark-delete position and backlog",
                "responses": {"200": cursor_json, **_errors(400, 404)},
            },
            "delete": {
                "summary": "Delete the cursor",
                "responses": {"204": {"description": "Deleted"}, **_errors(400, 401, 403, 404)},
            },
        },
        "/api/v1/streams/{name}/cursors/{cursor}/entries": {
            "parameters": [name, cursor],
            "get": {
                "summary": "The next unacknowledged entries (not acknowledged by reading)",
                "parameters": read_params,
                "responses": {"200": frames, **_errors(400, 404, *OFFLOAD_READ_ERRORS)},
            },
        },
        "/api/v1/streams/{name}/cursors/{cursor}/ack": {
            "parameters": [name, cursor],
            "post": {
                "summary": "Mark-delete up to a position",
                "requestBody": position_body,
                "responses": {"200": cursor_json, **_errors(400, 401, 403, 404, 422, 503)},
            },
        },
        "/api/v1/streams/{name}/cursors/{cursor}/reset": {
            "parameters": [name, cursor],
            "post": {
                "summary": "Read from a position next",
                "requestBody": position_body,
                "responses": {"200": cursor_json, **_errors(400, 401, 403, 404, 422, 503)},
            },
        },
        "/api/v1/retention/run": {
            "post": {
                "summary": "Run retention now; with dryRun, say what it would delete",
                "parameters": [
                    {
                        "name": "dryRun",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": ["true", "false"]},
                    }
                ],
                "responses": {
                    "200": _json(_ref("RetentionResult"), "Deleted ledgers per stream"),
                    **_errors(400, 401, 403),
                },
            }
        },
    }


def document(settings: Settings) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "storage-node",
            "version": __version__,
            "description": "Ledgers of append-only entries over HTTP (a BookKeeper-style "
            "bookie), and its admin API at BookKeeper's paths. Every reply names the node "
            f"({protocol.NODE_ID_HEADER}); a request whose {protocol.EXPECT_NODE_HEADER} names "
            "another node gets 421 wrong_node.",
        },
        "components": {
            "schemas": models.component_schemas(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "paths": {
            **_ledger_paths(settings.max_long_poll_ms),
            **_stream_paths(settings.max_long_poll_ms),
            **_admin_paths(),
            **_offload_paths(),
            **_audit_paths(),
            **_autorecovery_paths(),
            **_status_paths(),
        },
    }


def _status_paths() -> dict[str, Any]:
    def content(media: str, description: str) -> dict[str, Any]:
        return {"description": description, "content": {media: {"schema": {"type": "string"}}}}

    return {
        "/": {
            "get": {
                "summary": "Redirects to the status page",
                "responses": {
                    "302": {"description": "To /status"},
                    "200": content(HTML_CONTENT_TYPE, "The status page (a client that follows)"),
                },
            }
        },
        "/status": {
            "get": {
                "summary": "The status page: one HTML page whose every asset the node serves",
                "responses": {"200": content(HTML_CONTENT_TYPE, "The page")},
            }
        },
        "/status/{asset}": {
            "parameters": [
                {
                    "name": "asset",
                    "in": "path",
                    "required": True,
                    "example": "status.js",
                    "schema": {"type": "string"},
                }
            ],
            "get": {
                "summary": "A script or style sheet of the status page",
                "responses": {
                    "200": {
                        "description": "The asset",
                        "content": {
                            JAVASCRIPT_CONTENT_TYPE: {"schema": {"type": "string"}},
                            CSS_CONTENT_TYPE: {"schema": {"type": "string"}},
                        },
                    },
                    **_errors(404),
                },
            },
        },
        "/api/v1/status/summary": {
            "get": {
                "summary": "The status page's panels: state, disks against their watermarks, "
                "WAL, counters, GC, retention, offload, the last audit, streams and cursors",
                "responses": {"200": _json(_ref("StatusSummary"), "Summary"), **_errors()},
            }
        },
        "/api/v1/status/streams": {
            "get": {
                "summary": "Every stream with its cursors' backlogs, a page at a time in name "
                "order (the summary carries only those with the largest backlog)",
                "parameters": STREAM_PAGE,
                "responses": {"200": _json(_ref("StatusStreamPage"), "Streams"), **_errors(400)},
            }
        },
        "/api/v1/status/history": {
            "get": {
                "summary": "The node's own metrics over the last minutes (an in-memory ring): "
                "adds, reads and bytes per second, add and fsync latency quantiles",
                "responses": {"200": _json(_ref("StatusHistory"), "Samples"), **_errors()},
            }
        },
        "/api/v1/status/entrylogs": {
            "get": {
                "summary": "The entry-log map: every log by age, size and live usage; the "
                "oldest with the ledgers that keep them alive and why",
                "responses": {"200": _json(_ref("StatusEntryLogs"), "Entry logs"), **_errors()},
            }
        },
    }


def _snapshot_file_paths() -> dict[str, Any]:
    """GET of an audit snapshot's files (node/http/audit.py): whole, or one byte range."""

    def param(name: str, schema: dict[str, Any], example: str) -> dict[str, Any]:
        return {"name": name, "in": "path", "required": True, "schema": schema, "example": example}

    snapshot = param(
        "snapshot",
        {"type": "string", "pattern": f"^{SNAPSHOT_NAME.pattern}$"},
        "20250101T000000.000Z-0a1b2c",
    )
    range_header = _optional_header(
        "Range", "One byte range (bytes=a-b, bytes=a-, bytes=-n); more get 416"
    )
    octets = {
        "content": {"application/octet-stream": {"schema": {"type": "string"}}},
        "headers": {"Content-Range": _header("bytes a-b/size (206)")},
    }
    errors = _errors(400, 401, 403, 404, 416, 503)

    def get(summary: str) -> dict[str, Any]:
        return {
            "summary": summary,
            "parameters": [range_header],
            "responses": {
                "200": {"description": "The whole file", **octets},
                "206": {"description": "The range asked", **octets},
                **errors,
            },
        }

    return {
        SNAPSHOTS_PATH + "/{snapshot}/{file}": {
            "parameters": [
                snapshot,
                param("file", {"type": "string", "enum": sorted(SNAPSHOT_FILES)}, "logs.parquet"),
            ],
            "get": get(
                "A snapshot's metadata or index table, for the audit job (the admin token "
                "when one is set; paced by audit_serve_bytes_per_s)"
            ),
        },
        SNAPSHOTS_PATH + "/{snapshot}/logs/{log}": {
            "parameters": [
                snapshot,
                param("log", {"type": "string", "pattern": f"^{LOG_NAME.pattern}$"}, "0.log"),
            ],
            "get": get(
                "An entry log the snapshot holds, by byte ranges, for the audit's executors "
                "(the admin token when one is set; paced by audit_serve_bytes_per_s)"
            ),
        },
    }


def _audit_paths() -> dict[str, Any]:
    result = _json(_ref("AuditResult"), "The last summary and when the node received it")
    return {
        **_snapshot_file_paths(),
        "/api/v1/audit/snapshot": {
            "post": {
                "summary": "Checkpoint, then write a snapshot of the index and metadata, "
                "consistent with that checkpoint, as Parquet (a directory or the offload store) "
                "for the audit job; with a metadata store, the node's fleet id and the "
                "replicated ledgers' metadata too (the replicas check)",
                "requestBody": _body("AuditSnapshotRequest", required=False),
                "responses": {
                    "201": _json(_ref("AuditSnapshot"), "Its URI (the job's --snapshot)"),
                    **_errors(400, 401, 403, 409, 422, 500, 503, 507),
                },
            }
        },
        "/api/v1/audit/result": {
            "get": {
                "summary": "The last audit summary posted",
                "responses": {"200": result, **_errors(404)},
            },
            "post": {
                "summary": "Keep an audit job's summary.json (durably; exported as metrics)",
                "requestBody": _body("AuditSummary", required=True),
                "responses": {"200": result, **_errors(400, 401, 403, 413, 422, 503)},
            },
        },
    }


def _offload_paths() -> dict[str, Any]:
    run_result = {
        "type": "object",
        "required": ["dryRun", "refused", "offloaded", "skipped", "failed", "localDeleted"],
        "properties": {
            "dryRun": {"type": "boolean"},
            "refused": {"type": ["string", "null"]},
            "offloaded": {"type": "array", "items": {"type": "integer"}},
            "skipped": {"type": "array", "items": {"type": "object"}},
            "failed": {"type": "array", "items": {"type": "object"}},
            "localDeleted": {"type": "array", "items": {"type": "integer"}},
        },
    }
    return {
        "/api/v1/offload/run": {
            "post": {
                "summary": "Offload eligible ledgers now (a stream's by its policies, or the "
                "ledgers named), then drop local copies past their deletion lag; a replicated "
                "stream named here that another node owns: forwarded to its owner",
                "parameters": [
                    {
                        "name": "dryRun",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": ["true", "false"]},
                    }
                ],
                "requestBody": _body("OffloadRun", required=False),
                "responses": {
                    "200": _json(run_result, "Offloaded, skipped and failed ledgers"),
                    **_errors(400, 401, 403, 404, 503),
                },
            }
        },
        "/api/v1/offload/status": {
            "get": {
                "summary": "Offloaded ledgers and bytes per stream and in total, the offload "
                "lag, the last run and error, objects no ledger names, incomplete uploads, "
                "the store's error when it fails",
                "responses": {"200": _json({"type": "object"}, "Offload status")},
            }
        },
        "/api/v1/offload/unknown-objects": {
            "delete": {
                "summary": "Delete the objects that no ledger's offload record names and abort "
                "the multipart uploads never completed",
                "responses": {
                    "200": _json({"type": "object"}, "The keys removed, the uploads aborted"),
                    **_errors(401, 403, *OFFLOAD_READ_ERRORS),
                },
            }
        },
    }


def _autorecovery_paths() -> dict[str, Any]:
    counted = {"type": "integer", "minimum": 0}
    nodes = {"type": "array", "items": {"type": "string"}}
    report_properties = {
        "finishedMs": counted,
        "underReplicatedLedgers": counted,
        "underReplicatedFragments": counted,
        "lostNodes": nodes,
        "decommissioningNodes": nodes,
        "checkedLedgers": counted,
        "replicasChecked": counted,
        "markersCreated": counted,
        "markersRemoved": counted,
        "fragmentsChecked": counted,
        "entriesMissing": counted,
        "lastReplicasCheckMs": counted,
    }
    report = {
        "type": "object",
        "required": sorted(report_properties),
        "properties": report_properties,
    }
    audited = {
        **report,
        "required": [*report["required"], "markers"],
        "properties": {**report_properties, "markers": {"type": "array", "items": counted}},
    }
    result = {
        "type": "object",
        "required": ["ledgerId", "outcome", "fragments", "entries", "bytes"],
        "properties": {
            "ledgerId": counted,
            "outcome": {"type": "string", "enum": ["done", "locked", "waiting", "gone"]},
            "fragments": counted,
            "entries": counted,
            "bytes": counted,
        },
    }
    decommissioned = {
        "type": "object",
        "required": ["nodeId", "stillNeeded"],
        "properties": {
            "nodeId": {"type": "string"},
            "stillNeeded": {"type": "array", "items": counted},
        },
    }
    totals = {
        "type": "object",
        "required": ["fragments", "entries", "bytes"],
        "properties": {"fragments": counted, "entries": counted, "bytes": counted},
    }
    status_reply = {
        "type": "object",
        "required": ["lastAudit", "totals", "markers"],
        "properties": {
            "lastAudit": {"anyOf": [report, {"type": "null"}]},
            "totals": totals,
            "markers": counted,
        },
    }
    refusals = _errors(400, 401, 403, 404, 409, 503)
    bounded = {"type": "integer", "minimum": 1}
    return {
        "/api/v1/ledgers/{lid}/missing": {
            "parameters": [LID],
            "get": {
                "summary": "The ids of a replicated ledger this replica lacks in [from, to], "
                "from its index (no payload read): the ledger check's question",
                "parameters": [
                    _id("from", "query", "The first id asked about (default 0)"),
                    {**_id("to", "query", "The last id asked about"), "required": True},
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "description": f"Missing ranges in the reply at most (default "
                        f"{fragments.DEFAULT_MISSING_RANGES}); a reply cut there says nextFrom",
                        "schema": {**bounded, "maximum": fragments.MAX_MISSING_RANGES},
                    },
                    *(
                        {
                            "name": name,
                            "in": "query",
                            "required": False,
                            "description": description,
                            "schema": {
                                "type": "integer",
                                "minimum": minimum,
                                "maximum": fragments.MAX_ENSEMBLE,
                            },
                        }
                        for name, minimum, description in (
                            ("ensembleSize", 1, "E of the segment"),
                            ("writeQuorumSize", 1, "Qw of the ledger"),
                            ("position", 0, "This node's index in the segment's ensemble"),
                        )
                    ),
                ],
                "description": "With ensembleSize, writeQuorumSize and position (all three, "
                "else 422 invalid_stripe; Qw <= E and position < E) only the ids whose write "
                "set holds the node at that position are asked about (Qw of every E), else "
                "every id. An unknown ledger is 404 ledger_not_found, a local one 409 "
                f"not_replicated, from after to 422 invalid_range. {EXPECT_NODE_TEXT}",
                "responses": {
                    "200": _json(_ref("ReplicaMissing"), "The missing ranges"),
                    **_errors(400, 404, 409, 421, 422, 503),
                },
            },
        },
        "/api/v1/autorecovery/audit": {
            "post": {
                "summary": "One pass of the auditor: lost nodes (unregistered longer than the "
                "delay), decommissioning nodes, with checkLedgers replicas whose index lacks "
                "ids of a settled fragment, with checkReplicas replicas that lack an entry or "
                "hold other bytes (every entry read), written as under-replicated markers",
                "requestBody": _body("AutorecoveryAudit", required=True),
                "responses": {
                    "200": _json(audited, "The audit's report, the markers after it"),
                    **refusals,
                },
            }
        },
        "/api/v1/autorecovery/rereplicate": {
            "post": {
                "summary": "Re-replicate what one ledger's marker names (under the marker's "
                "lock: locked when another worker holds it)",
                "requestBody": _body("AutorecoveryRereplicate", required=True),
                "responses": {"200": _json(result, "What this run copied"), **refusals},
            }
        },
        "/api/v1/autorecovery/decommission": {
            "post": {
                "summary": "Mark a node decommissioning; the ledgers that still name it",
                "requestBody": _body("AutorecoveryDecommission", required=True),
                "responses": {
                    "200": _json(decommissioned, "The ledgers still naming it"),
                    **refusals,
                },
            }
        },
        "/api/v1/autorecovery/status": {
            "get": {
                "summary": "The last audit's report, the totals re-replicated, the markers",
                "responses": {
                    "200": _json(status_reply, "Autorecovery's state in the metadata store"),
                    **_errors(404, 503),
                },
            }
        },
    }


@routes.get("/openapi.json")
async def openapi_json(request: web.Request) -> web.Response:
    return json_response(document(request.app[SETTINGS]))
