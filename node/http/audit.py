"""Audit routes: a snapshot of the node for the Spark audit job (node/audit), its files
served over HTTP to the job's executors (byte ranges of the logs it holds, paced by
``audit_serve_bytes_per_s``), and the job's last summary, kept durably and exported as
metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path
from urllib.parse import unquote

from aiohttp import web
from pydantic import ValidationError

from node.audit import kept, snapshot
from node.http import models
from node.http.bodies import limited_by
from node.http.errors import ApiError, error_response
from node.http.jsonreply import json_response
from node.http.state import (
    AUDIT,
    AUDIT_LEDGER_SOURCE,
    METRICS,
    READ_BUDGET,
    SETTINGS,
    STORAGE,
    WORK,
)
from node.offload.format import AUDIT_PREFIX
from node.offload.store import ObjectStore
from node.settings import MiB, Settings
from node.storage import logformat
from node.storage.fsutil import is_no_space
from node.storage.readonly import ReadOnlySource
from node.wire import JSON_CONTENT_TYPE

log = logging.getLogger(__name__)
routes = web.RouteTableDef()

# The records keyspace is shared with the streams layer, whose keys start with stream/,
# cursor/ and doomed/ (node/streams/model.py): this prefix is none of them.
RESULT_KEY = b"audit/result"
OFFLOAD_SNAPSHOTS = f"{AUDIT_PREFIX}snapshots"
FILE_SCHEME = "file://"
NS_PER_MS = 1_000_000
MS_PER_S = 1000
NAME_SUFFIX_CHARS = 6  # random hex after the time: two snapshots in one ms do not collide
SNAPSHOTS_PATH = "/api/v1/audit/snapshots"
# A snapshot's directory name (one component: no "..", no "/"); its files by name only.
SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
TABLE_FILES = [f"{n}{kept.PARQUET_SUFFIX}" for n in kept.TABLES]
SNAPSHOT_FILES = frozenset({kept.META_FILE, kept.LEDGERS_FILE, *TABLE_FILES})
LOG_NAME = re.compile(rf"[0-9a-f]{{1,16}}{re.escape(logformat.SUFFIX)}")
SERVE_CHUNK = 1 * MiB  # bytes read, budgeted, paced and written at a time
RANGE = re.compile(r"bytes=(\d*)-(\d*)")
OCTETS = "application/octet-stream"


def _now_ms() -> int:
    return time.time_ns() // NS_PER_MS


def _snapshot_name(now_ms: int) -> str:
    seconds, ms = divmod(now_ms, MS_PER_S)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(seconds))
    return f"{stamp}.{ms:03d}Z-{uuid.uuid4().hex[:NAME_SUFFIX_CHARS]}"


def node_name(settings: Settings) -> str:
    """How the snapshot names this node in a fleet's tables: host and data directory (two
    nodes on one host differ by the latter)."""
    return f"{socket.gethostname()}:{settings.data_dir.resolve()}"


def _target_dir(settings: Settings, target: str, name: str) -> Path:
    """Blocking (resolves paths). The directory a local target names, refused unless it is
    under the snapshot directory: the API must not write wherever the node's user can."""
    root = settings.audit_snapshots_dir.resolve()
    if target == "local":
        return root / name
    directory = Path(unquote(target.removeprefix(FILE_SCHEME))).resolve()
    if directory == root or not directory.is_relative_to(root):
        raise ApiError(422, "invalid_target", f"a file:// target must be a directory under {root}")
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ApiError(409, "snapshot_exists", f"{directory} exists and is not an empty directory")
    return directory


