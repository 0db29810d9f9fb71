"""The entry-log map: why a live ledger pins a log (on real metadata, stream and cursor
objects), which logs the map highlights, and the scan of real log files."""

from __future__ import annotations

import os
from pathlib import Path

from node.status.entrylogs import (
    LogFile,
    MapCache,
    PinContext,
    build_map,
    pinned_after_s,
    scan_logs,
    why_pinned,
)
from node.storage.entrylog import create_log, seal
from node.storage.index import STREAM_PROPERTY, LedgerMeta, LedgerState, OffloadInfo, OffloadState
from node.storage.logformat import HEADER_SIZE, encode_record, log_path
from node.streams.model import MINUTE_MS, Cursor, LedgerInfo, Policies, Position, Stream

NOW_MS = 1_800_000_000_000
DAY_MS = 24 * 60 * MINUTE_MS
# pinned_after_s of the defaults: 3 days of retention + 1 day between major compactions
OLD_AFTER_S = pinned_after_s(72 * 60, 86_400)


def ledger(
    lid: int,
    state: LedgerState = LedgerState.CLOSED,
    stream: str | None = None,
    closed_ms: int = NOW_MS - DAY_MS,
    offload: OffloadInfo | None = None,
) -> LedgerMeta:
    props = {STREAM_PROPERTY: stream} if stream is not None else {}
    return LedgerMeta(
        lid,
        state,
        entries=10,
        last_entry_id=9,
        payload_bytes=1000,
        closed_ms=closed_ms,
        properties=props,
        offload=offload,
    )


def orders(retention_minutes: int = 60, retention_mb: int = -1) -> Stream:
    policies = Policies(retentionTimeInMinutes=retention_minutes, retentionSizeInMB=retention_mb)
    return Stream(
        "orders",
        policies,
        NOW_MS - 2 * DAY_MS,
        [
            LedgerInfo(1, 10, 1000, NOW_MS - 2 * DAY_MS, NOW_MS - DAY_MS),
            LedgerInfo(2, 10, 1000, NOW_MS - DAY_MS, NOW_MS - 10 * MINUTE_MS),
            LedgerInfo(3, 4, 400, NOW_MS - 10 * MINUTE_MS, 0),
        ],
    )


def context(
    metas: list[LedgerMeta], stream: Stream | None = None, cursors: list[Cursor] | None = None
) -> PinContext:
    streams = {stream.name: stream} if stream else {}
    return PinContext(
        ledgers={m.ledger_id: m for m in metas},
        streams=streams,
        cursors={stream.name: cursors or []} if stream else {},
        now_ms=NOW_MS,
        offload_deletion_lag_ms=4 * 3600 * 1000,
    )


def cursor(name: str, mark: Position) -> Cursor:
    return Cursor("orders", name, mark, NOW_MS - 2 * DAY_MS)


def test_an_open_or_fenced_ledger_pins_for_being_open() -> None:
    open_plain = ledger(7, LedgerState.OPEN)
    pin = why_pinned(open_plain, context([open_plain]))
    assert pin.reason == "open_ledger" and "not closed" in pin.detail
    taking = ledger(3, LedgerState.OPEN, stream="orders")
    pin = why_pinned(taking, context([taking], orders()))
    assert pin.reason == "open_ledger" and pin.stream == "orders"
    assert why_pinned(ledger(8, LedgerState.FENCED), context([])).reason == "open_ledger"


def test_the_slowest_cursor_behind_a_closed_stream_ledger_is_named() -> None:
    first = ledger(1, stream="orders")
    cursors = [
        cursor("fast", Position(2, 9)),
        cursor("slow", Position(1, 3)),
        cursor("slower", Position(0, -1)),
    ]
    pin = why_pinned(first, context([first], orders(), cursors))
    assert (pin.reason, pin.stream, pin.cursor) == ("cursor_backlog", "orders", "slower")
    # Created on the empty stream (stored 0:-1): shown as none of the stream's first ledger,
    # not as a ledger 0 that is not the stream's.
    assert "mark-delete at 1:-1" in pin.detail
    # A cursor at the ledger's last entry has acknowledged all of it.
    pin = why_pinned(first, context([first], orders(), [cursor("done", Position(1, 9))]))
    assert pin.reason == "retention"


def test_acknowledged_stream_ledgers_are_kept_by_retention_with_when_it_is_due() -> None:
    second = ledger(2, stream="orders", closed_ms=NOW_MS - 10 * MINUTE_MS)
    acked = [cursor("c", Position(2, 9))]
    pin = why_pinned(second, context([second], orders(retention_minutes=60), acked))
    assert pin.reason == "retention" and "not yet due" in pin.detail
    first = ledger(1, stream="orders")
    pin = why_pinned(first, context([first], orders(retention_minutes=60), acked))
    assert pin.reason == "retention" and "passed" in pin.detail
    forever = why_pinned(first, context([first], orders(retention_minutes=-1), acked))
    assert forever.reason == "retention" and "forever" in forever.detail


