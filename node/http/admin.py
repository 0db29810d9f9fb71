"""The admin API at BookKeeper's paths and in its response shapes (bookkeeper-server
``server/http/service/*``), plus /metrics."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, get_args
from urllib.parse import urlsplit, urlunsplit

from aiohttp import web
from pydantic import SecretStr

from node.http import models
from node.http.errors import ApiError
from node.http.jsonreply import json_response
from node.http.state import METRICS, SERVING, SETTINGS, STATE_METRICS, STORAGE, STREAMS, WORK
from node.settings import Settings, data_dirs
from node.storage import journalformat, logformat
from node.wire import METRICS_CONTENT_TYPE

routes = web.RouteTableDef()

READ_ONLY_BY_OPERATOR = "set by an operator (PUT /api/v1/bookie/state/readonly)"
NOT_READY = "Bookie is not fully started yet"
WAL_FAILED = "the WAL failed for good and takes no more adds; restart the node"
# BookKeeper's list_disk_file keys, by file_type.
DISK_FILE_KINDS = {"journal": "journal files", "entrylog": "entrylog files", "index": "index files"}


@routes.get("/heartbeat")
async def heartbeat(request: web.Request) -> web.Response:
    return web.Response(text="OK\n")


@routes.get("/api/v1/bookie/info")
async def bookie_info(request: web.Request) -> web.Response:
    free, total = await asyncio.to_thread(_space, request.app[SETTINGS])
    return json_response(models.Space(freeSpace=free, totalSpace=total).to_json())


def _space(settings: Settings) -> tuple[int, int]:
    """Free and total bytes over the distinct file systems of the data dirs (as
    BookKeeper sums over distinct FileStores)."""
    seen: dict[int, tuple[int, int]] = {}
    for path in data_dirs(settings).values():
        existing = path if path.exists() else settings.data_dir
        if not existing.exists():
            continue
        stat = os.statvfs(existing)
        seen[os.stat(existing).st_dev] = (
            stat.f_bavail * stat.f_frsize,
            stat.f_blocks * stat.f_frsize,
        )
    return sum(f for f, _ in seen.values()), sum(t for _, t in seen.values())


def _state(request: web.Request) -> dict[str, bool]:
    storage = request.app[STORAGE]
    serving = request.app[SERVING]
    running = serving.started and storage.running and not serving.shutting_down
    read_only = storage.refuses_adds
    return {
        "running": running,
        "readOnly": read_only,
        "shuttingDown": serving.shutting_down,
        "availableForHighPriorityWrites": running and not read_only,
    }


@routes.get("/api/v1/bookie/state")
async def bookie_state(request: web.Request) -> web.Response:
    return json_response(models.BookieState(**_state(request)).to_json())


def _read_only(request: web.Request) -> web.Response:
    read_only = request.app[STORAGE].refuses_adds
    return json_response(models.ReadOnlyState(readOnly=read_only).to_json())


@routes.get("/api/v1/bookie/state/readonly")
async def get_read_only(request: web.Request) -> web.Response:
    return _read_only(request)


@routes.put("/api/v1/bookie/state/readonly")
async def put_read_only(request: web.Request) -> web.Response:
    body = models.READ_ONLY.parse(await request.read())
    request.app[STORAGE].set_read_only(READ_ONLY_BY_OPERATOR if body["readOnly"] else None)
    return _read_only(request)


@routes.get("/api/v1/bookie/is_ready")
async def is_ready(request: web.Request) -> web.Response:
    if not _state(request)["running"]:
        raise ApiError(503, "not_ready", NOT_READY)
    failure = request.app[STORAGE].wal_failure
    if failure is not None:
        raise ApiError(503, "not_ready", f"{WAL_FAILED}: {failure}")
    return web.Response(text="OK")


@routes.get("/api/v1/bookie/list_disk_file")
async def list_disk_file(request: web.Request) -> web.Response:
    kind = request.query.get("file_type")
    if kind is not None and kind not in DISK_FILE_KINDS:
        raise ApiError(
            400, "invalid_file_type", f"file_type must be one of {', '.join(DISK_FILE_KINDS)}"
        )
    kinds = [kind] if kind else list(DISK_FILE_KINDS)
    listing = await asyncio.to_thread(_list_files, request.app[SETTINGS], kinds)
    return json_response(listing)


def _list_files(settings: Settings, kinds: list[str]) -> dict[str, str]:
    """File names only, from the node's own directories: nothing from the request names a
    path. Tab separated with a trailing tab, as BookKeeper prints them."""
    where: dict[str, tuple[Path, str]] = {
        "journal": (settings.journal_dir, journalformat.SUFFIX),
        "entrylog": (settings.ledgers_dir, logformat.SUFFIX),
        "index": (settings.index_dir, ""),
    }
    listing = {}
    for kind in kinds:
        directory, suffix = where[kind]
        try:
            names = sorted(
                e.name for e in os.scandir(directory) if e.is_file() and e.name.endswith(suffix)
            )
        except FileNotFoundError:
            names = []
        listing[DISK_FILE_KINDS[kind]] = "".join(f"{name}\t" for name in names)
    return listing


@routes.get("/api/v1/bookie/last_log_mark")
async def last_log_mark(request: web.Request) -> web.Response:
    """BookKeeper's shape for the file journal; the ring's trim offset for the block WAL,
    which has no journal files."""
    settings = request.app[SETTINGS]
    mark = request.app[STORAGE].last_checkpoint_mark
    if settings.wal_kind == "journal":
        key = f"LastLogMark: Journal Id - {mark.log_id}({mark.log_id:x}{journalformat.SUFFIX})"
    else:
        key = f"LastLogMark: WAL {settings.wal_path}"
    return json_response({key: f"Pos - {mark.offset}"})


MASK = "******"
# Never echoed: every secret, and the names that go with one (an access key id names the
# account a leaked secret would open).
CREDENTIALS = frozenset(
    {
        name
        for name, field in Settings.model_fields.items()
        if SecretStr in (field.annotation, *get_args(field.annotation))
    }
    | {"offload_access_key_id"}
)


def _masked_url(url: str) -> str:
    """``url`` without the user and password it may carry (http://user:secret@minio:9000)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=f"{MASK}@{parts.netloc.rpartition('@')[2]}"))


@routes.get("/api/v1/config/server_config")
async def server_config(request: web.Request) -> web.Response:
    """Every setting, credentials masked; with an admin token set it needs the token
    (middleware.GUARDED_READS)."""
    settings = request.app[SETTINGS]
    config: dict[str, Any] = settings.model_dump(mode="json")
    for name in CREDENTIALS:
        if config[name]:
            config[name] = MASK
    config["offload_endpoint"] = _masked_url(settings.offload_endpoint)
    config["crash_points"] = sorted(settings.crash_points)
    return json_response(config)


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    request.app[STATE_METRICS].take_snapshot(
        request.app[STORAGE],
        request.app[SERVING].shutting_down,
        request.app[WORK],
        request.app[STREAMS],
    )
    body = await asyncio.to_thread(request.app[METRICS].render)
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


@routes.put("/api/v1/bookie/gc")
async def trigger_gc(request: web.Request) -> web.Response:
    body = models.GC_REQUEST.parse(await request.read())
    gc = request.app[WORK].gc
    gc.request(body.get("forceMajor", False), body.get("forceMinor", False))
    return json_response(f"Triggered GC on BookieServer: node {request.app[SETTINGS].node_id}")


@routes.get("/api/v1/bookie/gc")
async def gc_state(request: web.Request) -> web.Response:
    in_force = request.app[WORK].gc.in_force_gc
    return json_response(
        models.ForceGcState(is_in_force_gc="true" if in_force else "false").to_json()
    )


@routes.get("/api/v1/bookie/gc_details")
async def gc_details(request: web.Request) -> web.Response:
    status = models.GcStatus.model_validate(request.app[WORK].gc.status.as_bookkeeper())
    return json_response([status.to_json()])


def _suspension(request: web.Request) -> dict[str, Any]:
    status = request.app[WORK].gc.status
    return models.Suspension(
        isMajorGcSuspended="true" if status.major_suspended else "false",
        isMinorGcSuspended="true" if status.minor_suspended else "false",
    ).to_json()


@routes.get("/api/v1/bookie/gc/suspend_compaction")
async def get_suspension(request: web.Request) -> web.Response:
    return json_response(_suspension(request))


@routes.put("/api/v1/bookie/gc/suspend_compaction")
async def suspend_compaction(request: web.Request) -> web.Response:
    body = models.SUSPEND.parse(await request.read())
    request.app[WORK].gc.suspend(body.get("suspendMajor", False), body.get("suspendMinor", False))
    return json_response(_suspension(request))


@routes.put("/api/v1/bookie/gc/resume_compaction")
async def resume_compaction(request: web.Request) -> web.Response:
    body = models.RESUME.parse(await request.read())
    request.app[WORK].gc.resume(body.get("resumeMajor", False), body.get("resumeMinor", False))
    return json_response(_suspension(request))
