"""Stream, cursor and retention routes (docs/api.md, "Streams").

Positions are written ``L:E``. A stream read returns stream frames (node/wire.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from node.client.errors import MetadataError
from node.http import models
from node.http.connections import cancelled_on_hangup
from node.http.errors import ApiError
from node.http.forward import FORWARDED_BY, FORWARDER, NOT_OWNER, OwnerMoved, forwarded
from node.http.jsonreply import LINE_END, json_response
from node.http.ledgers import decode_payloads, parse_id, unsupported
from node.http.replies import ReplyBytes, send
from node.http.state import METRICS, SETTINGS, STREAMS, WORK
from node.streams.dedup import (
    DUPLICATE_HEADER,
    PRODUCER_HEADER,
    SEQUENCE_HEADER,
    InvalidProducerHeaders,
    parse_producer,
)
from node.streams.manager import Read, StreamManager, parse_position
from node.streams.model import NAME, Cursor, LedgerInfo, Position, Replication, Stream
from node.wire import (
    BATCH_CONTENT_TYPE,
    JSON_CONTENT_TYPE,
    RAW_CONTENT_TYPES,
    STREAM_CONTENT_TYPE,
    STREAM_HEADER,
    media_type,
    stream_pieces,
)

if TYPE_CHECKING:
    from node.client.registry import Registry
    from node.streams.router import StreamRouter

routes = web.RouteTableDef()
# Which node serves each replicated stream (only on a node with a metadata store).
STREAM_ROUTER: web.AppKey[StreamRouter] = web.AppKey("stream_router")
# The fleet's registered nodes (with STREAM_ROUTER): who may have forwarded a request here.
NODE_REGISTRY: web.AppKey[Registry] = web.AppKey("node_registry")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

LOCAL = Replication(1, 1, 1)  # a stream of a node without a metadata store: its own ledgers
DEFAULT_READ_LIMIT = 100
MAX_READ_LIMIT = 10_000
# The stream lists (GET /api/v1/streams, /api/v1/status/streams): streams per page unless
# asked, and at most (a page of 1,000 is ~200 KB of JSON; 2,000 streams in one were 1.3 MB).
STREAM_PAGE_DEFAULT = 100
STREAM_PAGE_MAX = 1000


def _streams(request: web.Request) -> StreamManager:
    return request.app[STREAMS]


async def owner_url(app: web.Application, name: str, *, create: bool = False) -> str | None:
    """Where a request about stream ``name`` is served: None here, else the owner's URL
    (a replicated stream another node owns). A node with no live owner to ask takes the
    stream over (node.streams.router)."""
    router = app.get(STREAM_ROUTER)
    if router is None:
        return None
    return await router.route(name, create=create)


async def not_twice(request: web.Request, stream: str, url: str) -> None:
    """One hop: a request forwarded here that this node would send on is refused, with
    what happened: ownership moved while a node forwarded it (503 ``not_owner``, retry), or
    the header names no node of the fleet (400 ``invalid_header``: a client or a proxy set
    it, and a retry would be refused alike)."""
    if not forwarded(request):
        return
    by = request.headers[FORWARDED_BY]
    where = (
        f"stream {stream[:100]!r} is served by the node at {url}, not by this node "
        f"({request.app[SETTINGS].id!r})"
    )
    known = await _registered(request.app, by)
    if known is False:
        raise ApiError(
            400,
            "invalid_header",
            f"{where}, and the request carries {FORWARDED_BY}: {by[:100]!r}, which names no "
            "node of the fleet: only a node sets it, on the one hop it forwards a request. "
            f"Send the request without {FORWARDED_BY}",
        )
    said = (
        f"node {by[:100]!r} forwarded this request here as the owner"
        if known
        else f"the request says node {by[:100]!r} forwarded it here ({FORWARDED_BY})"
    )
    raise ApiError(
        503,
        NOT_OWNER,
        f"{where}; {said}, so ownership moved while it was on its way, and a forwarded "
        "request is never sent on: retry",
    )


async def _registered(app: web.Application, node_id: str) -> bool | None:
    """Whether ``node_id`` is a registered node (None: the store did not answer)."""
    registry = app[NODE_REGISTRY]
    try:
        await registry.nodes()
    except MetadataError:
        return None
    return registry.registered(node_id)


def served(*, create: bool = False) -> Callable[[Handler], Handler]:
    """A route of one stream: answered here when this node serves the stream, otherwise
    forwarded to the node that does (one hop: a forwarded request is never sent on)."""

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def route(request: web.Request) -> web.StreamResponse:
            url = await owner_url(request.app, _name(request), create=create)
            if url is None:
                return await handler(request)
            await not_twice(request, _name(request), url)
            router, name = request.app[STREAM_ROUTER], _name(request)
            router.forwarded += 1
            try:
                return await request.app[FORWARDER].forward(
                    request,
                    url,
                    raise_moved=True,
                    owner_lost=functools.partial(router.until_owner_changes, name, url),
                )
            except OwnerMoved:
                # The node remembered as the owner no longer is (a takeover since) or is
                # gone (it stopped), and it did nothing with the request: ask the store
                # again, once (with the owner's key gone, this node takes the stream over).
                router.forget_owner(name)
            except ApiError:
                router.forget_owner(name)
                raise
            url = await owner_url(request.app, name, create=create)
            if url is None:
                return await handler(request)
            return await request.app[FORWARDER].forward(
                request, url, owner_lost=functools.partial(router.until_owner_changes, name, url)
            )

        return route

    return wrap


def _name(request: web.Request) -> str:
    return request.match_info["name"]


async def _position_field(request: web.Request) -> Position:
    return parse_position(models.POSITION_BODY.parse(await request.read())["position"])


def _limit_and_wait(request: web.Request) -> tuple[int, float]:
    limit = parse_id(request.query.get("limit"), "limit", default=DEFAULT_READ_LIMIT)
    if not 1 <= limit <= MAX_READ_LIMIT:
        raise ApiError(400, "invalid_limit", f"limit must be in [1, {MAX_READ_LIMIT}]")
    wait_ms = parse_id(request.query.get("waitMs"), "waitMs", default=0)
    longest = request.app[SETTINGS].max_long_poll_ms
    if wait_ms > longest:
        raise ApiError(400, "invalid_timeout", f"waitMs is at most {longest}")
    return limit, wait_ms / 1000


def _stream_model(
    streams: StreamManager, stream: Stream, owner: str | None = None
) -> models.Stream:
    """A stream this node serves: its open ledger's count is the LAC now."""
    cursors = [_cursor_model(streams, c) for c in streams.cursors(stream.name)]
    return _stream_reply(stream, lambda info: streams._last_entry(info) + 1, cursors, owner)


