"""The entry-log map of the status page: every entry log with its age, size and live usage,
and for the oldest ones the ledgers that keep them alive and why.

The failure it shows is months-old logs nobody could see: GC deletes a log only when none of
its ledgers is live, and one open ledger, one cursor that never acknowledges, or a retention
of "forever" keeps a whole 1 GiB log on disk. The map names that ledger and the reason, so an
operator knows whom to ask (the stream's consumer, its retention policy, the client that
never closed or deleted its ledger).

Two steps: ``scan_logs`` reads the directory and each sealed log's ledgers map on a worker
thread (blocking I/O, cached by size and mtime: a sealed log never changes); ``build_map``
runs on the event loop, where the ledger metadata and the streams live, and is pure: a test
gives it logs and a context of real metadata objects.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from node.storage.entrylog import known_ledgers_map
from node.storage.index import STREAM_PROPERTY, LedgerMeta, LedgerState
from node.storage.logformat import SUFFIX, log_path
from node.streams import rules
from node.streams.model import MINUTE_MS, Cursor, Stream

MS_PER_S = 1000
NS_PER_MS = 1_000_000

PinReason = Literal["open_ledger", rules.KeptReason, "not_deleted", "awaiting_gc"]


@dataclass(slots=True, frozen=True)
class LogFile:
    """One entry log as found on disk."""

    log_id: int
    size_bytes: int
    mtime_ms: int
    sealed: bool  # False: the log being written (or a compaction output): no map yet
    ledgers: Mapping[int, int] | None  # bytes per ledger from its map; None: unknown


@dataclass(slots=True)
class MapCache:
    """Ledgers maps already read, by log id with the (size, mtime) they were read at. Bounded
    by the logs on disk: ``scan_logs`` drops the entries of logs that are gone."""

    maps: dict[int, tuple[int, int, Mapping[int, int]]] = field(default_factory=dict)


def scan_logs(ledgers_dir: Path, sealed: set[int], cache: MapCache) -> list[LogFile]:
    """Blocking (stat and read): call on a worker thread. A log deleted under the scan (GC,
    compaction) is left out, never an error."""
    found: list[LogFile] = []
    try:
        entries = list(os.scandir(ledgers_dir))
    except FileNotFoundError:
        entries = []
    for entry in entries:
        if not entry.name.endswith(SUFFIX):
            continue
        try:
            log_id = int(entry.name.removesuffix(SUFFIX), 16)
            stat = entry.stat()
        except (ValueError, FileNotFoundError):
            continue
        ledgers: Mapping[int, int] | None = None
        if log_id in sealed:
            cached = cache.maps.get(log_id)
            if cached is not None and cached[:2] == (stat.st_size, stat.st_mtime_ns):
                ledgers = cached[2]
            else:
                with contextlib.suppress(OSError):
                    ledgers = known_ledgers_map(log_path(ledgers_dir, log_id))
                if ledgers is not None:  # else GC may keep a map beside the log later
                    cache.maps[log_id] = (stat.st_size, stat.st_mtime_ns, ledgers)
        found.append(
            LogFile(log_id, stat.st_size, stat.st_mtime_ns // NS_PER_MS, log_id in sealed, ledgers)
        )
    present = {f.log_id for f in found}
    for gone in set(cache.maps) - present:
        del cache.maps[gone]
    found.sort(key=lambda f: f.log_id)
    return found


@dataclass(slots=True, frozen=True)
class PinContext:
    """What decides why a ledger is live, copied on the event loop."""

    ledgers: Mapping[int, LedgerMeta]  # the live ones (GC's is_live_ledger)
    streams: Mapping[str, Stream]
    cursors: Mapping[str, list[Cursor]]  # by stream
    now_ms: int
    offload_deletion_lag_ms: int  # plain ledgers' lag (streams have their own policy)
    # Each stream's retention, worked out at its first ledger asked about (once, not per ledger)
    views: dict[str, rules.RetentionView] = field(default_factory=dict)

    def view(self, stream: Stream) -> rules.RetentionView:
        if stream.name not in self.views:
            cursors = self.cursors.get(stream.name, [])
            self.views[stream.name] = rules.retention_view(stream, cursors, self.now_ms)
        return self.views[stream.name]


@dataclass(slots=True, frozen=True)
class Pin:
    ledger_id: int
    size_bytes: int
    reason: PinReason
    detail: str
    stream: str | None = None
    cursor: str | None = None


@dataclass(slots=True, frozen=True)
class LogCell:
    log_id: int
    size_bytes: int
    age_s: float
    sealed: bool
    ledgers: int | None  # ledgers with data in it (None: unknown)
    live_bytes: int | None
    # live bytes over the log's own size: the map's shade. (GC measures against the larger of
    # size and log_size_limit, which on a node of small logs shades every cell empty.)
    usage: float | None


@dataclass(slots=True, frozen=True)
class PinnedLog:
    log_id: int
    age_s: float
    live_ledgers: int
    old: bool  # past the pinned horizon: flagged on the page
    pins: list[Pin]  # the largest first, at most pins_per_log


@dataclass(slots=True, frozen=True)
class EntryLogMap:
    logs: list[LogCell]
    oldest_pinned: list[PinnedLog]


def why_pinned(meta: LedgerMeta, ctx: PinContext) -> Pin:
    """Why a live ledger is still live, the most actionable reason first: an open ledger
    (someone still writes, or never closed it), then for a ledger its stream names what the
    stream rules say (``rules.why_kept``: a cursor, the message TTL, retention, the offload
    deletion lag), else the offload deletion lag or nobody deleted it (a plain ledger)."""
    lid, size = meta.ledger_id, meta.payload_bytes
    stream_name = meta.properties.get(STREAM_PROPERTY)
    stream = ctx.streams.get(stream_name) if stream_name is not None else None
    if meta.state == LedgerState.DELETED:
        return Pin(
            lid, size, "awaiting_gc", "deleted: its data goes at the next GC run", stream_name
        )
    if meta.state in (LedgerState.OPEN, LedgerState.FENCED):
        what = (
            "the stream's ledger taking appends"
            if stream is not None
            else "its writer has not closed it"
        )
        state = "open" if meta.state == LedgerState.OPEN else "fenced, not closed"
        return Pin(lid, size, "open_ledger", f"{state}: {what}", stream_name)
    if stream is not None:
        kept = rules.why_kept(ctx.view(stream), lid, meta.offload)
        if kept is not None:
            return Pin(lid, size, kept.reason, kept.detail, stream.name, kept.cursor)
    lag_ms = rules.offload_deletion_lag_ms(stream, ctx.offload_deletion_lag_ms)
    lagging = rules.local_copy_kept(meta.offload, lag_ms)
    if lagging is not None:
        return Pin(lid, size, lagging.reason, lagging.detail, stream_name)
    return Pin(
        lid,
        size,
        "not_deleted",
        "a closed plain ledger: kept until a client deletes it",
        stream_name,
    )


def pinned_after_s(default_retention_minutes: int, major_compaction_interval_s: int) -> float:
    """The age past which a log with live data is pinned, not merely young: the default
    retention plus a major compaction interval (the audit's ``pinned`` check and the
    StorageNodeEntryLogPinned alert use the same horizon). Retention -1 (forever) counts 0."""
    return max(0, default_retention_minutes) * MINUTE_MS / MS_PER_S + major_compaction_interval_s


def build_map(
    logs: list[LogFile],
    ctx: PinContext,
    old_after_s: float,
    pinned_shown: int,
    pins_per_log: int,
) -> EntryLogMap:
    cells: list[LogCell] = []
    candidates: list[tuple[float, LogFile, list[Pin]]] = []
    for f in logs:
        age_s = max(0.0, (ctx.now_ms - f.mtime_ms) / MS_PER_S)
        if f.ledgers is None:
            cells.append(LogCell(f.log_id, f.size_bytes, age_s, f.sealed, None, None, None))
            continue
        live = {lid: n for lid, n in f.ledgers.items() if lid in ctx.ledgers}
        live_bytes = sum(live.values())
        usage = min(1.0, live_bytes / f.size_bytes) if f.size_bytes else 0.0
        cells.append(
            LogCell(f.log_id, f.size_bytes, age_s, f.sealed, len(f.ledgers), live_bytes, usage)
        )
        if f.sealed and live:
            pins = [
                _with_size(why_pinned(ctx.ledgers[lid], ctx), n)
                for lid, n in sorted(live.items(), key=lambda item: (-item[1], item[0]))
            ]
            candidates.append((age_s, f, pins))
    # Oldest first; equal ages (logs sealed in one second) by id, which grows with time.
    candidates.sort(key=lambda c: (-c[0], c[1].log_id))
    pinned = [
        PinnedLog(f.log_id, age_s, len(pins), age_s > old_after_s, pins[:pins_per_log])
        for age_s, f, pins in candidates[:pinned_shown]
    ]
    return EntryLogMap(cells, pinned)


def _with_size(pin: Pin, size_in_log: int) -> Pin:
    """The bytes the ledger holds in this log (what deleting it would free here)."""
    return Pin(pin.ledger_id, size_in_log, pin.reason, pin.detail, pin.stream, pin.cursor)
