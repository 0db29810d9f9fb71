"""The status page: ``GET /status`` with its assets from the package, and the JSON
routes it polls, documented in /openapi.json like every other.

The page is plain HTML, CSS and JavaScript in node/status/static/, served by the node itself
(clusters are often offline: no CDN, no web font) under a Content-Security-Policy that allows
nothing from elsewhere. The JSON routes only read: every change the page offers goes through
the existing admin routes, behind the admin token like any other client.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, cast

from aiohttp import web

from node import __version__
from node.http import models
from node.http.errors import ApiError
from node.http.jsonreply import json_response
from node.http.state import AUDIT, METRICS, SERVING, SETTINGS, STORAGE, STREAMS, WORK
from node.http.streams import stream_page
from node.lifecycle.metrics import StreamSnapshot, stream_snapshot, streams_now_ms, top_streams
from node.lifecycle.retention import SCHEDULER_TICK_S, disk_pressure
from node.settings import Settings, data_dirs
from node.status.entrylogs import MapCache, PinContext, build_map, pinned_after_s, scan_logs
from node.status.history import History, HistorySampler, Reading, histogram_buckets
from node.storage.clock import Clock
from node.storage.readonly import ReadOnlySource
from node.wire import CSS_CONTENT_TYPE, HTML_CONTENT_TYPE, JAVASCRIPT_CONTENT_TYPE

routes = web.RouteTableDef()

PAGE = "index.html"
# The assets the page loads, by the name in its URL: nothing from the request names a path.
ASSETS = {
    "status.css": CSS_CONTENT_TYPE,
    "status.js": JAVASCRIPT_CONTENT_TYPE,
}
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PINNED_LOGS_SHOWN = 5  # the oldest logs the map explains
PINS_PER_LOG = 10  # ledgers named per log, the largest first (a log may hold thousands)
MS_PER_S = 1000


@dataclass(slots=True)
class StatusState:
    """The page's own state: the metrics history and what the map and assets cache."""

    history: History
    clock: Clock
    sampler: HistorySampler | None = None
    maps: MapCache = field(default_factory=MapCache)
    assets: dict[str, bytes] = field(default_factory=dict)


STATUS = web.AppKey("status", StatusState)
# Set by node/http/app.py on a node with a metadata store: its replication block.
REPLICATION_SUMMARY: web.AppKey[Callable[[], dict[str, Any]]] = web.AppKey("replication_summary")
# ... and its fleet view (node/replication/fleet.py), read from the store when asked, cached.
FLEET_VIEW: web.AppKey[Callable[[], Awaitable[dict[str, Any]]]] = web.AppKey("fleet_view")


def install(app: web.Application, clock: Clock) -> None:
    """Routes, state and the history sampler (started and stopped with the application)."""
    settings = app[SETTINGS]
    history = History(settings.status_history_interval_s, settings.status_history_window_s, clock)
    app[STATUS] = StatusState(history=history, clock=clock)
    app.add_routes(routes)
    app.cleanup_ctx.append(_sampling)


async def _sampling(app: web.Application) -> AsyncIterator[None]:
    state = app[STATUS]
    state.sampler = HistorySampler(state.history, lambda: _reading(app), state.clock)
    state.sampler.start()
    yield
    await state.sampler.stop()


def _reading(app: web.Application) -> Reading:
    stats, metrics = app[STORAGE].stats, app[METRICS]
    return Reading(
        adds=stats.adds,
        add_bytes=stats.add_bytes,
        reads=stats.reads,
        read_bytes=stats.read_bytes,
        add_latency=histogram_buckets(metrics.add_latency),
        fsync_latency=histogram_buckets(metrics.journal_fsync_seconds),
    )


# --- the page and its assets ---------------------------------------------------------------


def _load_asset(name: str) -> bytes:
    """Blocking: package data (node/status/static), read once."""
    return (resources.files("node.status") / "static" / name).read_bytes()


async def _asset(app: web.Application, name: str) -> bytes:
    cache = app[STATUS].assets
    if name not in cache:
        cache[name] = await asyncio.to_thread(_load_asset, name)
    return cache[name]


def _headers(content_type: str) -> dict[str, str]:
    return {
        "Content-Type": content_type,
        "Content-Security-Policy": CONTENT_SECURITY_POLICY,
        "X-Content-Type-Options": "nosniff",
        # An upgraded node serves new assets at once: the browser asks again every time.
        "Cache-Control": "no-cache",
    }