def _record_model(stream: Stream, owner: str | None) -> models.Stream:
    """A replicated stream another node serves, as its record in the metadata store has it
    (the open ledger's count as of the last record write; its owner has the cursors)."""
    return _stream_reply(stream, lambda info: info.entries, [], owner)


def _stream_reply(
    stream: Stream,
    entries: Callable[[LedgerInfo], int],
    cursors: list[models.Cursor],
    owner: str | None,
) -> models.Stream:
    ledgers = [
        models.StreamLedger(
            ledgerId=info.ledger_id,
            entries=entries(info),
            bytes=info.size_bytes,
            createdTime=info.created_ms,
            closedTime=info.closed_ms or None,
        )
        for info in stream.ledgers
    ]
    return models.Stream(
        name=stream.name,
        createdTime=stream.created_ms,
        policies=models.PolicyValues(**stream.policies.to_json()),
        replication=models.Replication(**(stream.replication or LOCAL).to_json()),
        ledgers=ledgers,
        entries=sum(item.entries for item in ledgers),
        bytes=sum(info.size_bytes for info in stream.ledgers),
        oldestDataTime=stream.ledgers[0].created_ms if stream.ledgers else None,
        cursors=cursors,
        owner=owner,
    )


def _owner_here(app: web.Application) -> str | None:
    """The owner field of the streams this node serves: its id on a node with a metadata
    store (replicated streams have one owner among many), None without."""
    return app[SETTINGS].id if STREAM_ROUTER in app else None


def _stream_json(request: web.Request, stream: Stream) -> dict[str, Any]:
    return _stream_model(_streams(request), stream, _owner_here(request.app)).to_json()


def _cursor_model(streams: StreamManager, cursor: Cursor) -> models.Cursor:
    backlog = streams.backlog(cursor.stream, cursor.mark_delete)
    shown = streams.stream(cursor.stream).shown_mark(cursor.mark_delete)
    return models.Cursor(
        name=cursor.name,
        markDeletePosition=None if shown is None else str(shown),
        backlogEntries=backlog.entries,
        backlogBytes=backlog.size_bytes,
        createdTime=cursor.created_ms,
    )


def _cursor_json(streams: StreamManager, cursor: Cursor) -> dict[str, Any]:
    return _cursor_model(streams, cursor).to_json()


async def _frames(request: web.Request, reply: ReplyBytes, found: Read) -> web.StreamResponse:
    headers = (
        {"X-Next-Position": str(Position(found[-1][0].ledger_id, found[-1][0].entry_id + 1))}
        if found
        else {}
    )
    return await send(request, reply, STREAM_CONTENT_TYPE, stream_pieces(found), headers)


