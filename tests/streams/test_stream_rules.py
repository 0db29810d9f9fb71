"""Stream rules with simulated time, on real storage in a temporary directory:

- Pulsar's rollover rule (`currentLedgerIsFull`): roll when ``(entries or size quota, or
  the max time) and age >= min time``; a ledger "full" within the minimum time keeps taking
  appends; an empty ledger never rolls by time.
- The retention rule (Pulsar's, docs/api.md) over the closed ledgers before the slowest
  cursor's mark-delete, oldest first: delete a ledger if it closed longer ago than the
  retention time, or if what remains after deleting it is still at least the retention
  size; stop at the first ledger that satisfies retention. For time only, size only, both,
  message TTL and disk pressure; never backlog, never from the middle, never the ledger
  taking appends; no cursors = every closed ledger is a candidate (Pulsar); a slow cursor
  pins data until it is reset, acknowledged or deleted; a dry run reports the same plan.
- GC reclaims the entry logs of the ledgers retention deleted.

StreamManager, Retention and GarbageCollector are driven directly; time is the fake clock that
the test moves (nothing sleeps).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from node.lifecycle.gc import GarbageCollector
from node.lifecycle.retention import Retention
from node.settings import MiB
from node.storage import entrylog, logformat
from node.storage.errors import EntryTooLarge, LedgerNotFound
from node.storage.index import LedgerState
from node.storage.ledgers import LedgerStorage
from node.streams.manager import InvalidPosition, StreamManager, StreamNotFound
from node.streams.model import MINUTE_MS, Position
from node.streams.rules import Deletion
from tests.harness.clock import EPOCH_MS, FakeClock
from tests.harness.settings import make_settings

START_MS = EPOCH_MS  # 2026-01-01T00:00:00Z: the fake clock's time 0
MINUTE_S = MINUTE_MS / 1000
MAX_ENTRY = 3 * MiB
# Rollover by entry count only (no minimum age, a maximum age never reached in a test).
ROLLING = {"minLedgerRolloverTimeMinutes": 0, "maxLedgerRolloverTimeMinutes": 1_000_000}


@dataclass
class World:
    clock: FakeClock
    storage: LedgerStorage
    streams: StreamManager
    retention: Retention = field(init=False)
    disk_usage: float = 0.0  # what the retention's disk probe reports

    def __post_init__(self) -> None:
        self.retention = Retention(self.streams, self.clock, lambda: self.disk_usage)


@asynccontextmanager
async def open_world(data_dir: Path, **overrides: Any) -> AsyncIterator[World]:
    settings = make_settings(
        data_dir,
        **{
            "journal_flush_when_queue_empty": True,
            "delete_commit_log_files_interval_ms": 0,  # no pacing: nothing sleeps
            "flush_interval_ms": 3_600_000,  # checkpoints when the test asks
            "max_entry_size": MAX_ENTRY,
            # The disk probe is the world's own: the node's default watermarks apply.
            "disk_max_used_space_ratio": 0.75,
            "disk_space_clean_forcibly_ratio": 0.85,
            **overrides,
        },
    )
    clock = FakeClock()
    storage = LedgerStorage(settings, clock=clock)
    await storage.start()
    try:
        streams = StreamManager(storage, clock)
        await streams.start()
        yield World(clock, storage, streams)
    finally:
        await storage.close()


@pytest.fixture
async def w(tmp_path: Path) -> AsyncIterator[World]:
    async with open_world(tmp_path / "data") as world:
        yield world


def payload(n: int, size: int) -> bytes:
    head = f"<{n}>".encode()
    return (head * (size // len(head) + 1))[:size]


def ledger_ids(w: World, name: str) -> list[int]:
    return [info.ledger_id for info in w.streams.stream(name).ledgers]


async def append(w: World, name: str, n: int, size: int = 100) -> Position:
    return (await w.streams.append(name, [payload(n, size)]))[0]


async def build(
    w: World,
    name: str,
    ledger_bytes: list[int],
    entries: int = 2,
    gap_minutes: float = 0,
    **policies: int,
) -> list[int]:
    """A stream of ``len(ledger_bytes)`` closed ledgers of ``entries`` entries each (ledger
    k holding ``ledger_bytes[k]`` payload bytes), then one 100-byte entry in the ledger
    taking appends. The clock advances ``gap_minutes`` before each rollover, so ledger k
    closes ``(k + 1) * gap_minutes`` after the start. Returns the ledger ids, oldest first."""
    await w.streams.put_stream(name, {**ROLLING, "maxEntriesPerLedger": entries, **policies})
    n = 0
    for k, total in enumerate(ledger_bytes):
        if k:
            w.clock.advance(gap_minutes * MINUTE_S)
        for i in range(entries):
            size = total // entries + (total % entries if i == entries - 1 else 0)
            await append(w, name, n, size)
            n += 1
    w.clock.advance(gap_minutes * MINUTE_S)
    await append(w, name, n)
    ids = ledger_ids(w, name)
    assert len(ids) == len(ledger_bytes) + 1
    return ids


def plan_of(plan: list[Deletion]) -> list[tuple[int, str]]:
    return [(d.ledger_id, d.reason) for d in plan]


async def run(w: World, **kwargs: Any) -> dict[str, list[tuple[int, str]]]:
    done = await w.retention.run(**kwargs)
    return {name: plan_of(plan) for name, plan in done.items()}


async def check_stream(w: World, name: str, kept: list[int], deleted: list[int]) -> None:
    """The stream names exactly ``kept``; ``deleted`` are gone from the storage; the kept
    ones read back; no cursor's mark-delete names a deleted ledger (cursors behind the first
    ledger kept move to it, as Pulsar's); and a manager started afresh on the storage (a
    restart) agrees."""
    assert ledger_ids(w, name) == kept
    for cursor in w.streams.cursors(name):
        assert cursor.mark_delete >= Position(kept[0], -1), cursor
    for lid in deleted:
        with pytest.raises(LedgerNotFound):
            w.storage.ledger(lid)
    stream = w.streams.stream(name)
    expected = sum(info.entries for info in stream.ledgers)
    found = await w.streams.read(name, None, 10_000, 0)
    assert len(found) == expected and [p.ledger_id for p, _ in found][:1] == kept[:1]
    again = StreamManager(w.storage, w.clock)
    await again.start()
    assert ledger_ids(World(w.clock, w.storage, again), name) == kept
    assert {c.name: c.mark_delete for c in again.cursors(name)} == {
        c.name: c.mark_delete for c in w.streams.cursors(name)
    }


async def next_unread(w: World, name: str, cursor: str) -> Position | None:
    found = await w.streams.read_cursor(name, cursor, 1, 0)
    return found[0][0] if found else None


# --- rollover -------------------------------------------------------------------------------


async def test_rollover_at_max_entries(w: World) -> None:
    await w.streams.put_stream("s", {**ROLLING, "maxEntriesPerLedger": 3})
    positions = [await append(w, "s", i) for i in range(7)]
    l1, l2, l3 = ledger_ids(w, "s")
    assert positions == [Position(lid, e) for lid in (l1, l2) for e in range(3)] + [Position(l3, 0)]
    infos = w.streams.stream("s").ledgers
    assert [(i.entries, i.size_bytes, i.closed_ms) for i in infos] == [
        (3, 300, START_MS),
        (3, 300, START_MS),
        (1, 100, 0),
    ]
    for lid in (l1, l2):  # a rollover closes the old ledger in the storage too
        meta = w.storage.ledger(lid)
        assert (meta.state, meta.last_entry_id) == (LedgerState.CLOSED, 2)
    assert w.storage.ledger(l3).state == LedgerState.OPEN
    # A batch is one durable append that never splits: one that does not fit the ledger's
    # room goes whole into the next ledger, even past the limit when it alone passes it;
    # the next append rolls again.
    assert await w.streams.append("s", [payload(i, 10) for i in range(2)]) == [
        Position(l3, 1),
        Position(l3, 2),
    ]
    batch = await w.streams.append("s", [payload(i, 10) for i in range(4)])
    l4 = batch[0].ledger_id
    assert batch == [Position(l4, e) for e in range(4)]
    l5 = (await append(w, "s", 9)).ledger_id
    assert ledger_ids(w, "s") == [l1, l2, l3, l4, l5]
    # The stream record is durable: a manager started afresh reads the same stream.
    again = StreamManager(w.storage, w.clock)
    await again.start()
    assert [i.to_json() for i in again.stream("s").ledgers] == [
        i.to_json() for i in w.streams.stream("s").ledgers
    ]


async def test_rollover_at_max_size(w: World) -> None:
    await w.streams.put_stream("s", {**ROLLING, "maxSizePerLedgerMbytes": 1})
    quarter = MiB // 4
    sizes = [quarter, quarter, quarter, quarter - 1, 1, 10]
    positions = [await append(w, "s", i, size) for i, size in enumerate(sizes)]
    l1, l2 = ledger_ids(w, "s")
    # 1 MiB - 1 byte is not full: the 1-byte entry still goes in; at 1 MiB it rolls.
    assert positions == [Position(l1, e) for e in range(5)] + [Position(l2, 0)]
    first = w.streams.stream("s").ledgers[0]
    assert (first.entries, first.size_bytes) == (5, MiB)
    assert w.storage.ledger(l1).state == LedgerState.CLOSED


async def test_rollover_at_max_time(w: World) -> None:
    policies = {"minLedgerRolloverTimeMinutes": 10, "maxLedgerRolloverTimeMinutes": 60}
    await w.streams.put_stream("s", policies)
    first = await append(w, "s", 0)
    w.clock.advance(60 * MINUTE_S - 0.001)
    assert (await append(w, "s", 1)) == Position(first.ledger_id, 1)  # 1 ms short of max
    w.clock.advance(0.001)
    second = await append(w, "s", 2)  # the ledger is 60 min old: it rolled
    assert second.ledger_id != first.ledger_id and second.entry_id == 0
    old, new = w.streams.stream("s").ledgers
    assert (old.entries, old.closed_ms) == (2, START_MS + 60 * MINUTE_MS)
    assert (new.created_ms, new.closed_ms) == (START_MS + 60 * MINUTE_MS, 0)


async def test_no_rollover_before_the_minimum_time(w: World) -> None:
    policies = {
        "minLedgerRolloverTimeMinutes": 10,
        "maxLedgerRolloverTimeMinutes": 10,
        "maxEntriesPerLedger": 2,
        "maxSizePerLedgerMbytes": 1,
    }
    await w.streams.put_stream("s", policies)
    # Full by entries, by size (1.5 MiB > 1 MiB) and by the max time, yet younger than the
    # minimum time: the ledger keeps taking appends (Pulsar: it may exceed its limits).
    positions = [await append(w, "s", i, MiB // 4) for i in range(5)]
    w.clock.advance(10 * MINUTE_S - 0.001)
    positions.append(await append(w, "s", 5, MiB // 4))
    (lid,) = ledger_ids(w, "s")
    assert positions == [Position(lid, e) for e in range(6)]
    w.clock.advance(0.001)  # age == min time: full, and old enough
    rolled = await append(w, "s", 6)
    assert rolled.ledger_id != lid and rolled.entry_id == 0
    assert w.streams.stream("s").ledgers[0].entries == 6


async def test_an_empty_ledger_never_rolls_by_time(w: World) -> None:
    await w.streams.put_stream("s", {})  # the node's defaults: min 10, max 240 minutes
    # The first append creates the stream's first ledger, then fails: the ledger stays empty.
    with pytest.raises(EntryTooLarge):
        await append(w, "s", 0, MAX_ENTRY + 1)
    (lid,) = ledger_ids(w, "s")
    assert w.streams.stream("s").ledgers[0].entries == 0
    w.clock.advance(
        24 * 60 * MINUTE_S
    )  # far past the max time: an empty ledger is not full by time
    assert (await append(w, "s", 1)) == Position(lid, 0)
    # With an entry in it, the same ledger is past its max time: the next append rolls.
    rolled = await append(w, "s", 2)
    assert rolled.ledger_id != lid and rolled.entry_id == 0


async def test_an_idle_full_ledger_rolls_without_an_append(w: World) -> None:
    # Pulsar's scheduled rollCurrentLedgerIfFull: a ledger past its max time closes though
    # no append comes, so that retention can reach its data (here at a retention run).
    policies = {
        "minLedgerRolloverTimeMinutes": 10,
        "maxLedgerRolloverTimeMinutes": 60,
        "retentionTimeInMinutes": 0,
    }
    await w.streams.put_stream("s", policies)
    last = [await append(w, "s", i) for i in range(3)][-1]
    await w.streams.create_cursor("s", "c", "earliest")
    await w.streams.acknowledge("s", "c", last)
    w.clock.advance(60 * MINUTE_S - 0.001)
    assert await run(w) == {}
    assert ledger_ids(w, "s") == [last.ledger_id]  # not full yet: it takes appends
    w.clock.advance(0.001)
    assert await run(w) == {}  # rolled over just now: closed 0 ms ago
    first, fresh = w.streams.stream("s").ledgers
    assert (first.ledger_id, first.closed_ms, fresh.entries) == (
        last.ledger_id,
        w.clock.now_ms(),
        0,
    )
    assert w.storage.ledger(last.ledger_id).state == LedgerState.CLOSED
    w.clock.advance(0.001)
    assert await run(w) == {"s": [(last.ledger_id, "time")]}
    w.clock.advance(10_000 * MINUTE_S)  # the new ledger is empty: it never rolls by time
    assert await run(w) == {}
    assert ledger_ids(w, "s") == [fresh.ledger_id]
    assert await next_unread(w, "s", "c") is None
    assert (await append(w, "s", 3)) == Position(fresh.ledger_id, 0)


async def test_concurrent_acknowledgments_never_move_a_cursor_back(
    w: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = await build(w, "s", [300] * 2, entries=3)
    await w.streams.create_cursor("s", "c", "earliest")
    real = w.storage.write_records
    release, held = asyncio.Event(), asyncio.Event()

    async def first_write_held(changes: dict[bytes, bytes | None]) -> None:
        if not held.is_set():
            held.set()
            await release.wait()
        await real(changes)

    monkeypatch.setattr(w.storage, "write_records", first_write_held)
    early = asyncio.create_task(w.streams.acknowledge("s", "c", Position(ids[0], 1)))
    await held.wait()
    late = asyncio.create_task(w.streams.acknowledge("s", "c", Position(ids[1], 0)))
    # Give the later acknowledgment time to overtake the held one if it can.
    await asyncio.wait({late}, timeout=0.2)
    release.set()
    await asyncio.gather(early, late)
    assert w.streams.cursor("s", "c").mark_delete == Position(ids[1], 0)
    again = StreamManager(w.storage, w.clock)
    await again.start()  # what is durable
    assert again.cursor("s", "c").mark_delete == Position(ids[1], 0)


async def test_counts_stay_true_when_appends_race_a_rollover(w: World) -> None:
    await w.streams.put_stream("s", {**ROLLING, "maxEntriesPerLedger": 3})
    sizes = [100 + i for i in range(80)]
    positions: list[Position] = []

    async def writer(first: int) -> None:  # 8 writers, each appending one after the other
        for i in range(first, len(sizes), 8):
            positions.append(await append(w, "s", i, sizes[i]))

    await asyncio.gather(*(writer(k) for k in range(8)))
    assert len(set(positions)) == len(sizes)
    assert len(w.streams.stream("s").ledgers) > 5
    infos = w.streams.stream("s").ledgers
    for info in infos[:-1]:  # a closed ledger counts what its storage ledger holds
        meta = w.storage.ledger(info.ledger_id)
        assert (info.entries, info.size_bytes) == (meta.last_entry_id + 1, meta.payload_bytes)
    assert sum(info.size_bytes for info in infos) == sum(sizes)
    assert sum(info.entries for info in infos) == len(sizes)


# --- retention: which ledgers ---------------------------------------------------------------


async def test_retention_by_time_only(w: World) -> None:
    ids = await build(
        w, "s", [300] * 4, gap_minutes=10, retentionTimeInMinutes=60, retentionSizeInMB=-1
    )
    closed = [info.closed_ms for info in w.streams.stream("s").ledgers]
    assert closed == [START_MS + k * 10 * MINUTE_MS for k in (1, 2, 3, 4)] + [0]
    w.clock.advance_to(90 * MINUTE_S)  # closed 80, 70, 60 and 50 minutes ago
    # Older than the retention time means strictly longer ago (Pulsar's `>`).
    assert await run(w) == {"s": [(ids[0], "time"), (ids[1], "time")]}
    await check_stream(w, "s", ids[2:], ids[:2])
    w.clock.advance(0.001)
    assert await run(w) == {"s": [(ids[2], "time")]}
    w.clock.advance(10_000 * MINUTE_S)
    assert await run(w) == {"s": [(ids[3], "time")]}  # never the ledger taking appends
    assert await run(w) == {}
    await check_stream(w, "s", ids[4:], ids[:4])


async def test_retention_by_size_only(w: World) -> None:
    ids = await build(
        w, "s", [MiB, 3 * MiB, MiB, MiB], retentionTimeInMinutes=-1, retentionSizeInMB=2
    )
    w.clock.advance(100_000 * MINUTE_S)  # time plays no part
    # Total 6 MiB + 100 B. Deleting the first leaves 5 MiB + 100 B, the second 2 MiB + 100 B
    # (still >= 2 MiB): both go; the third would leave 1 MiB + 100 B: it stays, and the
    # scan stops there.
    assert await run(w) == {"s": [(ids[0], "size"), (ids[1], "size")]}
    await check_stream(w, "s", ids[2:], ids[:2])
    remaining = sum(info.size_bytes for info in w.streams.stream("s").ledgers)
    assert remaining >= 2 * MiB
    assert remaining - w.streams.stream("s").ledgers[0].size_bytes < 2 * MiB
    assert await run(w) == {}


async def test_retention_by_time_or_size(w: World) -> None:
    policies = {"retentionTimeInMinutes": 60, "retentionSizeInMB": 4}
    ids = await build(w, "s", [MiB] * 4, gap_minutes=10, **policies)
    w.clock.advance_to(85 * MINUTE_S)  # closed 75, 65, 55 and 45 minutes ago
    # Retention size 4 MiB of 4 MiB + 100 B: by size nothing could go, yet the two ledgers
    # past the retention time go; the third satisfies both limits and stops the scan.
    assert plan_of(w.retention.plan("s", forced=False)) == [(ids[0], "time"), (ids[1], "time")]
    # Retention size 1 MiB: the third (not expired) goes by size, as 1 MiB + 100 B remain;
    # the fourth would leave 100 B: it stays.
    policies["retentionSizeInMB"] = 1
    await w.streams.put_stream("s", {**ROLLING, "maxEntriesPerLedger": 2, **policies})
    assert await run(w) == {"s": [(ids[0], "time"), (ids[1], "time"), (ids[2], "size")]}
    await check_stream(w, "s", ids[3:], ids[:3])


async def test_message_ttl_moves_cursors_past_expired_ledgers(w: World) -> None:
    # The TTL works at ledger granularity (entries carry no time of their own): a cursor
    # moves past the closed ledgers that closed longer ago than the TTL. A ledger whose
    # entries are older than the TTL but that closed more recently is not expired yet.
    policies = {"retentionTimeInMinutes": 0, "messageTtlInSeconds": 600}
    ids = await build(w, "s", [300] * 3, entries=3, gap_minutes=5, **policies)
    await w.streams.create_cursor("s", "slow", "earliest")
    ahead, _ = await w.streams.create_cursor("s", "ahead", f"{ids[2]}:1")
    assert w.streams.backlog("s", w.streams.cursor("s", "slow").mark_delete).entries == 10
    w.clock.advance_to(21 * MINUTE_S)  # closed 16, 11 and 6 minutes ago
    assert await run(w) == {"s": [(ids[0], "time"), (ids[1], "time")]}
    await check_stream(w, "s", ids[2:], ids[:2])
    assert await next_unread(w, "s", "slow") == Position(ids[2], 0)
    assert w.streams.backlog("s", w.streams.cursor("s", "slow").mark_delete).entries == 4
    assert ahead.mark_delete == Position(ids[2], 0)  # a cursor ahead never moves back
    assert w.retention.stats.expired_cursor_moves == 1
    w.clock.advance(5 * MINUTE_S)  # the third closed 11 minutes ago
    assert await run(w) == {"s": [(ids[2], "time")]}
    assert await next_unread(w, "s", "slow") == Position(ids[3], 0)
    assert await next_unread(w, "s", "ahead") == Position(ids[3], 0)


async def test_disk_pressure_ignores_time_and_size_for_acknowledged_data(w: World) -> None:
    ids = await build(w, "s", [300] * 4)  # the node's defaults: 72 h, unlimited size
    await w.streams.create_cursor("s", "c", "earliest")
    await w.streams.acknowledge("s", "c", Position(ids[1], 1))  # the last entry of the second
    w.clock.advance(60 * MINUTE_S)
    assert await run(w) == {}
    w.disk_usage = 0.80  # past the cleaning watermark, below the forced one: rules hold
    assert await run(w) == {}
    assert plan_of(w.retention.plan("s", forced=True)) == [(ids[0], "disk"), (ids[1], "disk")]
    w.disk_usage = 0.90  # past disk_space_clean_forcibly_ratio (0.85): forced
    assert await run(w) == {"s": [(ids[0], "disk"), (ids[1], "disk")]}
    await check_stream(w, "s", ids[2:], ids[:2])
    assert await run(w, forced=True) == {}  # the backlog stays, whatever the disk
    assert await next_unread(w, "s", "c") == Position(ids[2], 0)


async def test_backlog_is_never_deleted(w: World) -> None:
    ids = await build(w, "s", [300] * 4, entries=3, retentionTimeInMinutes=0)
    await w.streams.create_cursor("s", "c", "earliest")
    w.clock.advance(100_000 * MINUTE_S)
    assert await run(w) == {}
    assert await run(w, forced=True) == {}
    await w.streams.acknowledge("s", "c", Position(ids[1], 1))  # inside the second ledger
    assert await run(w) == {"s": [(ids[0], "time")]}  # the ledger holding the mark stays
    # A mark-delete at the last entry of a closed ledger releases that ledger.
    await w.streams.acknowledge("s", "c", Position(ids[1], 2))
    assert await run(w) == {"s": [(ids[1], "time")]}
    assert w.streams.cursor("s", "c").mark_delete == Position(ids[2], -1)  # the same place
    # A cursor reset to the first entry of a ledger (mark-delete L:-1) holds that ledger.
    await w.streams.reset("s", "c", Position(ids[3], 0))
    assert await run(w) == {"s": [(ids[2], "time")]}
    # All acknowledged, to the last entry of the ledger taking appends: that one stays.
    await w.streams.acknowledge("s", "c", Position(ids[4], 0))
    assert await run(w) == {"s": [(ids[3], "time")]}
    assert await run(w, forced=True) == {}
    await check_stream(w, "s", ids[4:], ids[:4])


async def test_without_cursors_every_closed_ledger_is_a_candidate(w: World) -> None:
    ids = await build(w, "s", [300] * 3, retentionTimeInMinutes=0)
    assert await run(w) == {}  # closed this very millisecond: not longer ago than 0 min
    w.clock.advance(0.001)
    assert await run(w) == {"s": [(lid, "time") for lid in ids[:3]]}
    await check_stream(w, "s", ids[3:], ids[:3])


async def test_a_slow_cursor_pins_data_until_reset_acknowledged_or_deleted(w: World) -> None:
    ids = await build(w, "s", [300] * 5, entries=3, retentionTimeInMinutes=0)
    for name in ("fast", "slow", "stale"):
        await w.streams.create_cursor("s", name, "earliest")
    await w.streams.acknowledge("s", "fast", Position(ids[5], 0))
    await w.streams.acknowledge("s", "stale", Position(ids[3], 2))
    w.clock.advance(0.001)
    assert await run(w) == {}  # the slowest cursor has read nothing
    await w.streams.reset("s", "slow", Position(ids[1], 0))  # skips the first ledger
    assert await run(w) == {"s": [(ids[0], "time")]}
    await w.streams.acknowledge("s", "slow", Position(ids[4], 1))
    assert await run(w) == {"s": [(ids[1], "time"), (ids[2], "time"), (ids[3], "time")]}
    # A cursor reset back to what is gone is refused: deleted data does not come back.
    with pytest.raises(InvalidPosition):
        await w.streams.reset("s", "slow", Position(ids[0], 0))
    await w.streams.acknowledge("s", "slow", Position(ids[5], 0))
    await w.streams.reset("s", "stale", Position(ids[4], 0))
    assert await run(w) == {}  # "stale" now pins the fifth ledger
    await w.streams.delete_cursor("s", "stale")
    assert await run(w) == {"s": [(ids[4], "time")]}
    await check_stream(w, "s", ids[5:], ids[:5])


async def test_never_from_the_middle(w: World) -> None:
    ids = await build(
        w, "s", [MiB, 5 * MiB, MiB, MiB], retentionTimeInMinutes=-1, retentionSizeInMB=3
    )
    # Deleting the first leaves 7 MiB + 100 B; deleting the second too would leave 2 MiB +
    # 100 B < 3 MiB: the scan stops there, though the third alone could go (6 MiB remain).
    assert await run(w) == {"s": [(ids[0], "size")]}
    await check_stream(w, "s", ids[1:], ids[:1])
    # The trim underneath deletes only a prefix, and never the ledger taking appends.
    assert await w.streams.trim("s", [ids[2], ids[3]], 0) == []
    assert await w.streams.trim("s", [ids[1], ids[3], ids[4]], 0) == [ids[1]]
    assert await w.streams.trim("s", ids, 0) == [ids[2], ids[3]]
    await check_stream(w, "s", ids[4:], ids[:4])
    w.clock.advance(0.001)
    assert await run(w, forced=True) == {}


async def test_a_dry_run_deletes_nothing_and_reports_the_same_plan(w: World) -> None:
    policies = {"retentionTimeInMinutes": 25, "retentionSizeInMB": 2, "messageTtlInSeconds": 600}
    ids = await build(w, "s", [MiB // 2] * 6, gap_minutes=5, **policies)
    await w.streams.create_cursor("s", "c", "earliest")
    await w.streams.acknowledge("s", "c", Position(ids[0], 1))
    plain = await build(w, "plain", [300] * 3, retentionTimeInMinutes=0)
    w.clock.advance_to(32 * MINUTE_S)
    # "s": the six ledgers closed at 5, 10, ..., 30 min; the TTL (10 min) moves the cursor
    # past the first four (closed before 22 min). The first closed 27 min ago: past the
    # retention time. Deleting the second leaves 2 MiB + 100 B >= 2 MiB; the third would
    # leave less, and it closed 17 min ago: the scan stops. "plain": no cursor, time 0.
    expected = {
        "s": [(ids[0], "time"), (ids[1], "size")],
        "plain": [(lid, "time") for lid in plain[:3]],
    }

    def ledgers() -> dict[str, list[dict[str, int]]]:
        return {n: [i.to_json() for i in w.streams.stream(n).ledgers] for n in ("s", "plain")}

    before = ledgers()
    mark = w.streams.cursor("s", "c").mark_delete
    assert await run(w, dry_run=True) == expected
    assert ledgers() == before
    assert w.streams.cursor("s", "c").mark_delete == mark  # a dry run moves no cursor
    for lid in ids + plain:
        w.storage.ledger(lid)  # all still there
    assert await run(w, dry_run=True) == expected
    assert await run(w) == expected
    await check_stream(w, "s", ids[2:], ids[:2])
    await check_stream(w, "plain", plain[3:], plain[:3])


# --- retention's scheduler ------------------------------------------------------------------


def _local_hour(clock: FakeClock, at_s: float) -> int:
    """The hour of the day at ``at_s`` on the clock, as the scheduler reads it (local time)."""
    return time.localtime((clock.now_ms() + (at_s - clock.monotonic()) * 1000) / 1000).tm_hour


async def test_the_scheduler_runs_retention_once_in_the_delete_when_hour(w: World) -> None:
    """Retention's scheduler loop on the node's clock, driven tick by tick (every 30 s,
    default settings: delete_when 04) from ten minutes before that hour to ten minutes into
    it, with no real waiting: ledgers past their retention are not touched before the hour,
    go at its first tick, and the hour's later ticks run nothing more."""
    ids = await build(w, "s", [100] * 3, gap_minutes=1, retentionTimeInMinutes=60)
    due_hour = int(w.storage.settings.delete_when)
    due_s = next(  # the first minute of the next delete_when hour (local time, as it runs)
        m * MINUTE_S
        for m in range(1, 2 * 24 * 60)
        if _local_hour(w.clock, m * MINUTE_S) == due_hour
        and _local_hour(w.clock, (m - 1) * MINUTE_S) != due_hour
    )
    w.clock.advance_to(due_s - 10 * MINUTE_S)  # the ledgers are long past their hour now
    loop = asyncio.create_task(w.retention.run_forever())
    try:
        # The loops asleep on the clock: the retention scheduler and the storage's checkpoint.
        sleepers = 2
        while w.clock.monotonic() < due_s:
            assert ledger_ids(w, "s") == ids and w.retention.stats.runs == 0
            await w.clock.tick(sleepers)
        await w.clock.sleeping(sleepers)  # the due hour's first tick is done
        assert w.retention.stats.runs == 1
        assert ledger_ids(w, "s") == ids[3:]
        while w.clock.monotonic() < due_s + 10 * MINUTE_S:
            await w.clock.tick(sleepers)
        await w.clock.sleeping(sleepers)
        assert w.retention.stats.runs == 1
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop


