"""Streams (Pulsar's managed ledgers) on the storage's public API: a named, ordered list of
ledgers, the last of which takes appends and rolls over by Pulsar's rule; cursors with a
durable mark-delete position; reads that cross ledger boundaries and long-poll at the end.

Durability: a stream's record changes (rollover, trim) are written in one fsynced RocksDB
batch before anything depends on them, and a cursor's mark-delete is written before an
acknowledgment is answered. Order of a rollover: create the new ledger (journaled) ->
write the stream record naming it -> close the old ledger. Order of a trim: write the
stream record without the ledgers -> delete them. A crash between steps leaves a stream
record that is true, plus at most a ledger it does not name (tagged with the stream's
name in its properties), which start() deletes, or an old ledger still open, which start()
closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from node.settings import Settings
from node.storage.clock import Clock
from node.storage.errors import LedgerClosed, LedgerFenced, LedgerNotFound, StorageError
from node.storage.index import STREAM_PROPERTY, LedgerState
from node.storage.ledgers import LedgerStorage
from node.streams.model import (
    CURSOR_PREFIX,
    MB,
    MINUTE_MS,
    NAME,
    STREAM_PREFIX,
    Cursor,
    LedgerInfo,
    Policies,
    Position,
    Stream,
    cursor_key,
)

log = logging.getLogger(__name__)

APPEND_ATTEMPTS = 3  # an append that lands on a ledger closed by a rollover tries again


class StreamNotFound(StorageError):
    code = "stream_not_found"


class CursorNotFound(StorageError):
    code = "cursor_not_found"


class InvalidPosition(StorageError):
    code = "invalid_position"


class InvalidPolicy(StorageError):
    code = "invalid_policy"


class InvalidName(StorageError):
    code = "invalid_name"


@dataclass(slots=True)
class Backlog:
    entries: int
    size_bytes: int


class StreamManager:
    def __init__(self, storage: LedgerStorage, clock: Clock) -> None:
        self._storage = storage
        self._clock = clock
        self._settings: Settings = storage.settings
        self._streams: dict[str, Stream] = {}
        self._cursors: dict[str, dict[str, Cursor]] = {}
        self._rolling: dict[str, asyncio.Lock] = {}
        # Per stream: its record and cursor writes, one at a time, each encoding the state
        # as it is then, so that they reach the disk in the order they take effect.
        self._writing: dict[str, asyncio.Lock] = {}
        self._arrivals: dict[str, asyncio.Event] = {}
        self.rollovers = 0
        # stream -> ledgers it rolled over to from a previous one (its first is not counted)
        self.rollovers_by_stream: dict[str, int] = {}
        self.appended: dict[str, tuple[int, int]] = {}  # stream -> (entries, bytes) since start

    # --- start ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Load streams and cursors; repair what a crash between two steps left."""
        for key, value in (await self._storage.load_records()).items():
            if key.startswith(STREAM_PREFIX):
                stream = Stream.decode(value)
                self._streams[stream.name] = stream
            elif key.startswith(CURSOR_PREFIX):
                cursor = Cursor.decode(key, value)
                self._cursors.setdefault(cursor.stream, {})[cursor.name] = cursor
        named = {info.ledger_id for s in self._streams.values() for info in s.ledgers}
        for meta in list(self._storage.ledgers()):
            owner = meta.properties.get(STREAM_PROPERTY)
            if owner is not None and meta.ledger_id not in named:
                log.warning(
                    "deleting ledger %d of stream %s: no stream names it", meta.ledger_id, owner
                )
                await self._storage.delete_ledger(meta.ledger_id)
        for stream in self._streams.values():
            for info in stream.ledgers[:-1]:
                await self._close_ledger(info)
            if stream.ledgers:
                await self._refresh(stream.ledgers[-1])

    async def _close_ledger(self, info: LedgerInfo) -> None:
        try:
            meta = await self._storage.close_ledger(info.ledger_id)
        except LedgerNotFound:
            return
        info.entries, info.size_bytes = meta.last_entry_id + 1, meta.payload_bytes
        info.closed_ms = info.closed_ms or meta.closed_ms

    async def _refresh(self, info: LedgerInfo) -> None:
        """Counts of the ledger taking appends, from the storage (the record lags them)."""
        try:
            meta = self._storage.ledger(info.ledger_id)
        except LedgerNotFound:
            return
        info.entries, info.size_bytes = meta.last_entry_id + 1, meta.payload_bytes
        if meta.state != LedgerState.OPEN and not info.closed_ms:
            info.closed_ms = meta.closed_ms or self._clock.now_ms()

    # --- streams -------------------------------------------------------------------------

    def default_policies(self) -> Policies:
        s = self._settings
        return Policies(
            minLedgerRolloverTimeMinutes=s.managed_ledger_min_ledger_rollover_time_minutes,
            maxLedgerRolloverTimeMinutes=s.managed_ledger_max_ledger_rollover_time_minutes,
            maxEntriesPerLedger=s.managed_ledger_max_entries_per_ledger,
            maxSizePerLedgerMbytes=s.managed_ledger_max_size_per_ledger_mbytes,
            retentionTimeInMinutes=s.default_retention_time_in_minutes,
            retentionSizeInMB=s.default_retention_size_in_mb,
        )

    async def put_stream(self, name: str, given: dict[str, object]) -> tuple[Stream, bool]:
        """Create a stream, or update its policies (absent keys take the node's defaults)."""
        if not NAME.fullmatch(name):
            raise InvalidName(f"a stream name is 1-255 of [A-Za-z0-9._-], not {name[:60]!r}")
        try:
            policies = Policies.from_json(given, self.default_policies())
        except ValueError as e:
            raise InvalidPolicy(str(e)) from None
        existing = self._streams.get(name)
        stream = existing or Stream(name, policies, self._clock.now_ms())
        async with self._writing.setdefault(name, asyncio.Lock()):
            stream.policies = policies
            await self._storage.write_records({stream.key(): stream.encode()})
        self._streams[name] = stream
        return stream, existing is None

    def stream(self, name: str) -> Stream:
        stream = self._streams.get(name)
        if stream is None:
            raise StreamNotFound(f"stream {name[:100]!r} does not exist")
        return stream

    def streams(self) -> list[Stream]:
        return sorted(self._streams.values(), key=lambda s: s.name)

    def cursors(self, name: str) -> list[Cursor]:
        self.stream(name)
        return sorted(self._cursors.get(name, {}).values(), key=lambda c: c.name)

    async def delete_stream(self, name: str) -> None:
        async with self._writing.setdefault(name, asyncio.Lock()):
            stream = self.stream(name)
            changes: dict[bytes, bytes | None] = {stream.key(): None}
            for cursor in self._cursors.get(name, {}).values():
                changes[cursor.key()] = None
            await self._storage.write_records(changes)
            del self._streams[name]
            self._cursors.pop(name, None)
        self._wake(name)
        for info in stream.ledgers:
            with contextlib.suppress(LedgerNotFound):
                await self._storage.delete_ledger(info.ledger_id)

    # --- appends -------------------------------------------------------------------------

    async def append(self, name: str, payloads: list[bytes]) -> list[Position]:
        """Append entries (one durable acknowledgment for all); their positions."""
        stream = self.stream(name)
        for _attempt in range(APPEND_ATTEMPTS):
            info = await self._ledger_for_append(stream)
            try:
                if len(payloads) == 1:
                    ids = [await self._storage.add_entry(info.ledger_id, None, payloads[0])]
                else:
                    ids = await self._storage.add_entries(info.ledger_id, payloads)
            except (LedgerClosed, LedgerFenced):
                continue  # a rollover closed it under us: the next ledger takes it
            size = sum(map(len, payloads))
            info.entries = max(info.entries, ids[-1] + 1) if ids else info.entries
            info.size_bytes += size
            entries, total = self.appended.get(name, (0, 0))
            self.appended[name] = (entries + len(ids), total + size)
            self._wake(name)
            return [Position(info.ledger_id, entry) for entry in ids]
        raise LedgerClosed(f"stream {name}: appends kept landing on closed ledgers; retry")

    async def _ledger_for_append(self, stream: Stream) -> LedgerInfo:
        current = stream.ledgers[-1] if stream.ledgers else None
        if current is not None and not current.closed_ms and not self._full(stream, current):
            return current
        lock = self._rolling.setdefault(stream.name, asyncio.Lock())
        async with lock:
            current = stream.ledgers[-1] if stream.ledgers else None
            if current is None or current.closed_ms or self._full(stream, current):
                current = await self._roll(stream)
            return current

    def _full(self, stream: Stream, info: LedgerInfo) -> bool:
        """Pulsar's currentLedgerIsFull: a size or age limit, and past the minimum age."""
        p = stream.policies
        age_ms = self._clock.now_ms() - info.created_ms
        space = (
            info.entries >= p.maxEntriesPerLedger
            or info.size_bytes >= p.maxSizePerLedgerMbytes * MB
        )
        too_old = age_ms >= p.maxLedgerRolloverTimeMinutes * MINUTE_MS and info.entries > 0
        return (space or too_old) and age_ms >= p.minLedgerRolloverTimeMinutes * MINUTE_MS

    async def _roll(self, stream: Stream) -> LedgerInfo:
        meta, _ = await self._storage.create_ledger(properties={STREAM_PROPERTY: stream.name})
        now = self._clock.now_ms()
        old = stream.ledgers[-1] if stream.ledgers and not stream.ledgers[-1].closed_ms else None
        if old is not None:
            old.closed_ms = now
        fresh = LedgerInfo(meta.ledger_id, created_ms=now)
        rolled = bool(stream.ledgers)  # the stream's first ledger is no rollover
        stream.ledgers.append(fresh)
        await self._save(stream)
        if old is not None:
            await self._close_ledger(old)  # its final counts, once in-flight adds are in
            await self._save(stream)
        self.rollovers += 1
        if rolled:
            count = self.rollovers_by_stream.get(stream.name, 0)
            self.rollovers_by_stream[stream.name] = count + 1
        log.info("stream %s rolled over to ledger %d", stream.name, meta.ledger_id)
        return fresh

    async def _save(self, stream: Stream) -> None:
        """Write the stream record as it is now, unless the stream was deleted."""
        async with self._writing.setdefault(stream.name, asyncio.Lock()):
            if self._streams.get(stream.name) is stream:
                await self._storage.write_records({stream.key(): stream.encode()})

    async def roll_if_full(self, name: str) -> bool:
        """Pulsar's scheduled rollCurrentLedgerIfFull: roll a full ledger that no append comes
        to (an idle stream's ledger past its max time), so that retention can reach its data.
        An empty ledger is never full by time."""
        stream = self.stream(name)
        async with self._rolling.setdefault(stream.name, asyncio.Lock()):
            current = stream.ledgers[-1] if stream.ledgers else None
            if current is None or current.closed_ms or not self._full(stream, current):
                return False
            await self._roll(stream)
            return True

    # --- reads ---------------------------------------------------------------------------

    def _last_entry(self, info: LedgerInfo) -> int:
        """The last readable entry id of a ledger of the stream (-1: none)."""
        if info.closed_ms:
            return info.entries - 1
        try:
            return self._storage.ledger(info.ledger_id).lac
        except LedgerNotFound:
            return -1

    def _index_of(self, stream: Stream, ledger_id: int) -> int:
        for i, info in enumerate(stream.ledgers):
            if info.ledger_id == ledger_id:
                return i
        raise InvalidPosition(
            f"ledger {ledger_id} is not (or no longer) part of stream {stream.name}"
        )

    def first_position(self, stream: Stream) -> Position:
        return Position(stream.ledgers[0].ledger_id, 0) if stream.ledgers else Position(0, 0)

    async def read(
        self, name: str, start: Position | None, limit: int, wait_s: float
    ) -> list[tuple[Position, bytes]]:
        """Up to ``limit`` entries from ``start`` (default: the first), waiting up to
        ``wait_s`` for new ones when there is nothing to read yet."""
        stream = self.stream(name)
        if start is not None and stream.ledgers:
            info = stream.ledgers[self._index_of(stream, start.ledger_id)]
            # At most one past the last entry (where a previous read ended): a start further
            # on would silently skip the entries before it once they arrive.
            if start.entry_id > self._last_entry(info) + 1:
                raise InvalidPosition(
                    f"{start} is past the end of ledger {start.ledger_id} (last entry "
                    f"{self._last_entry(info)})"
                )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            event = self._arrivals.setdefault(name, asyncio.Event())
            event.clear()
            found = await self._read_now(self.stream(name), start, limit)
            remaining = deadline - loop.time()
            if found or remaining <= 0:
                return found
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                return []

    async def _read_now(
        self, stream: Stream, start: Position | None, limit: int
    ) -> list[tuple[Position, bytes]]:
        if not stream.ledgers:
            return []
        start = start or self.first_position(stream)
        found: list[tuple[Position, bytes]] = []
        first = self._index_of(stream, start.ledger_id)
        entry = max(0, start.entry_id)
        for info in stream.ledgers[first:]:
            last = self._last_entry(info)
            if entry <= last:
                async for eid, payload in self._storage.read_range(
                    info.ledger_id, entry, min(last, entry + limit - len(found) - 1)
                ):
                    found.append((Position(info.ledger_id, eid), payload))
            if len(found) >= limit:
                break
            entry = 0
        return found

    def _wake(self, name: str) -> None:
        event = self._arrivals.get(name)
        if event is not None:
            event.set()

    # --- cursors -------------------------------------------------------------------------

    def cursor(self, name: str, cursor: str) -> Cursor:
        self.stream(name)
        found = self._cursors.get(name, {}).get(cursor)
        if found is None:
            raise CursorNotFound(f"cursor {cursor[:100]!r} of stream {name} does not exist")
        return found

    def last_position(self, stream: Stream) -> Position:
        for info in reversed(stream.ledgers):
            last = self._last_entry(info)
            if last >= 0:
                return Position(info.ledger_id, last)
        return Position(stream.ledgers[0].ledger_id, -1) if stream.ledgers else Position(0, -1)

    def _before(self, stream: Stream, position: Position) -> Position:
        """The mark-delete that makes ``position`` the next entry to read."""
        self._index_of(stream, position.ledger_id)
        return Position(position.ledger_id, position.entry_id - 1)

    def _check_readable(self, stream: Stream, position: Position) -> None:
        info = stream.ledgers[self._index_of(stream, position.ledger_id)]
        if not -1 <= position.entry_id <= self._last_entry(info):
            raise InvalidPosition(
                f"entry {position.entry_id} of ledger {position.ledger_id} does not exist yet"
            )

    async def create_cursor(self, name: str, cursor: str, start: str) -> tuple[Cursor, bool]:
        if not NAME.fullmatch(cursor):
            raise InvalidName(f"a cursor name is 1-255 of [A-Za-z0-9._-], not {cursor[:60]!r}")
        self.stream(name)
        async with self._writing.setdefault(name, asyncio.Lock()):  # not racing a trim
            stream = self.stream(name)
            existing = self._cursors.get(name, {}).get(cursor)
            if existing is not None:
                return existing, False
            if start == "earliest":
                mark = (
                    Position(stream.ledgers[0].ledger_id, -1) if stream.ledgers else Position(0, -1)
                )
            elif start == "latest":
                mark = self.last_position(stream)
            else:
                position = _parse(start)
                if not stream.ledgers:
                    raise InvalidPosition(
                        f"stream {name} has no entries yet, so {start} is not one of them: "
                        'create the cursor at "earliest" or "latest"'
                    )
                self._check_readable(stream, Position(position.ledger_id, position.entry_id - 1))
                mark = self._before(stream, position)
            created = Cursor(name, cursor, mark, self._clock.now_ms())
            await self._storage.write_records({created.key(): created.encode()})
            self._cursors.setdefault(name, {})[cursor] = created
        return created, True

    async def acknowledge(self, name: str, cursor: str, position: Position) -> Cursor:
        """Mark-delete up to ``position`` (never moves back: use reset for that)."""
        found = self.cursor(name, cursor)
        self._check_readable(self.stream(name), position)
        await self._move(found, position, forward_only=True)
        return found

    async def reset(self, name: str, cursor: str, position: Position) -> Cursor:
        """Make ``position`` the next entry the cursor reads (back or forth)."""
        found = self.cursor(name, cursor)
        stream = self.stream(name)
        mark = self._before(stream, position)
        self._check_readable(stream, mark)
        await self._move(found, mark)
        return found

    async def _move(self, cursor: Cursor, mark: Position, forward_only: bool = False) -> bool:
        """Write the cursor's new mark-delete, then take it; one write at a time per stream,
        so that an acknowledgment answered is never undone on disk by an older one."""
        async with self._writing.setdefault(cursor.stream, asyncio.Lock()):
            if self._cursors.get(cursor.stream, {}).get(cursor.name) is not cursor:
                raise CursorNotFound(f"cursor {cursor.name[:100]!r} was deleted")
            if forward_only and mark <= cursor.mark_delete:
                return False
            stream = self.stream(cursor.stream)
            if stream.ledgers and mark < Position(stream.ledgers[0].ledger_id, -1):
                raise InvalidPosition(f"{mark} is in a ledger retention has just deleted")
            moved = Cursor(cursor.stream, cursor.name, mark, cursor.created_ms)
            await self._storage.write_records({moved.key(): moved.encode()})
            cursor.mark_delete = mark
            return True

    async def delete_cursor(self, name: str, cursor: str) -> None:
        self.cursor(name, cursor)
        async with self._writing.setdefault(name, asyncio.Lock()):
            found = self.cursor(name, cursor)
            await self._storage.write_records({cursor_key(name, cursor): None})
            del self._cursors[name][found.name]

    def next_position(self, stream: Stream, mark: Position) -> Position | None:
        """The first entry after ``mark``, if the stream holds one."""
        if not stream.ledgers:
            return None
        if mark < Position(stream.ledgers[0].ledger_id, 0):
            return Position(stream.ledgers[0].ledger_id, 0)
        for info in stream.ledgers:
            if info.ledger_id < mark.ledger_id:
                continue
            start = mark.entry_id + 1 if info.ledger_id == mark.ledger_id else 0
            if start <= self._last_entry(info) or not info.closed_ms:
                return Position(info.ledger_id, start)
        return None

    async def read_cursor(
        self, name: str, cursor: str, limit: int, wait_s: float
    ) -> list[tuple[Position, bytes]]:
        found = self.cursor(name, cursor)
        stream = self.stream(name)
        start = self.next_position(stream, found.mark_delete)
        if start is None:
            start = (
                Position(stream.ledgers[-1].ledger_id, self._last_entry(stream.ledgers[-1]) + 1)
                if stream.ledgers
                else None
            )
        return await self.read(name, start, limit, wait_s)

    def backlog(self, name: str, mark: Position) -> Backlog:
        """Entries (and their bytes) after ``mark``."""
        entries = size = 0
        for info in self.stream(name).ledgers:
            total = self._last_entry(info) + 1
            if info.ledger_id < mark.ledger_id or total <= 0:
                continue
            after = total - (mark.entry_id + 1) if info.ledger_id == mark.ledger_id else total
            after = max(0, after)
            entries += after
            ledger_bytes = info.size_bytes
            size += ledger_bytes * after // total if total else 0
        return Backlog(entries, size)

    def slowest_mark(self, name: str) -> Position | None:
        marks = [c.mark_delete for c in self._cursors.get(name, {}).values()]
        return min(marks) if marks else None

    # --- trimming (retention) ------------------------------------------------------------

    async def trim(self, name: str, ledger_ids: Iterable[int], pace_s: float) -> list[int]:
        """Drop the oldest ledgers (a prefix of the stream, never the one taking appends):
        the stream record first, then the ledgers, ``pace_s`` apart. Cursors left before the
        first ledger kept move to it (Pulsar), in the same batch as the stream record, so
        that no mark-delete names a deleted ledger."""
        stream = self.stream(name)
        doomed = set(ledger_ids)
        async with self._writing.setdefault(name, asyncio.Lock()):
            if self._streams.get(name) is not stream:
                return []  # deleted meanwhile, with its ledgers
            prefix = 0
            while prefix < len(stream.ledgers) - 1 and stream.ledgers[prefix].ledger_id in doomed:
                prefix += 1
            removed = stream.ledgers[:prefix]
            if not removed:
                return []
            stream.ledgers = stream.ledgers[prefix:]
            first = Position(stream.ledgers[0].ledger_id, -1)
            behind = [c for c in self._cursors.get(name, {}).values() if c.mark_delete < first]
            changes: dict[bytes, bytes | None] = {
                c.key(): Cursor(c.stream, c.name, first, c.created_ms).encode() for c in behind
            }
            await self._storage.write_records({stream.key(): stream.encode(), **changes})
            for cursor in behind:
                cursor.mark_delete = first
        for n, info in enumerate(removed):
            if n and pace_s > 0:
                await asyncio.sleep(pace_s)
            with contextlib.suppress(LedgerNotFound):
                await self._storage.delete_ledger(info.ledger_id)
        return [info.ledger_id for info in removed]

    def expiry_mark(self, name: str, before_ms: int) -> Position | None:
        """Where a message TTL moves cursors: the last entry of the last closed ledger that
        closed before ``before_ms`` (None: none did)."""
        stream = self.stream(name)
        expired = [i for i in stream.ledgers[:-1] if i.closed_ms and i.closed_ms < before_ms]
        return Position(expired[-1].ledger_id, expired[-1].entries - 1) if expired else None

    async def expire(self, name: str, before_ms: int) -> list[str]:
        """Message TTL at ledger granularity: cursors move past closed ledgers that closed
        before ``before_ms`` (entries carry no time of their own). Returns moved cursors."""
        end = self.expiry_mark(name, before_ms)
        if end is None:
            return []
        moved = []
        for cursor in list(self._cursors.get(name, {}).values()):
            with contextlib.suppress(CursorNotFound):  # deleted meanwhile
                if await self._move(cursor, end, forward_only=True):
                    moved.append(cursor.name)
        return moved


def _parse(text: str) -> Position:
    try:
        return Position.parse(text)
    except ValueError as e:
        raise InvalidPosition(str(e)) from None


def parse_position(text: str) -> Position:
    return _parse(text)