@routes.post("/api/v1/audit/snapshot")
async def take_snapshot(request: web.Request) -> web.Response:
    body = models.AUDIT_SNAPSHOT.parse(await request.read())
    target = body.get("to", "local")
    settings = request.app[SETTINGS]
    storage = request.app[STORAGE]
    if not storage.running:
        raise ApiError(503, "not_running", "the storage is not running")
    if storage.read_only_source(ReadOnlySource.DISK):
        raise ApiError(507, "disk_full", "a data disk is full: no room for a snapshot")
    # One at a time: each prunes the older ones before it is made.
    async with request.app[AUDIT].snapshot_lock:
        now_ms = _now_ms()
        name = _snapshot_name(now_ms)
        # Every snapshot has its directory here, holding its logs; "offload" copies its
        # files to the store as well.
        directory = await asyncio.to_thread(
            _target_dir, settings, "local" if target == "offload" else target, name
        )
        try:
            fleet = await _fleet_part(request.app)
            # Every entry acknowledged so far into the logs: a snapshot holds what the last
            # checkpoint wrote, and the replicas check compares the nodes' snapshots.
            await storage.checkpoint()
            snap, uri = await _write_snapshot(request.app, directory, name, now_ms, target, fleet)
        except Exception as e:
            await asyncio.to_thread(shutil.rmtree, directory, True)
            if is_no_space(e):
                raise ApiError(507, "disk_full", f"no space for the snapshot: {e}") from None
            if isinstance(e, snapshot.SnapshotError):
                raise ApiError(500, "snapshot_failed", str(e)) from None
            raise
    log.info("audit snapshot taken: %s", uri)
    rows = {table: t.num_rows for table, t in snap.tables.items()}
    url = None
    root = await asyncio.to_thread(settings.audit_snapshots_dir.resolve)
    if directory.parent == root:  # a file:// target deeper down is not served
        url = f"{request.url.origin()}{SNAPSHOTS_PATH}/{directory.name}/"
    reply = models.AuditSnapshot(uri=uri, url=url, takenMs=snap.taken_ms, rows=rows)
    return json_response(reply.to_json(), status=201)


@routes.get(SNAPSHOTS_PATH + "/{snapshot}/{file}")
async def get_snapshot_file(request: web.Request) -> web.StreamResponse:
    """One of a snapshot's files: its metadata or an index table (whole, or a Range)."""
    directory = await asyncio.to_thread(_snapshot_dir, request)
    name = request.match_info["file"]
    if name not in SNAPSHOT_FILES:
        raise ApiError(404, "not_found", f"a snapshot has no file {name!r}")
    return await _serve(request, directory / name)


@routes.get(SNAPSHOTS_PATH + "/{snapshot}/logs/{log}")
async def get_snapshot_log(request: web.Request) -> web.StreamResponse:
    """A log the snapshot holds, for the audit's executors: byte ranges of it (Range)."""
    directory = await asyncio.to_thread(_snapshot_dir, request)
    name = request.match_info["log"]
    if not LOG_NAME.fullmatch(name):
        raise ApiError(400, "invalid_path", f"{name!r} is not the name of an entry log")
    return await _serve(request, directory / kept.LOGS_DIR / name)


def _snapshot_dir(request: web.Request) -> Path:
    """Blocking. The snapshot's directory: a complete snapshot directly under the snapshot
    directory, whatever the path says (a name that could leave it is refused)."""
    name = request.match_info["snapshot"]
    if not SNAPSHOT_NAME.fullmatch(name):
        raise ApiError(400, "invalid_path", f"{name!r} is not the name of a snapshot")
    root = request.app[SETTINGS].audit_snapshots_dir.resolve()
    directory = (root / name).resolve()
    if directory.parent != root or not (directory / kept.META_FILE).is_file():
        raise ApiError(404, "not_found", f"no snapshot {name!r} on this node")
    return directory


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """[start, end) of a ``Range: bytes=a-b`` (``a-``, ``-n`` too) in a file of ``size``
    bytes; None without one. One range only: the executors never ask more."""
    if header is None:
        return None
    match = RANGE.fullmatch(header.strip())
    if match is None or match.group(1) == match.group(2) == "":
        raise _Unsatisfiable(f"not one byte range: {header!r}")
    first, last = match.group(1), match.group(2)
    if first == "":  # the last n bytes
        start, end = max(size - int(last), 0), size
    else:
        start = int(first)
        end = size if last == "" else min(int(last) + 1, size)
    if start >= size or start >= end:
        raise _Unsatisfiable(f"{header!r} is outside the file's {size} bytes")
    return start, end


class _Unsatisfiable(Exception):
    pass


