"""Ledger routes: create, metadata, close, fence, delete, add, read, range, long-poll LAC.

The same routes carry the bookie protocol of replicated ledgers (node/client is the
writer; ``node/client/protocol.py`` names the headers and codes): an add with
``X-Replicated`` is a replica add at the writer's ids, ``?fence=1`` on an entry or LAC read
fences before it answers, ``?replicated=1`` on a LAC read answers the replica's view.
A replicated ledger is closed in the metadata store, never here, and deleted here only
once the metadata store says it is gone (``REPLICA_GUARD``)."""

from __future__ import annotations

import itertools
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from node.client import protocol
from node.client.errors import MetadataError
from node.client.metadata.store import LEDGER_ID_BASE
from node.http import models
from node.http.connections import cancelled_on_hangup
from node.http.errors import ApiError
from node.http.jsonreply import LINE_END, json_response
from node.http.replies import ReplyBytes, send
from node.http.state import METRICS, REPLICA_GUARD, SETTINGS, STORAGE, STREAMS
from node.storage.adds import PendingAdd, ReplicaAdd
from node.storage.errors import LedgerFenced, StorageError
from node.storage.index import MAX_ID, STREAM_PROPERTY, LedgerMeta, LedgerState
from node.storage.ledgers import LedgerStorage
from node.streams.model import ID_DIGITS
from node.wire import (
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

log = logging.getLogger(__name__)

WRITE_TOKEN_HEADER = "X-Write-Token"
NEXT_ENTRY_HEADER = "X-Next-Entry-Id"  # a range reply cut short: the entry to read on from
# Canonical decimal only: "00100" is not another name of ledger 100 (a cache or a log keyed by
# the path would see two ledgers).
_ID = re.compile(ID_DIGITS)
REPLICATION_SHAPE = re.compile(r"[0-9]{1,9}/[0-9]{1,9}/[0-9]{1,9}")  # X-Replicated's E/Qw/Qa
# The add replies, encoded without a model or json.dumps on the hot path; the OpenAPI
# document describes them with models.AddResult and models.BatchResult (tests/http check
# that the bytes validate against those).
# Spaced as json.dumps spaces every other reply, and ended as they are (replies.py).
ADD_REPLY = b'{"ledgerId": %d, "entryId": %d, "lac": %d}' + LINE_END
BATCH_REPLY = b'{"ledgerId": %d, "firstEntryId": %d, "lastEntryId": %d, "lac": %d}' + LINE_END

routes = web.RouteTableDef()
# A header's value, or None (aiohttp's headers and the fast lane's parsed ones alike).
HeaderGetter = Callable[[str], str | None]


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
        replication=_replication_of(meta),
    ).to_json()


def _replication_of(meta: LedgerMeta) -> models.LedgerReplication | None:
    if meta.replication is None:
        return None
    ensemble, write_quorum, ack_quorum = meta.replication
    return models.LedgerReplication(
        ensembleSize=ensemble,
        writeQuorumSize=write_quorum,
        ackQuorumSize=ack_quorum,
        writerLac=meta.writer_lac,
        writerLacLength=meta.writer_lac_length,
    )


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
    if request.app[SETTINGS].metadata_url and ledger_id >= LEDGER_ID_BASE:
        raise ApiError(
            400,
            protocol.RESERVED_LEDGER_ID,
            f"ids from {LEDGER_ID_BASE} (2^62) are the fleet's replicated ledgers (node/client)",
        )
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
    storage = _storage(request)
    if storage.ledger(ledger_id).replication is not None:
        await _confirm_replica_deleted(request.app, ledger_id)
    await storage.delete_ledger(ledger_id, request.headers.get(WRITE_TOKEN_HEADER))
    return web.Response(status=204)


async def _confirm_replica_deleted(app: web.Application, ledger_id: int) -> None:
    """A replicated ledger is reclaimed only when the metadata store says it is gone: its
    writer or a reader may still need this replica's stripe."""
    guard = app.get(REPLICA_GUARD)
    if guard is None:
        raise ApiError(
            409,
            protocol.REPLICATED_LEDGER,
            f"ledger {ledger_id} is replicated and this node has no metadata store to ask "
            "whether it is deleted (metadata_url)",
        )
    try:
        gone = await guard.confirm_deleted(ledger_id)
    except MetadataError as e:
        raise ApiError(
            503, "metadata_unavailable", f"the metadata store did not answer ({e}): kept"
        ) from e
    if not gone:
        raise ApiError(
            409,
            protocol.REPLICATED_LEDGER,
            f"ledger {ledger_id} is replicated and still in the metadata store: delete it "
            "there (node/client); this node reclaims it afterwards",
        )


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


def parse_replication(text: str) -> tuple[int, int, int]:
    """X-Replicated: 400 ``invalid_header`` when it is no E/Qw/Qa, 422
    ``invalid_replication`` when its numbers break MAX_QUORUM >= E >= Qw >= Qa >= 1 (a rule
    between values, as the document's schemas cannot state)."""
    try:
        return protocol.parse_replication_header(text)
    except ValueError as e:
        status = 422 if REPLICATION_SHAPE.fullmatch(text) else 400
        code = "invalid_replication" if status == 422 else "invalid_header"
        raise ApiError(status, code, str(e)) from None