def stream_page(request: web.Request) -> tuple[int, int]:
    """``offset`` and ``limit`` of a stream list's page (400 out of bounds)."""
    offset = parse_id(request.query.get("offset"), "offset", default=0)
    limit = parse_id(request.query.get("limit"), "limit", default=STREAM_PAGE_DEFAULT)
    if not 1 <= limit <= STREAM_PAGE_MAX:
        raise ApiError(400, "invalid_limit", f"limit must be in [1, {STREAM_PAGE_MAX}]")
    return offset, limit


@routes.get("/api/v1/streams")
async def list_streams(request: web.Request) -> web.Response:
    """A page of the streams in name order; with a metadata store, the fleet's."""
    offset, limit = stream_page(request)
    streams, here = _streams(request), _owner_here(request.app)
    # Each row's reply is made only for the page: a stream's cursors and backlogs cost.
    rows: list[tuple[str, Callable[[], models.Stream]]] = [
        (s.name, functools.partial(_stream_model, streams, s, here)) for s in streams.streams()
    ]
    router = request.app.get(STREAM_ROUTER)
    if router is not None:
        rows += [
            (s.name, functools.partial(_record_model, s, owner))
            for s, owner in await router.elsewhere()
        ]
    rows.sort(key=lambda row: row[0])
    page = [make() for _name, make in rows[offset : offset + limit]]
    reply = models.StreamList(streams=page, total=len(rows), offset=offset, limit=limit)
    return json_response(reply.to_json())


@routes.put("/api/v1/streams/{name}")
@served(create=True)
async def put_stream(request: web.Request) -> web.Response:
    streams = _streams(request)
    given = dict(models.STREAM_POLICIES.parse(await request.read()))
    replication = given.pop("replication", None)
    stream, created = await streams.put_stream(
        _name(request),
        given,
        None if replication is None else Replication.from_json(replication),  # type: ignore[arg-type]
    )
    return json_response(_stream_json(request, stream), status=201 if created else 200)


@routes.get("/api/v1/streams/{name}")
@served()
async def get_stream(request: web.Request) -> web.Response:
    streams = _streams(request)
    return json_response(_stream_json(request, streams.stream(_name(request))))


@routes.delete("/api/v1/streams/{name}")
@served()
async def delete_stream(request: web.Request) -> web.Response:
    await _streams(request).delete_stream(_name(request))
    router = request.app.get(STREAM_ROUTER)
    if router is not None:
        await router.release(_name(request))
    return web.Response(status=204)


@routes.post("/api/v1/streams/{name}/entries")
@served()
async def append(request: web.Request) -> web.Response:
    content_type = media_type(request.headers.get("Content-Type", ""))
    producer = request.headers.get(PRODUCER_HEADER), request.headers.get(SEQUENCE_HEADER)
    reply, duplicate = await add(
        request.app, _name(request), content_type, await request.read(), producer
    )
    if duplicate:
        return web.Response(
            body=reply,
            status=200,
            content_type=JSON_CONTENT_TYPE,
            headers={DUPLICATE_HEADER: "true"},
        )
    return web.Response(body=reply, status=201, content_type=JSON_CONTENT_TYPE)


NO_PRODUCER: tuple[str | None, str | None] = (None, None)


async def add(
    app: web.Application,
    name: str,
    content_type: str,
    body: bytes,
    producer: tuple[str | None, str | None] = NO_PRODUCER,
) -> tuple[bytes, bool]:
    """POST /api/v1/streams/{name}/entries once its body is read: the reply's JSON, and
    whether it is a duplicate (200, ``X-Duplicate: true``; else 201). ``producer``: the
    X-Producer-Id and X-Sequence-Id values (node.streams.dedup). The route and the fast lane
    (fastlane.py) both answer through this."""
    if content_type == BATCH_CONTENT_TYPE:
        payloads = await decode_payloads(app, body)
    elif content_type in RAW_CONTENT_TYPES:
        payloads = [body]
    else:
        raise unsupported(content_type)
    limit = app[SETTINGS].max_entry_size
    if any(len(p) > limit for p in payloads):
        raise ApiError(413, "entry_too_large", f"an entry exceeds max_entry_size {limit}")
    started = time.perf_counter()
    duplicate = False
    if producer is NO_PRODUCER:
        positions = await app[STREAMS].append(name, payloads)
    else:
        try:
            named = parse_producer(*producer, len(payloads))
        except InvalidProducerHeaders as e:
            raise ApiError(400, e.code, str(e)) from None
        if named is None:
            positions = await app[STREAMS].append(name, payloads)
        else:
            positions, duplicate = await app[STREAMS].append_once(name, payloads, *named)
    app[METRICS].add_latency_stream.observe(time.perf_counter() - started)
    if not positions:  # a duplicate older than the runs of appends its producer's entry keeps
        if content_type == BATCH_CONTENT_TYPE:
            return b'{"firstPosition": null, "lastPosition": null}%s' % LINE_END, duplicate
        return b'{"position": null}%s' % LINE_END, duplicate
    if content_type == BATCH_CONTENT_TYPE:
        # A batch lands in one ledger at consecutive entry ids: first and last name them all.
        return b'{"firstPosition": "%s", "lastPosition": "%s"}%s' % (
            str(positions[0]).encode(),
            str(positions[-1]).encode(),
            LINE_END,
        ), duplicate
    return b'{"position": "%s"}%s' % (str(positions[0]).encode(), LINE_END), duplicate


