"""Ledger routes: create, metadata, close, fence, delete, add, read, range, long-poll LAC."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from aiohttp import web

from node.http import models
from node.http.connections import cancelled_on_hangup
from node.http.errors import ApiError
from node.http.frames import (
    BATCH_CONTENT_TYPE,
    JSON_CONTENT_TYPE,
    OCTET_CONTENT_TYPE,
    RANGE_CONTENT_TYPE,
    RANGE_HEADER,
    RAW_CONTENT_TYPES,
    FrameError,
    TooManyEntries,
    decode_batch,
    media_type,
    range_pieces,
)
from node.http.jsonreply import LINE_END, json_response
from node.http.replies import ReplyBytes, send
from node.http.state import METRICS, SETTINGS, STORAGE, STREAMS
from node.storage.adds import PendingAdd
from node.storage.errors import StorageError
from node.storage.index import MAX_ID, STREAM_PROPERTY, LedgerMeta
from node.storage.ledgers import LedgerStorage
from node.streams.model import ID_DIGITS

log = logging.getLogger(__name__)

WRITE_TOKEN_HEADER = "X-Write-Token"
NEXT_ENTRY_HEADER = "X-Next-Entry-Id"  # a range reply cut short: the entry to read on from
# Canonical decimal only: "00100" is not another name of ledger 100 (a cache or a log keyed by
# the path would see two ledgers).
_ID = re.compile(ID_DIGITS)
# The add replies, encoded without a model or json.dumps on the hot path; the OpenAPI
# document describes them with models.AddResult and models.BatchResult (tests/http check
# that the bytes validate against those).
# Spaced as json.dumps spaces every other reply, and ended as they are (replies.py).
ADD_REPLY = b'{"ledgerId": %d, "entryId": %d, "lac": %d}' + LINE_END
BATCH_REPLY = b'{"ledgerId": %d, "firstEntryId": %d, "lastEntryId": %d, "lac": %d}' + LINE_END

routes = web.RouteTableDef()


def parse_id(text: str | None, what: str, default: int | None = None) -> int:
    if text is None:
        if default is None:
            raise ApiError(400, "invalid_id", f"{what} is required")
        return default
    if not _ID.fullmatch(text) or int(text) > MAX_ID:
        raise ApiError(
            400,
            "invalid_id",
            f"{what} must be a decimal integer in [0, 2^63) without leading zeros: {text[:40]!r}",
        )
    return int(text)


def _storage(request: web.Request) -> LedgerStorage:
    return request.app[STORAGE]


def not_stream_owned(app: web.Application, ledger_id: int) -> None:
    """Refuse to change a stream's ledger: the stream manager alone adds to, closes and
    deletes it (a foreign entry would be read as the stream's, a close or fence would fail
    every later append, a delete would drop unconsumed entries). A ledger's properties never
    change and a stream takes a fresh id for each ledger (short of every id having been
    taken), so the check holds for the operation that follows it; a missing ledger answers
    404 here, as the operation would. An orphan that start-up kept (no stream names it)
    is a plain ledger: the operator reads and deletes it here."""
    owner = app[STORAGE].ledger(ledger_id).properties.get(STREAM_PROPERTY)
    if owner is not None and ledger_id not in app[STREAMS].orphans:
        raise ApiError(
            409,
            "owned_by_stream",
            f"ledger {ledger_id} belongs to stream {owner!r}: append to, trim or delete it "
            f"through the stream API (/api/v1/streams/{owner})",
        )


def _observe_read(request: web.Request, kind: str, started: float) -> None:
    """Latency of a read (found or not)."""
    request.app[METRICS].read_latency.labels(kind).observe(time.perf_counter() - started)


def meta_json(meta: LedgerMeta) -> dict[str, Any]:
    return models.Ledger(
        ledgerId=meta.ledger_id,
        state=models.LEDGER_STATES[meta.state],
        lac=meta.lac,
        lastEntryId=meta.last_entry_id,
        entries=meta.entries,
        bytes=meta.payload_bytes,
        createdTime=meta.created_ms,
        closedTime=meta.closed_ms or None,
        properties=meta.properties,
        hasWriteToken=bool(meta.token_digest),
        offload=_offload(meta),
    ).to_json()


def _offload(meta: LedgerMeta) -> models.LedgerOffload:
    offload = meta.offload
    if offload is None:
        return models.LedgerOffload(state="none", attempt=None, bytes=0, localDeleted=False)
    return models.LedgerOffload(
        state=models.OFFLOAD_STATES[offload.state],
        attempt=offload.attempt,
        bytes=offload.data_bytes,
        localDeleted=offload.local_deleted,
    )


def _added(ledger_id: int, entry_id: int, lac: int) -> web.Response:
    body = ADD_REPLY % (ledger_id, entry_id, lac)
    return web.Response(body=body, status=201, content_type=JSON_CONTENT_TYPE)


async def _create_options(request: web.Request) -> tuple[dict[str, str], str | None]:
    options = models.CREATE_LEDGER.parse(await request.read())
    properties = options.get("properties", {})
    if STREAM_PROPERTY in properties:
        # It marks a stream's ledger: forged, it would shield the ledger from this API, and
        # the stream manager deletes, at start-up, stream ledgers no stream names.
        raise ApiError(
            400,
            "reserved_property",
            f"the property {STREAM_PROPERTY!r} is reserved for ledgers of streams",
        )
    return properties, options.get("writeToken")


@routes.get("/api/v1/ledgers")
async def list_ledgers(request: web.Request) -> web.Response:
    ledgers = sorted(_storage(request).ledgers(), key=lambda m: m.ledger_id)
    return json_response({"ledgers": [meta_json(m) for m in ledgers]})


@routes.post("/api/v1/ledgers")
async def create_ledger(request: web.Request) -> web.Response:
    properties, token = await _create_options(request)
    meta, _ = await _storage(request).create_ledger(None, properties, token)
    return json_response(meta_json(meta), status=201)


@routes.put("/api/v1/ledgers/{lid}")
async def create_ledger_with_id(request: web.Request) -> web.Response:
    ledger_id = parse_id(request.match_info["lid"], "ledger id")
    properties, token = await _create_options(request)
    meta, created = await _storage(request).create_ledger(ledger_id, properties, token)
    return json_response(meta_json(meta), status=201 if created else 200)


@routes.get("/api/v1/ledgers/{lid}")
async def get_ledger(request: web.Request) -> web.Response:
    ledger_id = parse_id(request.match_info["lid"], "ledger id")
    return json_response(meta_json(_storage(request).ledger(ledger_id)))


@routes.delete("/api/v1/ledgers/{lid}")
async def delete_ledger(request: web.Request) -> web.Response:
    ledger_id = parse_id(request.match_info["lid"], "ledger id")
    not_stream_owned(request.app, ledger_id)
    await _storage(request).delete_ledger(ledger_id, request.headers.get(WRITE_TOKEN_HEADER))
    return web.Response(status=204)


@routes.post("/api/v1/ledgers/{lid}/close")
async def close_ledger(request: web.Request) -> web.Response:
    ledger_id = parse_id(request.match_info["lid"], "ledger id")
    not_stream_owned(request.app, ledger_id)
    token = request.headers.get(WRITE_TOKEN_HEADER)
    return json_response(meta_json(await _storage(request).close_ledger(ledger_id, token)))


@routes.post("/api/v1/ledgers/{lid}/fence")
async def fence_ledger(request: web.Request) -> web.Response:
    ledger_id = parse_id(request.match_info["lid"], "ledger id")
    storage = _storage(request)
    not_stream_owned(request.app, ledger_id)
    await storage.fence(ledger_id, request.headers.get(WRITE_TOKEN_HEADER))
    return json_response(meta_json(storage.ledger(ledger_id)))


def _content_type(request: web.Request) -> str:
    return media_type(request.headers.get("Content-Type", ""))


def unsupported(content_type: str) -> ApiError:
    return ApiError(
        415,
        "unsupported_media_type",
        f"entries are {OCTET_CONTENT_TYPE} or {BATCH_CONTENT_TYPE}, not {content_type!r}",
    )


async def _payload(request: web.Request) -> bytes:
    if _content_type(request) not in RAW_CONTENT_TYPES:
        raise unsupported(_content_type(request))
    return await request.read()


@routes.put("/api/v1/ledgers/{lid}/entries/{eid}")
async def put_entry(request: web.Request) -> web.Response:
    ledger_id = parse_id(request.match_info["lid"], "ledger id")
    entry_id = parse_id(request.match_info["eid"], "entry id")
    storage = _storage(request)
    not_stream_owned(request.app, ledger_id)
    payload = await _payload(request)
    started = time.perf_counter()
    await storage.add_entry(ledger_id, entry_id, payload, request.headers.get(WRITE_TOKEN_HEADER))
    request.app[METRICS].add_latency_single.observe(time.perf_counter() - started)
    return _added(ledger_id, entry_id, storage.ledger(ledger_id).lac)


async def decode_payloads(app: web.Application, body: bytes) -> list[bytes]:
    """The entries of a batch body (413 past max_entries_per_batch, 400 if malformed or
    empty)."""
    try:
        payloads = await decode_batch(body, app[SETTINGS].max_entries_per_batch)
    except TooManyEntries as e:
        raise ApiError(413, "too_many_entries", f"{e} (max_entries_per_batch)") from None
    except FrameError as e:
        raise ApiError(400, "invalid_frame", f"bad batch body: {e}") from None
    if not payloads:
        raise ApiError(400, "empty_batch", "a batch holds at least one entry")
    return payloads


async def add(
    app: web.Application, ledger_id: int, content_type: str, token: str | None, body: bytes
) -> bytes:
    """POST /api/v1/ledgers/{lid}/entries once its body is read: the 201 reply's JSON. The
    route and the fast lane (fastlane.py) both answer through this."""
    storage = app[STORAGE]
    not_stream_owned(app, ledger_id)
    if content_type == BATCH_CONTENT_TYPE:
        payloads = await decode_payloads(app, body)
        started = time.perf_counter()
        ids = await storage.add_entries(ledger_id, payloads, token)
        app[METRICS].add_latency_batch.observe(time.perf_counter() - started)
        # A batch takes consecutive ids: the first and last name them all (a list of every
        # id made a reply as big as the batch).
        return BATCH_REPLY % (ledger_id, ids[0], ids[-1], storage.ledger(ledger_id).lac)
    if content_type not in RAW_CONTENT_TYPES:
        raise unsupported(content_type)
    started = time.perf_counter()
    entry_id = await storage.add_entry(ledger_id, None, body, token)
    app[METRICS].add_latency_single.observe(time.perf_counter() - started)
    return ADD_REPLY % (ledger_id, entry_id, storage.ledger(ledger_id).lac)


def begin_add(
    app: web.Application, ledger_id: int, token: str | None, body: bytes
) -> PendingAdd | None:
    """``add`` of one raw entry without a coroutine (the fast lane's hot path): the add
    queued, or None when it must wait for the write cache (``add`` does it then)."""
    not_stream_owned(app, ledger_id)
    return app[STORAGE].begin_add(ledger_id, body, token)


def finish_add(app: web.Application, pending: PendingAdd, started: float) -> bytes:
    """The 201 reply of a ``begin_add`` whose future is done, or its error."""
    storage = app[STORAGE]
    entry_id = storage.finish_add(pending)
    app[METRICS].add_latency_single.observe(time.perf_counter() - started)
    ledger_id = pending.meta.ledger_id
    return ADD_REPLY % (ledger_id, entry_id, storage.ledger(ledger_id).lac)


@routes.post("/api/v1/ledgers/{lid}/entries")
async def append_entries(request: web.Request) -> web.Response:
    ledger_id = parse_id(request.match_info["lid"], "ledger id")
    reply = await add(
        request.app,
        ledger_id,
        _content_type(request),
        request.headers.get(WRITE_TOKEN_HEADER),
        await request.read(),
    )
    return web.Response(body=reply, status=201, content_type=JSON_CONTENT_TYPE)


@routes.get("/api/v1/ledgers/{lid}/entries/{eid}")
async def read_entry(request: web.Request) -> web.StreamResponse:
    ledger_id = parse_id(request.match_info["lid"], "ledger id")
    entry_id = parse_id(request.match_info["eid"], "entry id")
    started = time.perf_counter()
    async with ReplyBytes(request.app, 0) as reply:
        try:
            payload = await _storage(request).read_entry(ledger_id, entry_id)
        finally:
            _observe_read(request, "entry", started)
        await reply.admit(len(payload))  # the first entry of a reply: room, or 503
        return await send(request, reply, OCTET_CONTENT_TYPE, [payload], {})


@routes.get("/api/v1/ledgers/{lid}/entries")
async def read_range(request: web.Request) -> web.StreamResponse:
    ledger_id = parse_id(request.match_info["lid"], "ledger id")
    first = parse_id(request.query.get("from"), "from", default=0)
    last = parse_id(request.query["to"], "to") if "to" in request.query else None
    if last is not None and first > last:
        # Well formed, so not a 400 (every schema of the document holds): a rule between
        # two values, like a minimum rollover time above the maximum.
        raise ApiError(422, "invalid_range", f"from ({first}) is after to ({last})")
    started = time.perf_counter()
    async with ReplyBytes(request.app, RANGE_HEADER.size) as reply:
        found: list[tuple[int, bytes]] = []
        try:
            async for entry_id, payload in _storage(request).read_range(ledger_id, first, last):
                if not await reply.admit(len(payload)):
                    next_id = entry_id
                    break
                found.append((entry_id, payload))
        except StorageError as e:
            if not found:
                raise
            # Answer the good entries as a cut reply: reading on from the next gets the
            # error, with its status.
            log.error("range read of ledger %d cut short: %s", ledger_id, e)
            reply.cut, next_id = True, found[-1][0] + 1
        headers = {NEXT_ENTRY_HEADER: str(next_id)} if reply.cut else {}
        pieces = range_pieces(found)
        response = await send(request, reply, RANGE_CONTENT_TYPE, pieces, headers)
    _observe_read(request, "range", started)
    return response


@routes.get("/api/v1/ledgers/{lid}/lac")
async def long_poll_lac(request: web.Request) -> web.Response:
    ledger_id = parse_id(request.match_info["lid"], "ledger id")
    storage = _storage(request)
    timeout_ms = parse_id(request.query.get("timeoutMs"), "timeoutMs", default=0)
    longest = request.app[SETTINGS].max_long_poll_ms
    if timeout_ms > longest:
        raise ApiError(400, "invalid_timeout", f"timeoutMs is at most {longest}")
    if "after" in request.query:
        raw = request.query["after"]
        after = -1 if raw == "-1" else parse_id(raw, "after")  # -1: wait for the first entry
        with cancelled_on_hangup(request):
            lac = await storage.wait_lac(ledger_id, after, timeout_ms / 1000)
    else:
        lac = storage.ledger(ledger_id).lac
    return json_response(models.Lac(ledgerId=ledger_id, lac=lac).to_json())