async def _serve(request: web.Request, path: Path) -> web.StreamResponse:
    """The file, or the Range asked of it, a chunk at a time: each chunk holds bytes of
    the node's read budget until written (503 overloaded when there is none to start
    with) and waits for the node's audit pace (audit_serve_bytes_per_s)."""
    try:
        fd = await asyncio.to_thread(os.open, path, os.O_RDONLY)
    except FileNotFoundError:
        raise ApiError(404, "not_found", f"the snapshot has no {path.name}") from None
    try:
        size = (await asyncio.to_thread(os.fstat, fd)).st_size
        try:
            asked = _byte_range(request.headers.get("Range"), size)
        except _Unsatisfiable as e:
            return error_response(
                416, "range_not_satisfiable", str(e), {"Content-Range": f"bytes */{size}"}
            )
        start, end = asked or (0, size)
        headers = {"Accept-Ranges": "bytes"}
        if asked is not None:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        status = 200 if asked is None else 206
        content_type = JSON_CONTENT_TYPE if path.suffix == ".json" else OCTETS
        if request.method == "HEAD":
            head = web.StreamResponse(status=status, headers=headers)
            head.content_type = content_type
            head.content_length = end - start
            await head.prepare(request)
            await head.write_eof()
            return head
        return await _send(request, fd, start, end, status, headers, content_type)
    finally:
        await asyncio.to_thread(os.close, fd)


async def _send(
    request: web.Request,
    fd: int,
    start: int,
    end: int,
    status: int,
    headers: dict[str, str],
    content_type: str,
) -> web.StreamResponse:
    app = request.app
    settings = app[SETTINGS]
    budget, rate = app[READ_BUDGET], app[AUDIT].serve_rate
    response = web.StreamResponse(status=status, headers=headers)
    response.content_type = content_type
    response.content_length = end - start
    position = start
    while position < end:
        size = min(SERVE_CHUNK, end - position)
        if not await budget.take(size, settings.request_budget_wait_s):
            if not response.prepared:
                raise ApiError(
                    503,
                    "overloaded",
                    f"read replies in flight fill max_read_bytes_in_flight "
                    f"({budget.capacity} bytes); retry shortly",
                )
            return _cut(request, response, "no read budget for the rest")
        try:
            await rate.take(size)
            data = await asyncio.to_thread(os.pread, fd, size, position)
            if len(data) < size:
                return _cut(request, response, f"the file ended at {position + len(data)}")
            if not response.prepared:
                await response.prepare(request)
            async with asyncio.timeout(settings.reply_write_timeout_s):
                await response.write(data)
        except TimeoutError:
            return _cut(request, response, "the client took none of it")
        finally:
            budget.give_back(size)
        position += size
    if not response.prepared:
        await response.prepare(request)
    await response.write_eof()
    return response


def _cut(request: web.Request, response: web.StreamResponse, why: str) -> web.StreamResponse:
    """End a file's reply short (its length was promised): the connection is closed, and
    the client, which sees a short body, asks again."""
    log.info("%s: %s; closing", request.path, why)
    if request.transport is not None:
        request.transport.abort()
    return response


FleetPart = tuple[str | None, bytes | None, str | None]  # node id, ledgers.json, why none


async def _fleet_part(app: web.Application) -> FleetPart:
    """A node with a metadata store: its fleet id and the replicated ledgers' metadata,
    read before the snapshot (a ledger CLOSED in it had every entry acknowledged before).
    A store that does not answer leaves the snapshot without it, saying why: the other
    checks need no store."""
    source = app.get(AUDIT_LEDGER_SOURCE)
    if source is None:
        return None, None, None
    from node.audit import fleet

    settings = app[SETTINGS]
    try:
        doc = await asyncio.wait_for(fleet.dump(source), settings.metadata_timeout_s * 2)
    except Exception as e:  # the store's errors, a timeout: the snapshot goes on without
        log.warning("audit snapshot without the ledgers' metadata: %s", e)
        return settings.id, None, f"{type(e).__name__}: {e}"
    return settings.id, fleet.encode(doc), None