@routes.get("/api/v1/streams/{name}/producers/{producerId}")
@served()
async def get_producer(request: web.Request) -> web.Response:
    """Pulsar's getLastSequenceId: where a restarting producer resumes (node.streams.dedup)."""
    producer = request.match_info["producerId"]
    if not NAME.fullmatch(producer):
        raise ApiError(
            400,
            "invalid_producer_id",
            f"a producer id is 1-255 of [A-Za-z0-9._-], not {producer[:60]!r}",
        )
    last, position = await _streams(request).last_sequence(_name(request), producer)
    reply = models.ProducerSequence(
        producerId=producer, lastSequenceId=last, position=str(position)
    )
    return json_response(reply.to_json())


@routes.get("/api/v1/streams/{name}/entries")
@served()
async def read(request: web.Request) -> web.StreamResponse:
    start = parse_position(request.query["from"]) if "from" in request.query else None
    limit, wait_s = _limit_and_wait(request)
    async with ReplyBytes(request.app, STREAM_HEADER.size) as reply:
        with cancelled_on_hangup(request):  # reads only: nothing is left half done
            found = await _streams(request).read(_name(request), start, limit, wait_s, reply.admit)
        return await _frames(request, reply, found)


@routes.put("/api/v1/streams/{name}/cursors/{cursor}")
@served()
async def create_cursor(request: web.Request) -> web.Response:
    start = models.CREATE_CURSOR.parse(await request.read()).get("start", "latest")
    streams = _streams(request)
    cursor, created = await streams.create_cursor(
        _name(request), request.match_info["cursor"], start
    )
    return json_response(_cursor_json(streams, cursor), status=201 if created else 200)


@routes.get("/api/v1/streams/{name}/cursors/{cursor}")
@served()
async def get_cursor(request: web.Request) -> web.Response:
    streams = _streams(request)
    return json_response(
        _cursor_json(streams, streams.cursor(_name(request), request.match_info["cursor"]))
    )


@routes.delete("/api/v1/streams/{name}/cursors/{cursor}")
@served()
async def delete_cursor(request: web.Request) -> web.Response:
    await _streams(request).delete_cursor(_name(request), request.match_info["cursor"])
    return web.Response(status=204)


@routes.get("/api/v1/streams/{name}/cursors/{cursor}/entries")
@served()
async def read_cursor(request: web.Request) -> web.StreamResponse:
    limit, wait_s = _limit_and_wait(request)
    async with ReplyBytes(request.app, STREAM_HEADER.size) as reply:
        found = await _streams(request).read_cursor(
            _name(request), request.match_info["cursor"], limit, wait_s, reply.admit
        )
        return await _frames(request, reply, found)


@routes.post("/api/v1/streams/{name}/cursors/{cursor}/ack")
@served()
async def acknowledge(request: web.Request) -> web.Response:
    position = await _position_field(request)
    streams = _streams(request)
    cursor = await streams.acknowledge(_name(request), request.match_info["cursor"], position)
    return json_response(_cursor_json(streams, cursor))


@routes.post("/api/v1/streams/{name}/cursors/{cursor}/reset")
@served()
async def reset(request: web.Request) -> web.Response:
    position = await _position_field(request)
    streams = _streams(request)
    cursor = await streams.reset(_name(request), request.match_info["cursor"], position)
    return json_response(_cursor_json(streams, cursor))


@routes.post("/api/v1/retention/run")
async def run_retention(request: web.Request) -> web.Response:
    dry_run = request.query.get("dryRun", "false").lower()
    if dry_run not in ("true", "false"):
        raise ApiError(400, "invalid_query", "dryRun is true or false")
    done = await request.app[WORK].retention.run(dry_run=dry_run == "true")
    result = models.RetentionResult.model_validate(
        {
            "dryRun": dry_run == "true",
            "streams": {name: [d.to_json() for d in plan] for name, plan in done.items()},
        }
    )
    return json_response(result.to_json())