def _replica_headers(header: HeaderGetter) -> tuple[int | None, ReplicaAdd]:
    """The replica add's first entry id (X-Entry-Id, None if not sent) and the rest of what
    its headers say; 400 ``invalid_header`` when one is malformed, 422 ``missing_header``
    when X-Lac is not there."""
    replication = parse_replication(header(protocol.REPLICATED_HEADER) or "")
    entry_text = header(protocol.ENTRY_ID_HEADER)
    first = None if entry_text is None else parse_id(entry_text, protocol.ENTRY_ID_HEADER)
    lac_text = header(protocol.LAC_HEADER)
    if lac_text is None:
        raise ApiError(422, "missing_header", f"a replica add carries {protocol.LAC_HEADER}")
    lac = -1 if lac_text == "-1" else parse_id(lac_text, protocol.LAC_HEADER)
    length = parse_id(header(protocol.LAC_LENGTH_HEADER), protocol.LAC_LENGTH_HEADER, default=0)
    recovery = header(protocol.RECOVERY_ADD_HEADER)
    if recovery not in (None, "0", "1"):
        raise ApiError(400, "invalid_header", f"{protocol.RECOVERY_ADD_HEADER} is 0 or 1")
    return first, ReplicaAdd(replication, lac, length, recovery == "1")


def _first_id(first: int | None) -> int:
    if first is None:
        raise ApiError(
            422, "missing_header", f"{protocol.ENTRY_ID_HEADER} names the body's first entry"
        )
    return first


async def _replica_entries(
    app: web.Application, content_type: str, first: int | None, body: bytes
) -> list[tuple[int, bytes]]:
    """A replica add's entries: one at X-Entry-Id, a batch from it, or a range's own ids."""
    if content_type == BATCH_CONTENT_TYPE:
        start = _first_id(first)
        payloads = await decode_payloads(app, body)
        if start + len(payloads) - 1 > MAX_ID:
            raise ApiError(400, "invalid_id", "the batch runs past entry id 2^63 - 1")
        return list(enumerate(payloads, start))
    if content_type == RANGE_CONTENT_TYPE:
        limit = app[SETTINGS].max_entries_per_batch
        try:
            # One past the limit is enough to refuse: the rest is never decoded.
            entries = list(itertools.islice(protocol.decode_range(body), limit + 1))
        except ValueError as e:
            raise ApiError(400, "invalid_frame", f"bad range body: {e}") from None
        if not entries:
            raise ApiError(400, "empty_batch", "a range holds at least one entry")
        if len(entries) > limit:
            raise ApiError(413, "too_many_entries", f"more than {limit} entries")
        if any(eid > MAX_ID for eid, _payload in entries):
            raise ApiError(400, "invalid_id", "a range entry id past 2^63 - 1")
        return entries
    if content_type not in RAW_CONTENT_TYPES:
        raise ApiError(
            415,
            "unsupported_media_type",
            f"replica entries are {OCTET_CONTENT_TYPE}, {BATCH_CONTENT_TYPE} or "
            f"{RANGE_CONTENT_TYPE}, not {content_type!r}",
        )
    return [(_first_id(first), body)]


def _lac_within(replica: ReplicaAdd, last_entry_id: int) -> None:
    """422 ``invalid_lac`` for a writer's add whose X-Lac is past the entries it carries: a
    writer confirms an entry only once Qa replicas stored it, so the LAC it sends with an add
    is below the add's entries (BookKeeper packs the LAC into the entry when it first sends
    it). Stored, a LAC past every entry would have readers and a recovery take entries that
    no replica holds for confirmed. A recovery add (X-Recovery-Add) is exempt: the copy of
    a closed ledger's older fragment carries the ledger's end, known from the metadata."""
    if not replica.recovery and replica.lac > last_entry_id:
        raise ApiError(
            422,
            protocol.INVALID_LAC,
            f"{protocol.LAC_HEADER} {replica.lac} is past the add's last entry "
            f"{last_entry_id}: a writer's LAC never runs ahead of what it sends",
        )


def _fenced(app: web.Application, error: Exception) -> None:
    if isinstance(error, LedgerFenced):
        app[METRICS].replica_adds_refused_fenced.inc()


async def replica_add(
    app: web.Application, ledger_id: int, content_type: str, header: HeaderGetter, body: bytes
) -> bytes:
    """POST /api/v1/ledgers/{lid}/entries with X-Replicated, once its body is read: the 201
    reply's JSON (``lac`` is the writer's LAC as the adds carried it)."""
    first, replica = _replica_headers(header)
    entries = await _replica_entries(app, content_type, first, body)
    _lac_within(replica, max(entry_id for entry_id, _payload in entries))
    started = time.perf_counter()
    try:
        meta = await app[STORAGE].add_replica(ledger_id, entries, replica)
    except StorageError as e:
        _fenced(app, e)
        raise
    app[METRICS].add_latency_batch.observe(time.perf_counter() - started)
    return BATCH_REPLY % (ledger_id, entries[0][0], entries[-1][0], meta.writer_lac)