@routes.get("/")
async def root(request: web.Request) -> web.Response:
    query = request.rel_url.query_string  # kept: /?poll=500 opens /status?poll=500
    raise web.HTTPFound(f"/status?{query}" if query else "/status")


@routes.get("/status")
async def page(request: web.Request) -> web.Response:
    body = await _asset(request.app, PAGE)
    return web.Response(body=body, headers=_headers(f"{HTML_CONTENT_TYPE}; charset=utf-8"))


@routes.get("/status/{asset}")
async def asset(request: web.Request) -> web.Response:
    name = request.match_info["asset"]
    content_type = ASSETS.get(name)
    if content_type is None:
        raise ApiError(404, "not_found", f"no status page asset {name[:60]!r}")
    body = await _asset(request.app, name)
    return web.Response(body=body, headers=_headers(f"{content_type}; charset=utf-8"))


# --- JSON ------------------------------------------------------------------------------------


def _disks(settings: Settings) -> list[models.StatusDisk]:
    """Blocking (statvfs): on a worker thread. A dir not made yet is measured at its parent."""
    disks = []
    for name, path in data_dirs(settings).items():
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        stat = os.statvfs(existing)
        total = stat.f_blocks * stat.f_frsize
        used = total - stat.f_bavail * stat.f_frsize
        disks.append(
            models.StatusDisk(
                dir=cast(models.DataDirName, name),
                path=str(path),
                usedBytes=max(0, used),
                totalBytes=total,
                usage=min(1.0, max(0.0, used / total)) if total else 0.0,
            )
        )
    return disks


def _state(app: web.Application) -> models.NodeStateName:
    storage, serving = app[STORAGE], app[SERVING]
    if serving.shutting_down:
        return "shutting_down"
    if not serving.started or not storage.running:
        return "starting"
    return "read_only" if storage.refuses_adds else "writable"


def _wal(app: web.Application, history: History) -> models.StatusWal:
    storage, settings, metrics = app[STORAGE], app[SETTINGS], app[METRICS]
    problem = None
    if not storage.running:
        problem = "the storage is not running"
    elif storage.read_only_source(ReadOnlySource.DISK):
        problem = storage.read_only_reason
    # The latest interval that made WAL writes: an idle node keeps showing its last figures.
    last = next((s for s in reversed(history.samples()) if s.fsync_p50_s is not None), None)
    ring = metrics.ring_figures
    mark = storage.last_checkpoint_mark
    return models.StatusWal(
        kind=settings.wal_kind,
        healthy=problem is None,
        problem=problem,
        queueBytes=storage.wal_queued_bytes,
        checkpoints=storage.stats.checkpoints,
        lastCheckpoint=f"{mark.log_id:x}:{mark.offset}",
        lastCheckpointMs=storage.stats.last_checkpoint_ms or None,
        sinceCheckpointBytes=storage.write_cache_bytes,
        groupWrites=int(histogram_buckets(metrics.journal_fsync_seconds).count),
        fsyncP50Seconds=last.fsync_p50_s if last else None,
        fsyncP99Seconds=last.fsync_p99_s if last else None,
        ringCapacityBytes=ring.ring_bytes if ring else None,
        ringUsedBytes=ring.ring_used_bytes if ring else None,
        blocksInFlight=ring.blocks_in_flight if ring else None,
        throttledAppends=ring.throttled_appends if ring else None,
        rejectedAppends=ring.rejected_appends if ring else None,
    )


def _gc(app: web.Application) -> models.StatusGc:
    gc, settings = app[WORK].gc, app[SETTINGS]
    stats, status = gc.stats, gc.status
    return models.StatusGc(
        runs=stats.runs,
        failures=stats.failures,
        lastSuccessMs=stats.last_success_ms,
        lastRunSeconds=stats.last_run_seconds,
        intervalSeconds=settings.gc_wait_time_ms / MS_PER_S,
        deletedLedgers=stats.deleted_ledgers,
        reclaimedBytes=stats.reclaimed_by_deletion_bytes + stats.reclaimed_by_compaction_bytes,
        knownLogs=gc.known_logs(),
        inForceGc=gc.in_force_gc,
        majorSuspended=status.major_suspended,
        minorSuspended=status.minor_suspended,
        details=models.GcStatus.model_validate(status.as_bookkeeper()),
    )