# --- GC reclaims what retention deleted -----------------------------------------------------


async def test_gc_reclaims_the_space_of_deleted_ledgers(tmp_path: Path) -> None:
    entry = 8 * 1024
    async with open_world(
        tmp_path / "data", log_size_limit=64 * 1024, max_entry_size=16 * 1024
    ) as w:
        # 8 entries of 8 KiB per ledger: each ledger about one 64 KiB entry log.
        ids = await build(w, "s", [8 * entry] * 6, entries=8, retentionTimeInMinutes=0)
        await w.storage.checkpoint()
        sealed = await asyncio.to_thread(w.storage.gc_candidate_logs)
        ledgers_dir = w.storage.settings.ledgers_dir
        maps = {
            log_id: set(
                await asyncio.to_thread(
                    entrylog.ledger_sizes, logformat.log_path(ledgers_dir, log_id)
                )
            )
            for log_id in sealed
        }
        assert set().union(*maps.values()) >= set(ids[:6])
        w.clock.advance(0.001)
        assert await run(w) == {"s": [(lid, "time") for lid in ids[:6]]}
        deleted = set(ids[:6])
        dead_logs = {log_id for log_id, held in maps.items() if held <= deleted}
        assert len(dead_logs) >= 4, maps
        await w.storage.checkpoint()  # the deletions are durable: GC may forget the ledgers
        gc = GarbageCollector(w.storage, w.clock)
        report = await gc.run()
        assert sorted(report.purged_ledgers) == sorted(deleted)
        assert set(report.deleted_logs) == dead_logs
        assert report.compaction is None  # reclaimed by deletion alone
        left = set(await asyncio.to_thread(entrylog.list_logs, ledgers_dir))
        assert not left & dead_logs
        assert set(maps) - dead_logs <= left  # logs holding live data stay
        assert gc.stats.reclaimed_by_deletion_bytes >= len(dead_logs) * 48 * 1024
        # What the stream still names reads back.
        found = await w.streams.read("s", None, 100, 0)
        assert found == [(Position(ids[6], 0), payload(48, 100))]