def test_plain_offloaded_and_deleted_ledgers() -> None:
    plain = ledger(9)
    pin = why_pinned(plain, context([plain]))
    assert pin.reason == "not_deleted" and pin.stream is None
    offloaded = ledger(10, offload=OffloadInfo(OffloadState.OFFLOADED, "a1", 900, NOW_MS))
    assert why_pinned(offloaded, context([offloaded])).reason == "offload_deletion_lag"
    deleted = ledger(11, LedgerState.DELETED)
    assert why_pinned(deleted, context([deleted])).reason == "awaiting_gc"


def test_the_map_shades_each_log_by_its_own_size_and_flags_only_logs_past_the_horizon() -> None:
    assert OLD_AFTER_S == 4 * 24 * 3600
    metas = [ledger(1), ledger(2), ledger(3, LedgerState.OPEN), ledger(4)]
    logs = [
        LogFile(1, 4096, NOW_MS - 90 * DAY_MS, True, {1: 100, 2: 900, 99: 3000}),  # 99 is gone
        LogFile(2, 4096, NOW_MS - 1000, True, {99: 4000}),  # nothing live: not listed
        LogFile(3, 4096, NOW_MS - 5 * DAY_MS, True, {3: 4000}),
        LogFile(4, 2048, NOW_MS, False, None),  # being written
        LogFile(5, 4096, NOW_MS - 2 * MINUTE_MS, True, {4: 2048}),  # young: listed, not old
    ]
    built = build_map(logs, context(metas), OLD_AFTER_S, pinned_shown=5, pins_per_log=1)
    cells = {c.log_id: c for c in built.logs}
    # A 4 KiB log with 1000 live bytes is a quarter live: the shade is against its own size
    # (against a 1 GiB log_size_limit every small log looked empty).
    assert cells[1].live_bytes == 1000 and cells[1].usage == 1000 / 4096
    assert cells[5].usage == 0.5
    assert cells[1].age_s == 90 * 24 * 3600
    assert cells[2].live_bytes == 0 and cells[4].usage is None and not cells[4].sealed
    assert [(p.log_id, p.old) for p in built.oldest_pinned] == [(1, True), (3, True), (5, False)]
    oldest = built.oldest_pinned[0]
    assert oldest.live_ledgers == 2
    assert [(p.ledger_id, p.size_bytes, p.reason) for p in oldest.pins] == [(2, 900, "not_deleted")]
    assert built.oldest_pinned[1].pins[0].reason == "open_ledger"
    assert build_map(logs, context(metas), OLD_AFTER_S, 1, 10).oldest_pinned[0].log_id == 1


def _write_log(
    directory: Path, log_id: int, records: list[tuple[int, bytes]], sealed: bool
) -> None:
    path = log_path(directory, log_id)
    fd = create_log(path)
    position, sizes = HEADER_SIZE, {}
    try:
        for i, (lid, payload) in enumerate(records):
            record = encode_record(lid, i, 0, payload)
            os.pwrite(fd, record, position)
            position += len(record)
            sizes[lid] = sizes.get(lid, 0) + len(record)
        if sealed:
            seal(fd, position, sizes)
    finally:
        os.close(fd)


def test_the_scan_reads_sealed_maps_once_and_takes_age_from_mtime(tmp_path: Path) -> None:
    _write_log(tmp_path, 1, [(5, b"a" * 100), (6, b"b" * 50)], sealed=True)
    _write_log(tmp_path, 2, [(5, b"c" * 10)], sealed=False)
    old_s = NOW_MS / 1000 - 30 * 24 * 3600
    os.utime(log_path(tmp_path, 1), (old_s, old_s))
    cache = MapCache()
    found = scan_logs(tmp_path, {1}, cache)
    assert [(f.log_id, f.sealed) for f in found] == [(1, True), (2, False)]
    assert found[0].ledgers is not None and set(found[0].ledgers) == {5, 6}
    assert found[0].mtime_ms == int(old_s * 1000) and found[1].ledgers is None
    assert set(cache.maps) == {1}
    log_path(tmp_path, 1).unlink()  # GC deleted it: gone from the map and the cache
    assert [f.log_id for f in scan_logs(tmp_path, {1}, cache)] == [2]
    assert cache.maps == {}


def test_a_stream_ledger_its_stream_does_not_name_is_kept_as_a_plain_ledger() -> None:
    # An orphan (README "Streams"): retention never deletes it; the operator reads and deletes it.
    orphan = ledger(9, stream="orders")
    pin = why_pinned(orphan, context([orphan], orders(), [cursor("c", Position(0, -1))]))
    assert (pin.reason, pin.stream) == ("not_deleted", "orders")