def _retention(app: web.Application, disks: list[models.StatusDisk]) -> models.StatusRetention:
    stats, settings = app[WORK].retention.stats, app[SETTINGS]
    fullest = max((d.usage for d in disks), default=0.0)
    return models.StatusRetention(
        cleanAbove=settings.disk_max_used_space_ratio,
        pressureRunSeconds=SCHEDULER_TICK_S,
        forcedAbove=settings.disk_space_clean_forcibly_ratio,
        diskUsage=fullest,
        diskPressure=disk_pressure(settings, fullest),
        runs=stats.runs,
        lastRunMs=stats.last_run_ms or None,
        deletedLedgers=sum(stats.deleted.values()),
        deletedBytes=sum(stats.deleted_bytes.values()),
        schedulerEnabled=settings.retention_scheduler_enabled,
        deleteWhen=settings.delete_when,
    )


def _offload(app: web.Application) -> models.StatusOffload:
    offload, settings = app[WORK].offload, app[SETTINGS]
    totals = offload.summary()["totals"]
    return models.StatusOffload(
        runs=offload.stats.runs,
        lastRunMs=offload.last_run_ms,
        lastError=offload.last_error,
        offloadedLedgers=totals["offloadedLedgers"],
        offloadedBytes=totals["offloadedBytes"],
        inProgress=totals["inProgress"],
        awaitingDeletionBytes=totals["awaitingDeletionBytes"],
        lagSeconds=totals["lagSeconds"],
        uploadFailures=offload.stats.upload_failures,
        schedulerEnabled=settings.offload_scheduler_enabled,
    )


def _audit(app: web.Application) -> models.StatusAudit | None:
    last = app[AUDIT].last
    if last is None:
        return None
    summary = last.summary
    return models.StatusAudit(
        receivedMs=last.receivedMs,
        finishedMs=summary["finishedMs"],
        status=summary["status"],
        violations={name: check["violations"] for name, check in summary["checks"].items()},
    )


def _status_stream(s: StreamSnapshot) -> models.StatusStream:
    return models.StatusStream(
        name=s.name,
        ledgers=s.ledgers,
        retainedBytes=s.retained_bytes,
        cursors=[
            models.StatusCursor(
                name=c.name,
                markDeletePosition=None if c.mark_delete is None else str(c.mark_delete),
                backlogEntries=c.backlog_entries,
                backlogBytes=c.backlog_bytes,
                oldestUnacknowledgedAgeSeconds=c.oldest_unacknowledged_age_s,
            )
            for c in s.cursors
        ],
        cursorCount=s.cursor_count,
        deduplication=None
        if s.dedup is None
        else models.StatusDedup(
            duplicates=s.dedup[0], producers=s.dedup[1], snapshotAgeSeconds=s.dedup[2]
        ),
    )


def _streams(app: web.Application) -> tuple[list[models.StatusStream], models.StatusStreamTotals]:
    """The streams /metrics gives series of their own (the page polls this every 2 s: a node
    with thousands of streams must not send them all), with totals over every stream."""
    top, totals = top_streams(app[STREAMS], app[SETTINGS].metrics_max_streams)
    return [_status_stream(s) for s in top], models.StatusStreamTotals(
        streams=totals.streams,
        shown=len(top),
        cursors=totals.cursors,
        backlogEntries=totals.backlog_entries,
        backlogBytes=totals.backlog_bytes,
        retainedBytes=totals.retained_bytes,
        oldestUnacknowledgedAgeSeconds=totals.oldest_unacknowledged_age_s,
    )


@routes.get("/api/v1/status/summary")
async def summary(request: web.Request) -> web.Response:
    app = request.app
    settings, storage, state = app[SETTINGS], app[STORAGE], app[STATUS]
    disks = await asyncio.to_thread(_disks, settings)
    stats = storage.stats
    streams, stream_totals = _streams(app)
    reply = models.StatusSummary(
        nodeId=settings.node_id,
        version=__version__,
        state=_state(app),
        readOnlyReason=storage.read_only_reason,
        nowMs=state.clock.now_ms(),
        startedMs=int(app[METRICS].start_time_s * MS_PER_S),
        adminTokenRequired=settings.admin_token is not None,
        disks=disks,
        watermarks=models.StatusWatermarks(
            gc=settings.gc_disk_usage_threshold,
            warn=settings.disk_usage_warn_threshold,
            readOnly=settings.disk_usage_threshold,
            writableAgain=settings.disk_usage_lwm_threshold,
        ),
        wal=_wal(app, state.history),
        counters=models.StatusCounters(
            adds=stats.adds,
            addBytes=stats.add_bytes,
            reads=stats.reads,
            readBytes=stats.read_bytes,
            throttledAdds=stats.throttled_adds,
            rejectedAdds=stats.rejected_adds,
        ),
        gc=_gc(app),
        retention=_retention(app, disks),
        offload=_offload(app),
        audit=_audit(app),
        streams=streams,
        streamTotals=stream_totals,
        replication=await _replication(app),
    )
    return json_response(reply.to_json())