def begin_replica_add(
    app: web.Application, ledger_id: int, header: HeaderGetter, body: bytes
) -> PendingAdd | None:
    """``begin_add`` of a replica add of one raw entry (the fast lane): the add queued, or
    None when ``replica_add`` must do it (the ledger's first add, a resend, a full cache)."""
    first, replica = _replica_headers(header)
    entry_id = _first_id(first)
    _lac_within(replica, entry_id)
    try:
        return app[STORAGE].begin_replica_add(ledger_id, entry_id, body, replica)
    except StorageError as e:
        _fenced(app, e)
        raise


def finish_replica_add(app: web.Application, pending: PendingAdd, started: float) -> bytes:
    """The 201 reply of a ``begin_replica_add`` whose future is done, or its error."""
    entry_id = app[STORAGE].finish_replica_add(pending)
    app[METRICS].add_latency_single.observe(time.perf_counter() - started)
    meta = pending.meta
    return BATCH_REPLY % (meta.ledger_id, entry_id, entry_id, meta.writer_lac)


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
    if protocol.REPLICATED_HEADER in request.headers:
        reply = await replica_add(
            request.app,
            ledger_id,
            _content_type(request),
            request.headers.get,
            await request.read(),
        )
    else:
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
    storage = _storage(request)
    fence = _flag(request, "fence")
    replication = _replication(request)
    started = time.perf_counter()
    async with ReplyBytes(request.app, 0) as reply:
        try:
            if fence:  # the fence is durable before the lookup (see fencing_read)
                request.app[METRICS].replica_fences.inc()
                payload = await storage.fencing_read(ledger_id, entry_id, replication)
            else:
                payload = await storage.read_entry(ledger_id, entry_id)
        finally:
            _observe_read(request, "entry", started)
        await reply.admit(len(payload))  # the first entry of a reply: room, or 503
        headers = {protocol.LAC_HEADER: str(_lac_of(storage.ledger(ledger_id)))}
        return await send(request, reply, OCTET_CONTENT_TYPE, [payload], headers)


def _lac_of(meta: LedgerMeta) -> int:
    """The LAC a reader is told: the writer's for a replicated ledger, else the local one."""
    return meta.lac if meta.replication is None else meta.writer_lac


def _flag(request: web.Request, name: str) -> bool:
    value = request.query.get(name, "0")
    if value not in ("0", "1"):
        raise ApiError(400, "invalid_query", f"{name} is 0 or 1, not {value[:20]!r}")
    return value == "1"


def _replication(request: web.Request) -> tuple[int, int, int] | None:
    """E/Qw/Qa of X-Replicated when a reader sends it (then a ledger its fence creates
    knows its quorums), else None."""
    text = request.headers.get(protocol.REPLICATED_HEADER)
    return None if text is None else parse_replication(text)


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
    fence = _flag(request, "fence")
    replication = _replication(request)
    # Every query value is checked, also where a flag makes it moot: a malformed request is
    # refused the same way whatever else it asks.
    timeout_ms = parse_id(request.query.get("timeoutMs"), "timeoutMs", default=0)
    longest = request.app[SETTINGS].max_long_poll_ms
    if timeout_ms > longest:
        raise ApiError(400, "invalid_timeout", f"timeoutMs is at most {longest}")
    raw = request.query.get("after")
    after = -1 if raw == "-1" else parse_id(raw, "after", default=-1)  # -1: the first entry
    if _flag(request, "replicated"):
        if not fence:
            return _replica_lac(None, storage, ledger_id)
        request.app[METRICS].replica_fences.inc()
        return _replica_lac(await storage.fence_replica(ledger_id, replication), storage, ledger_id)
    if fence:
        raise ApiError(422, "invalid_flags", "fence=1 is a replica's read: add replicated=1")
    meta = storage.ledger(ledger_id)
    if meta.replication is not None:
        # The writer's LAC, at once: a replica holds a stripe, whose local LAC no add moves,
        # and readers of a replicated ledger learn its LAC from the metadata and the adds.
        lac = meta.writer_lac
    elif raw is not None:
        with cancelled_on_hangup(request):
            lac = await storage.wait_lac(ledger_id, after, timeout_ms / 1000)
    else:
        lac = meta.lac
    return json_response(models.Lac(ledgerId=ledger_id, lac=lac).to_json())


def _replica_lac(fenced: LedgerMeta | None, storage: LedgerStorage, ledger_id: int) -> web.Response:
    """A replica's view of its replicated ledger (after its fence, when ``fenced``)."""
    meta = fenced or storage.ledger(ledger_id)
    if meta.replication is None:
        raise ApiError(
            409, protocol.NOT_REPLICATED, f"ledger {ledger_id} is a local ledger of this node"
        )
    return json_response(
        models.ReplicaLac(
            ledgerId=ledger_id,
            lac=meta.writer_lac,
            lacLength=meta.writer_lac_length,
            lastEntryId=meta.last_entry_id,
            fenced=meta.state == LedgerState.FENCED,
        ).to_json()
    )