# --- concurrency and orphans ----------------------------------------------------------------

CONCURRENT_APPENDS = 200
SMALL_LEDGER = 7


async def restarted(w: World) -> World:
    """A manager started afresh on the same storage: what is durable."""
    again = StreamManager(w.storage, w.clock)
    await again.start()
    return World(w.clock, w.storage, again)


async def test_concurrent_appends_never_overfill_a_ledger(tmp_path: Path) -> None:
    # Pulsar queues adds while it rolls over: the limit holds for appends already in flight.
    async with open_world(tmp_path / "data") as w:
        await w.streams.put_stream("s", {**ROLLING, "maxEntriesPerLedger": SMALL_LEDGER})
        payloads = [payload(i, 50 + i) for i in range(CONCURRENT_APPENDS)]
        positions = await asyncio.gather(*(append(w, "s", i, 50 + i) for i in range(200)))
        assert len(set(positions)) == CONCURRENT_APPENDS
        written = dict(zip(positions, payloads, strict=True))

        async def check(world: World) -> None:
            infos = world.streams.stream("s").ledgers
            counts = {
                info.ledger_id: world.storage.ledger(info.ledger_id).entries for info in infos
            }
            assert all(n <= SMALL_LEDGER for n in counts.values()), counts
            found = dict(await world.streams.read("s", None, 10_000, 0))
            assert found == written

        await check(w)
        await check(await restarted(w))
    async with open_world(tmp_path / "data") as w:  # a real restart of the storage too
        await check(w)