async def _replication(app: web.Application) -> models.StatusReplication:
    summary, fleet = app.get(REPLICATION_SUMMARY), app.get(FLEET_VIEW)
    if summary is None:
        return models.StatusReplication(enabled=False)
    view = models.StatusFleet.model_validate(await fleet()) if fleet is not None else None
    return models.StatusReplication(**summary(), fleet=view)


@routes.get("/api/v1/status/streams")
async def streams_page(request: web.Request) -> web.Response:
    """Every stream, a page at a time in name order: what the summary leaves out."""
    offset, limit = stream_page(request)
    manager = request.app[STREAMS]
    everything = manager.streams()
    now_ms = streams_now_ms()
    reply = models.StatusStreamPage(
        total=len(everything),
        offset=offset,
        limit=limit,
        streams=[
            _status_stream(stream_snapshot(manager, stream, now_ms))
            for stream in everything[offset : offset + limit]
        ],
    )
    return json_response(reply.to_json())


@routes.get("/api/v1/status/history")
async def history(request: web.Request) -> web.Response:
    h = request.app[STATUS].history
    reply = models.StatusHistory(
        intervalSeconds=h.interval_s,
        windowSeconds=h.window_s,
        samples=[
            models.StatusSample(
                timeMs=s.time_ms,
                addsPerSecond=s.adds_per_s,
                readsPerSecond=s.reads_per_s,
                addBytesPerSecond=s.add_bytes_per_s,
                readBytesPerSecond=s.read_bytes_per_s,
                addP50Seconds=s.add_p50_s,
                addP99Seconds=s.add_p99_s,
                fsyncP50Seconds=s.fsync_p50_s,
                fsyncP99Seconds=s.fsync_p99_s,
            )
            for s in h.samples()
        ],
    )
    return json_response(reply.to_json())


def _sealed(app: web.Application) -> set[int]:
    """Blocking (waits for a checkpoint in progress): on a worker thread."""
    storage = app[STORAGE]
    return set(storage.gc_candidate_logs()) if storage.running else set()


@routes.get("/api/v1/status/entrylogs")
async def entry_logs(request: web.Request) -> web.Response:
    app = request.app
    settings, storage, manager, state = app[SETTINGS], app[STORAGE], app[STREAMS], app[STATUS]
    ledgers_dir: Path = settings.ledgers_dir
    sealed = await asyncio.to_thread(_sealed, app)
    logs = await asyncio.to_thread(scan_logs, ledgers_dir, sealed, state.maps)
    now_ms = state.clock.now_ms()
    ctx = PinContext(
        ledgers={
            m.ledger_id: m
            for m in list(storage.all_ledgers())
            if storage.is_live_ledger(m.ledger_id)
        },
        streams={s.name: s for s in manager.streams()},
        cursors={s.name: manager.cursors(s.name) for s in manager.streams()},
        now_ms=now_ms,
        offload_deletion_lag_ms=settings.managed_ledger_offload_deletion_lag_ms,
    )
    old_after_s = pinned_after_s(
        settings.default_retention_time_in_minutes, settings.major_compaction_interval_s
    )
    built = build_map(logs, ctx, old_after_s, PINNED_LOGS_SHOWN, PINS_PER_LOG)
    reply = models.StatusEntryLogs(
        nowMs=now_ms,
        logSizeLimitBytes=settings.log_size_limit,
        oldAfterSeconds=old_after_s,
        logs=[
            models.StatusLogCell(
                logId=f"{c.log_id:x}",
                sizeBytes=c.size_bytes,
                ageSeconds=c.age_s,
                sealed=c.sealed,
                ledgers=c.ledgers,
                liveBytes=c.live_bytes,
                usage=c.usage,
            )
            for c in built.logs
        ],
        oldestPinned=[
            models.StatusPinnedLog(
                logId=f"{p.log_id:x}",
                ageSeconds=p.age_s,
                liveLedgers=p.live_ledgers,
                old=p.old,
                pins=[
                    models.StatusPin(
                        ledgerId=pin.ledger_id,
                        bytes=pin.size_bytes,
                        reason=pin.reason,
                        detail=pin.detail,
                        stream=pin.stream,
                        cursor=pin.cursor,
                    )
                    for pin in p.pins
                ],
            )
            for p in built.oldest_pinned
        ],
    )
    return json_response(reply.to_json())