async def _write_snapshot(
    app: web.Application,
    directory: Path,
    name: str,
    now_ms: int,
    target: str,
    fleet: FleetPart = (None, None, None),
) -> tuple[snapshot.Snapshot, str]:
    """Prune, then take the snapshot into ``directory`` (and the store); its URI."""
    settings = app[SETTINGS]
    root = settings.audit_snapshots_dir
    pruned = await asyncio.to_thread(kept.prune, root, settings.audit_snapshots_kept - 1)
    if pruned:
        log.info("deleted %d older audit snapshots (audit_snapshots_kept)", len(pruned))
    storage = app[STORAGE]
    snap = await asyncio.to_thread(
        lambda: snapshot.from_live_storage(storage, node_name(settings), now_ms, directory)
    )
    snap.node_id, snap.ledgers, snap.ledgers_error = fleet
    uri = await asyncio.to_thread(snapshot.write_dir, snap, directory)
    if target == "offload":
        store = app[WORK].offload.store
        files = await asyncio.to_thread(snapshot.snapshot_files, snap)
        prefix = f"{OFFLOAD_SNAPSHOTS}/{name}"
        for file_name, data in files.items():
            await store.put(f"{prefix}/{file_name}", data)
        await _prune_store(store, settings.audit_snapshots_kept)
        store_url = await asyncio.to_thread(snapshot.offload_store_url, settings)
        uri = f"{store_url}/{prefix}"
    return snap, uri


async def _prune_store(store: ObjectStore, keep: int) -> None:
    """Delete all but the newest ``keep`` snapshots in the store (names sort by time)."""
    keys = [key for key, _size in await store.list(f"{OFFLOAD_SNAPSHOTS}/")]
    names = sorted({_store_snapshot(key) for key in keys})
    doomed = set(names[: max(len(names) - keep, 0)])
    for key in keys:
        if _store_snapshot(key) in doomed:
            await store.delete(key)


def _store_snapshot(key: str) -> str:
    """The snapshot name in a store key (audit/snapshots/<name>/<file>)."""
    return key.removeprefix(f"{OFFLOAD_SNAPSHOTS}/").split("/")[0]


def _check_summary(summary: models.AuditSummary, settings: Settings) -> None:
    """What the schema cannot say: the status agrees with the counts, time runs forward and
    not past the node's clock (a result from the future would keep the stale-audit alert
    quiet until then)."""
    violations = sum(c["violations"] for c in summary["checks"].values())
    if (summary["status"] == "clean") != (violations == 0):
        raise ApiError(
            422,
            "invalid_summary",
            f"status {summary['status']!r} but {violations} violations in the checks",
        )
    if summary["finishedMs"] < summary["startedMs"]:
        raise ApiError(422, "invalid_summary", "finishedMs is before startedMs")
    ahead_ms = summary["finishedMs"] - _now_ms()
    if ahead_ms > settings.audit_result_clock_skew_ms:
        raise ApiError(
            422,
            "invalid_summary",
            f"finishedMs is {ahead_ms} ms ahead of the node's clock "
            f"(audit_result_clock_skew_ms {settings.audit_result_clock_skew_ms})",
        )


@routes.post("/api/v1/audit/result")
@limited_by("audit_result_max_bytes")  # kept in the index, served to anyone: a few KiB
async def post_result(request: web.Request) -> web.Response:
    summary = models.AUDIT_SUMMARY.parse(await request.read())
    _check_summary(summary, request.app[SETTINGS])
    result = models.AuditResult(receivedMs=_now_ms(), summary=summary)
    await request.app[STORAGE].write_records({RESULT_KEY: json.dumps(result.to_json()).encode()})
    _adopt(request.app, result)
    return json_response(result.to_json())


@routes.get("/api/v1/audit/result")
async def get_result(request: web.Request) -> web.Response:
    result = request.app[AUDIT].last
    if result is None:
        raise ApiError(404, "no_audit_result", "no audit result has been posted")
    return json_response(result.to_json())


def _adopt(app: web.Application, result: models.AuditResult) -> None:
    app[AUDIT].last = result
    summary = result.summary
    violations = {name: check["violations"] for name, check in summary["checks"].items()}
    app[METRICS].audit_result(summary["finishedMs"], violations)


async def restore(app: web.Application) -> None:
    """At start: the last result posted before the node stopped."""
    raw = (await app[STORAGE].load_records()).get(RESULT_KEY)
    if raw is None:
        return
    try:
        result = models.AuditResult.model_validate_json(raw)
    except ValidationError as e:
        # A result written by a version that wrote other fields: the next audit replaces it.
        log.warning("the stored audit result is not readable, ignored: %s", e)
        return
    _adopt(app, result)