async def test_an_orphan_ledger_with_entries_is_kept_and_readable(tmp_path: Path) -> None:
    """A ledger of a stream that no stream record names: empty (a rollover's crash window),
    start() deletes it; with entries (acknowledged data a bug left outside the stream), it is
    kept: re-attached to its stream when newer than the stream's ledgers, else left as a
    plain ledger the manager reports."""
    async with open_world(tmp_path / "data") as w:
        await w.streams.put_stream("s", ROLLING)
        await w.streams.put_stream("old", ROLLING)
        first = await append(w, "s", 0)
        stray_old, _ = await w.storage.create_ledger(properties={"stream": "old"})
        await w.storage.add_entry(stray_old.ledger_id, None, b"older than the stream")
        await append(w, "old", 1)  # the stream "old" names a ledger newer than the stray one
        gone, _ = await w.storage.create_ledger(properties={"stream": "deleted"})
        await w.storage.add_entry(gone.ledger_id, None, b"of a deleted stream")
        empty, _ = await w.storage.create_ledger(properties={"stream": "s"})
        orphan, _ = await w.storage.create_ledger(properties={"stream": "s"})
        orphaned = [b"acknowledged", b"outside", b"the stream"]
        await w.storage.add_entries(orphan.ledger_id, orphaned)
    async with open_world(tmp_path / "data") as w:
        with pytest.raises(LedgerNotFound):
            w.storage.ledger(empty.ledger_id)
        assert ledger_ids(w, "s") == [first.ledger_id, orphan.ledger_id]
        found = await w.streams.read("s", None, 100, 0)
        assert found == [(first, payload(0, 100))] + [
            (Position(orphan.ledger_id, i), p) for i, p in enumerate(orphaned)
        ]
        assert w.storage.ledger(orphan.ledger_id).state == LedgerState.CLOSED
        # The next append goes to a fresh ledger after the re-attached one.
        assert (await append(w, "s", 2)).ledger_id > orphan.ledger_id
        assert w.streams.orphans == {stray_old.ledger_id: "old", gone.ledger_id: "deleted"}
        for kept in (stray_old, gone):
            assert w.storage.ledger(kept.ledger_id).entries == 1
    async with open_world(tmp_path / "data") as w:  # stable: a second start changes nothing
        assert ledger_ids(w, "s")[:2] == [first.ledger_id, orphan.ledger_id]
        assert set(w.streams.orphans) == {stray_old.ledger_id, gone.ledger_id}


async def test_a_deletion_racing_a_rollover_leaves_no_ledger_behind(w: World) -> None:
    # The first append creates the stream's first ledger while the stream is deleted: that
    # ledger must not take the append (no record would name it), nor outlive the stream.
    await w.streams.put_stream("s", ROLLING)
    appended, deleted = await asyncio.gather(
        append(w, "s", 0), w.streams.delete_stream("s"), return_exceptions=True
    )
    assert deleted is None
    assert isinstance(appended, StreamNotFound), appended
    assert [m.ledger_id for m in w.storage.ledgers() if m.properties.get("stream") == "s"] == []
    again = await restarted(w)
    assert again.streams.streams() == [] and again.streams.orphans == {}
