"""Streams (Pulsar's managed ledgers) on the storage's public API: a named, ordered list of
ledgers, the last of which takes appends and rolls over by Pulsar's rule; cursors with a
durable mark-delete position; reads that cross ledger boundaries and long-poll at the end.

Durability: a stream's record changes (creation, rollover, trim, deletion) are written in
one fsynced RocksDB batch before anything depends on them, and a cursor's mark-delete is
written before an acknowledgment is answered. A stream's record and its in-memory object
change under one per-stream lock (``_writing``), and the object is never replaced while the
stream exists: appends and rollovers in flight hold it, so what they change is what the next
record write encodes.

Order of a rollover: create the new ledger (journaled) -> write the stream record naming it
-> only then let appends reach it -> once the adds in flight on the old ledger settled,
close it. So an append only ever lands on a ledger a durable stream record names. Order of a
trim or a stream deletion: write the stream record without the ledgers, together with a
``doomed`` record per ledger -> delete the ledgers -> drop the ``doomed`` records.

A crash between steps leaves a stream record that is true, plus:
- ledgers named by ``doomed`` records: start() finishes deleting them;
- an old ledger still open: start() closes it;
- a ledger tagged with the stream's name (its ``stream`` property) that no record names and
  that holds no entry: the new ledger of a rollover cut short; start() deletes it.
A ledger that no record names yet holds entries is none of these: its entries may have been
acknowledged (a bug, or records restored from an older copy), so start() never deletes it.
It logs an ERROR and, as a Pulsar operator would expect of a managed ledger (data is only
ever deleted by retention or by an explicit delete), keeps the data reachable: when its
stream exists and the ledger is newer than every ledger the stream names, it is closed and
re-attached as the stream's last ledger (the next append rolls over to a new one), so its
entries read through the stream and cursors reach them; otherwise (its stream is gone, or it
would go in the middle of ledgers cursors may already be past) it stays a plain ledger,
listed in ``orphans`` and counted by the ``stream_orphan_ledgers`` metric, for the operator
to read (``GET /api/v1/ledgers/{id}/entries``) and delete (``DELETE /api/v1/ledgers/{id}``).

Rollover limits: an append reserves room in the ledger taking appends synchronously, before
its first await, against the ledger's entries plus those of the adds still in flight; when
the reservation would pass ``maxEntriesPerLedger`` or ``maxSizePerLedgerMbytes`` the append
waits for (or makes) the rollover, as Pulsar queues adds while it rolls over. So a ledger
never holds more than the limits, with one exception: an append (a batch is one append, and
never splits across ledgers) that alone passes them goes whole into an empty ledger. As in
Pulsar, a ledger younger than ``minLedgerRolloverTimeMinutes`` takes appends past its limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

from node.settings import MiB, Settings
from node.storage.clock import Clock
from node.storage.errors import LedgerClosed, LedgerFenced, LedgerNotFound, StorageError
from node.storage.faults import Faults
from node.storage.index import STREAM_PROPERTY, LedgerMeta, LedgerState, OffloadInfo
from node.storage.reads import ColdReader
from node.streams.backend import StreamBackend
from node.streams.cache import EntryCache
from node.streams.dedup import (
    ENVELOPE_MARK,
    ENVELOPE_PROPERTY,
    SNAPSHOT_PREFIX,
    Flight,
    SequenceOverlap,
    Table,
    enveloped,
    open_envelope,
    snapshot_key,
    strip_envelope,
)
from node.streams.model import (
    CURSOR_PREFIX,
    DOOMED_PREFIX,
    MINUTE_MS,
    NAME,
    STREAM_PREFIX,
    Cursor,
    LedgerInfo,
    Position,
    PositionOutOfRange,
    Replication,
    Stream,
    cursor_key,
    decode_doomed_key,
    doomed_key,
    encode_doomed,
)
from node.streams.policies import Policies, PolicyConflict, default_policies

log = logging.getLogger(__name__)

APPEND_ATTEMPTS = 3  # an append that lands on a ledger closed by a rollover tries again
READ_AHEAD_CACHE_SHARE = 4  # a read-ahead fills at most 1/4 of the entry cache

Read = list[tuple[Position, bytes]]  # entries read, in order
Admit = Callable[[int], Awaitable[bool]]  # may an entry of this many bytes join a read?
Settled = Callable[["asyncio.Future[list[int]]"], None]  # told of an add once it settled
# Told of each add an append sends (its ledger, the add); returns what is told once it settled.
OnAdd = Callable[[LedgerInfo, "asyncio.Future[list[int]]"], Settled]


class StreamNotFound(StorageError):
    code = "stream_not_found"


class CursorNotFound(StorageError):
    code = "cursor_not_found"


class InvalidPosition(StorageError):
    """Well formed, but not a position of the stream (or past its end) as it is now."""

    code = "invalid_position"


class MalformedPosition(InvalidPosition):
    """Not ``L:E`` at all."""


class InvalidPolicy(StorageError):
    code = "invalid_policy"


class ConflictingPolicies(InvalidPolicy):
    """Each value is allowed, but together they are not."""


class InvalidName(StorageError):
    code = "invalid_name"


class ReplicationOff(InvalidPolicy):
    """Replication settings other than 1/1/1 on a node without a metadata store."""

    code = "replication_off"


class NotOwner(StorageError):
    """Another node serves the stream now (it took it over): ask again, any node forwards.
    Raised only before this node did anything of the request (or when its guarded write
    was refused), so a forwarder may send the request on to the new owner."""

    code = "not_owner"


class AppendOutcomeUnknown(StorageError):
    """The append's ledger was fenced or lost with it unacknowledged: it may be in the
    stream or not (BookKeeper's fenced add); never reported as failed."""

    code = "append_outcome_unknown"


class MetadataUnavailable(StorageError):
    code = "metadata_unavailable"


class DeduplicationOff(StorageError):
    """Producer headers on a stream whose ledger takes no producer header: the stream's
    ``deduplication`` policy is off (or was turned off while the append waited)."""

    code = "deduplication_off"


class TooManyProducers(StorageError):
    """A new producer past ``stream_dedup_max_producers`` (idle ones are forgotten first)."""

    code = "too_many_producers"


class SequenceConflict(StorageError):
    """A batch whose sequence ids are partly persisted (or in flight) and partly not."""

    code = "sequence_overlap"


class ProducerNotFound(StorageError):
    """No persisted append of that producer in the stream's table (never seen, or forgotten
    once idle for ``stream_dedup_producer_inactivity_minutes``)."""

    code = "producer_not_found"


class NotEnoughNodes(StorageError):
    """A replicated stream's new ledger needs E writable nodes and fewer are registered
    (BookKeeper's BKNotEnoughBookiesException): appends wait for nodes to come back."""

    code = "not_enough_nodes"


class RecoveryFailed(StorageError):
    """A takeover could not settle the end of the stream's last ledgers, or an owner the end
    of a ledger an append's unknown outcome left (too few of their replicas answered):
    nothing changed, the next request tries again."""

    code = "recovery_failed"


@dataclass(slots=True)
class Backlog:
    entries: int
    size_bytes: int


@dataclass(slots=True)
class _InFlight:
    """The appends reserved on one ledger whose adds have not settled yet."""

    appends: int = 0
    entries: int = 0
    size_bytes: int = 0
    settled: asyncio.Event = field(default_factory=asyncio.Event)


class StreamManager:
    def __init__(self, storage: StreamBackend, clock: Clock) -> None:
        self._storage = storage
        self._clock = clock
        # E/Qw/Qa of new streams' ledgers: None on a node without a metadata store (its
        # streams' ledgers are its own), the settings' with one (node.streams.replicated).
        self.default_replication: Replication | None = None
        self._moved: set[str] = set()  # streams dropped for another owner (replicated)
        self._settings: Settings = storage.settings
        self._crash = Faults.from_settings(self._settings)  # tests' named crash points
        self._streams: dict[str, Stream] = {}
        self._cursors: dict[str, dict[str, Cursor]] = {}
        self._rolling: dict[str, asyncio.Lock] = {}
        # Per stream: its record and cursor writes, one at a time, each encoding the state
        # as it is then, so that they reach the disk in the order they take effect.
        self._writing: dict[str, asyncio.Lock] = {}
        self._arrivals: dict[str, asyncio.Event] = {}
        self._in_flight: dict[int, _InFlight] = {}  # ledger id -> its unsettled appends
        self._reading_ahead: dict[str, asyncio.Task[None]] = {}  # stream -> its read-ahead
        # Ledgers of streams that no stream record names yet hold entries (see the module's
        # docstring): ledger id -> the stream its properties name.
        self.orphans: dict[int, str] = {}
        self.rollovers = 0
        # stream -> ledgers it rolled over to from a previous one (its first is not counted)
        self.rollovers_by_stream: dict[str, int] = {}
        self.appended: dict[str, tuple[int, int]] = {}  # stream -> (entries, bytes) since start
        # Tiered storage of replicated streams (node.offload sets them): the reader of a
        # ledger whose replicas went after its offload, and the deletion of its objects.
        self.cold: ColdReader | None = None
        self.remove_objects: Callable[[int, str], Awaitable[None]] | None = None
        # Entries appended here, for tailing readers (replicated streams: the ledger's
        # replicas are a network hop away; a node's own ledgers have the engine's caches).
        self.cache = EntryCache(0)
        # Message deduplication (node.streams.dedup): snapshots as last read or written,
        # the tables of the streams that needed one since, and what they answered.
        self._snapshots: dict[str, bytes] = {}
        self._tables: dict[str, Table] = {}
        self._stale: dict[str, Table] = {}  # dropped tables whose appends may still land
        self._loading: dict[str, asyncio.Lock] = {}
        self._snapshotting: dict[str, asyncio.Task[None]] = {}
        self.duplicates: dict[str, int] = {}  # stream -> duplicate appends answered

    # --- start ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Load streams and cursors; repair what a crash between two steps left."""
        doomed = []
        for key, value in (await self._storage.load_records()).items():
            if key.startswith(STREAM_PREFIX):
                stream = Stream.decode(value)
                self._streams[stream.name] = stream
            elif key.startswith(CURSOR_PREFIX):
                cursor = Cursor.decode(key, value)
                self._cursors.setdefault(cursor.stream, {})[cursor.name] = cursor
            elif key.startswith(DOOMED_PREFIX):
                doomed.append(decode_doomed_key(key))
            elif key.startswith(SNAPSHOT_PREFIX):
                self._snapshots[key.removeprefix(SNAPSHOT_PREFIX).decode()] = value
        await self._delete_doomed(doomed)
        named = {info.ledger_id for s in self._streams.values() for info in s.ledgers}
        unnamed = sorted(  # oldest first: orphans re-attach to a stream in id order
            (
                meta
                for meta in self._storage.ledgers()
                # A ledger with a write token is a client's: streams never set one (it
                # claimed the property before the ledger API refused it).
                if STREAM_PROPERTY in meta.properties
                and meta.ledger_id not in named
                and not meta.token_digest
            ),
            key=lambda meta: meta.ledger_id,
        )
        for meta in unnamed:
            await self._recover_unnamed_ledger(meta)
        for stream in self._streams.values():
            for info in stream.ledgers[:-1]:
                await self._close_ledger(info)
            if stream.ledgers:
                await self._refresh(stream.ledgers[-1])

    async def _delete_doomed(self, ledger_ids: list[int]) -> None:
        """Delete ledgers a trim or stream deletion dropped, then their ``doomed`` records."""
        for ledger_id in ledger_ids:
            with contextlib.suppress(LedgerNotFound):
                await self._storage.delete_ledger(ledger_id)
        if ledger_ids:
            await self._storage.write_records({doomed_key(i): None for i in ledger_ids})

    async def _recover_unnamed_ledger(self, meta: LedgerMeta) -> None:
        """A ledger of a stream that no stream record names (see the module's docstring)."""
        owner = meta.properties[STREAM_PROPERTY]
        if meta.entries == 0 and meta.last_entry_id == -1:
            log.warning(
                "deleting ledger %d of stream %s: no stream names it and it holds no entry "
                "(a rollover cut short created it)",
                meta.ledger_id,
                owner,
            )
            await self._storage.delete_ledger(meta.ledger_id)
            return
        stream = self._streams.get(owner)
        if stream is not None and all(meta.ledger_id > i.ledger_id for i in stream.ledgers):
            closed = await self._storage.close_ledger(meta.ledger_id)
            now = self._clock.now_ms()
            if stream.ledgers and not stream.ledgers[-1].closed_ms:
                stream.ledgers[-1].closed_ms = now  # start() closes it in the storage next
            info = LedgerInfo(
                meta.ledger_id,
                closed.last_entry_id + 1,
                closed.payload_bytes,
                closed.created_ms,
                closed.closed_ms or now,
                envelope=meta.properties.get(ENVELOPE_PROPERTY) == ENVELOPE_MARK,
            )
            stream.ledgers = [*stream.ledgers, info]
            await self._storage.write_records({stream.key(): stream.encode()})
            log.error(
                "ledger %d of stream %s holds %d entries (%d bytes) but no stream record named "
                "it: they may be acknowledged data. Re-attached it, closed, as the stream's "
                "last ledger so that they read through the stream; check them, and report "
                "the bug that left it out",
                meta.ledger_id,
                owner,
                info.entries,
                info.size_bytes,
            )
            return
        self.orphans[meta.ledger_id] = owner
        log.error(
            "ledger %d of stream %s holds %d entries (%d bytes) but no stream record names it, "
            "and it cannot rejoin the stream (%s): kept as a plain ledger, never deleted "
            "automatically. Read its entries with GET /api/v1/ledgers/%d/entries, then delete "
            "it with DELETE /api/v1/ledgers/%d",
            meta.ledger_id,
            owner,
            meta.entries,
            meta.payload_bytes,
            "the stream does not exist" if stream is None else "older than its ledgers",
            meta.ledger_id,
            meta.ledger_id,
        )

    def live_orphans(self) -> dict[int, str]:
        """The orphans kept at start that the operator has not deleted yet."""
        alive = {meta.ledger_id for meta in self._storage.ledgers()}
        return {lid: owner for lid, owner in self.orphans.items() if lid in alive}

    async def _close_ledger(self, info: LedgerInfo) -> None:
        try:
            meta = await self._storage.close_ledger(info.ledger_id)
        except LedgerNotFound:
            return
        info.entries, info.size_bytes = meta.last_entry_id + 1, meta.payload_bytes
        info.closed_ms = info.closed_ms or meta.closed_ms
        info.closing = False

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

    async def put_stream(
        self, name: str, given: dict[str, object], replication: Replication | None = None
    ) -> tuple[Stream, bool]:
        """Create a stream, or update its policies (absent keys take the node's defaults) and
        its replication (the ledgers it opens from then on)."""
        if not NAME.fullmatch(name):
            raise InvalidName(f"a stream name is 1-255 of [A-Za-z0-9._-], not {name[:60]!r}")
        replication = self._check_replication(replication)
        try:
            policies = Policies.from_json(given, default_policies(self._settings))
        except PolicyConflict as e:
            raise ConflictingPolicies(str(e)) from None
        except ValueError as e:
            raise InvalidPolicy(str(e)) from None
        async with self._writing.setdefault(name, asyncio.Lock()):
            # Read under the lock: PUTs racing to create the stream see each other's, and
            # the object stays (appends and rollovers in flight hold it).
            existing = self._streams.get(name)
            stream = existing or Stream(
                name, policies, self._clock.now_ms(), replication=self.default_replication
            )
            replication = replication or stream.replication
            updated = dataclasses.replace(stream, policies=policies, replication=replication)
            await self._storage.write_records({updated.key(): updated.encode()})
            stream.policies, stream.replication = policies, replication
            if existing is None:
                self._streams[name] = stream
        return stream, existing is None

    def _check_replication(self, replication: Replication | None) -> Replication | None:
        if replication is None:
            return None
        if self.default_replication is None:
            if replication != (1, 1, 1):
                raise ReplicationOff(
                    "this node has no metadata store (metadata_url): its streams' ledgers "
                    "are its own, replication is 1/1/1"
                )
            return None
        e, qw, qa = replication
        if not e >= qw >= qa >= 1:
            raise ConflictingPolicies(
                f"replication needs ensemble >= writeQuorum >= ackQuorum >= 1, got {e}/{qw}/{qa}"
            )
        return replication

    def stream(self, name: str) -> Stream:
        stream = self._streams.get(name)
        if stream is None:
            if name in self._moved:
                raise NotOwner(f"stream {name[:100]!r} is served by another node now: retry")
            raise StreamNotFound(f"stream {name[:100]!r} does not exist")
        return stream

    def owns(self, name: str) -> bool:
        return name in self._streams

    # --- ownership (replicated streams: node.streams.router) -----------------------------

    def adopt(
        self, stream: Stream, cursors: Iterable[Cursor], snapshot: bytes | None = None
    ) -> None:
        """Serve a stream this node has just taken over, its last ledger closed; ``snapshot``
        its deduplication snapshot record, if it has one."""
        self._moved.discard(stream.name)
        self._forget_table(stream.name)
        self._snapshots.pop(stream.name, None)
        if snapshot is not None:
            self._snapshots[stream.name] = snapshot
        self._streams[stream.name] = stream
        self._cursors[stream.name] = {cursor.name: cursor for cursor in cursors}

    def drop(self, name: str) -> None:
        """Stop serving a stream that another node owns now. Nothing is written (the new
        owner's record is the truth); waiting readers wake up and are told to retry."""
        dropped = self._streams.pop(name, None)
        if dropped is not None:
            self._moved.add(name)
            self.cache.drop_ledgers({info.ledger_id for info in dropped.ledgers})
        self._cursors.pop(name, None)
        self._forget_table(name)
        self._wake(name)

    async def open_ledger(self, name: str) -> LedgerInfo:
        """Open the stream's next ledger now: a takeover does, after closing the last one, so
        that the old owner's ledger is never appended to again (Pulsar opens one on load)."""
        stream = self.stream(name)
        async with self._rolling.setdefault(name, asyncio.Lock()):
            fresh, old = await self._open_next(stream)
            await self._seal(stream, old)
            return fresh

    def streams(self) -> list[Stream]:
        return sorted(self._streams.values(), key=lambda s: s.name)

    def cursors(self, name: str) -> list[Cursor]:
        self.stream(name)
        return sorted(self._cursors.get(name, {}).values(), key=lambda c: c.name)

    async def delete_stream(self, name: str) -> None:
        self.stream(name)  # before a lock is made for the name: a missing one costs nothing
        async with self._writing.setdefault(name, asyncio.Lock()):
            stream = self.stream(name)
            changes: dict[bytes, bytes | None] = {stream.key(): None}
            for cursor in self._cursors.get(name, {}).values():
                changes[cursor.key()] = None
            for info in stream.ledgers:
                changes[doomed_key(info.ledger_id)] = encode_doomed(name, _attempt(info))
            if stream.policies.deduplication or any(i.envelope for i in stream.ledgers):
                changes[snapshot_key(name)] = None
            await self._storage.write_records(changes)
            del self._streams[name]
            self._cursors.pop(name, None)
            self._forget_table(name)
            self._snapshots.pop(name, None)
        self._wake(name)
        await self._delete_dropped(stream.ledgers)

    # --- appends -------------------------------------------------------------------------

    async def append(self, name: str, payloads: list[bytes]) -> list[Position]:
        """Append entries (one durable acknowledgment for all); their positions."""
        stream = self.stream(name)
        if not payloads:
            return []
        return await self._append(stream, payloads)

    async def _append(
        self,
        stream: Stream,
        payloads: list[bytes],
        producer: str | None = None,
        first: int = 0,
        on_add: OnAdd | None = None,
    ) -> list[Position]:
        """``payloads`` appended (``producer`` and ``first``: the producer headers of an
        append of a deduplicating stream; ``on_add`` sees each add sent, and what it returns
        is called once the add settled)."""
        name = stream.name
        envelope = stream.policies.deduplication
        stored = enveloped(payloads, producer, first) if envelope else payloads
        count, size = len(payloads), sum(map(len, stored))
        for _attempt in range(APPEND_ATTEMPTS):
            info = await self._ledger_for_append(stream, count, size)
            if info.envelope != envelope:  # the policy changed while the append waited
                self._release(info, count, size)
                if producer is not None:
                    raise DeduplicationOff(f"stream {name}: deduplication was just turned off")
                envelope = info.envelope
                stored = enveloped(payloads, None, 0) if envelope else payloads
                continue
            add = asyncio.ensure_future(self._add(info.ledger_id, stored))
            # The reservation ends when the storage settles the add, also when the caller
            # gives up first (its entries may land anyway): the counts stay true.
            if on_add is not None:
                then: Settled | None = on_add(info, add)
            elif envelope:
                then = functools.partial(self._through, name, info)
            else:
                then = None
            # One callback for both (this is every append's path: one loop turn fewer).
            add.add_done_callback(
                functools.partial(self._settle, info, count, size, then, name, payloads)
            )
            try:
                ids = await asyncio.shield(add)
            except (LedgerClosed, LedgerFenced):
                # Closed under us (a replicated ledger's recovery by autorecovery or an
                # operator; nothing of this append was sent): learn where it ended, so that
                # the next attempt rolls over to a new ledger rather than landing here again.
                async with self._rolling.setdefault(name, asyncio.Lock()):
                    if not info.closed_ms:
                        # No append lands here again; the stream moves past it only once
                        # its end is confirmed (_settle_closing): an add whose outcome was
                        # unknown may still be in it, and readers must never see entries
                        # after it before they can see it.
                        info.closed_ms, info.closing = self._clock.now_ms(), True
                        with contextlib.suppress(StorageError):
                            await self._close_ledger(info)
                continue
            except LedgerNotFound:
                if self._streams.get(name) is not stream:
                    raise StreamNotFound(f"stream {name[:100]!r} was deleted") from None
                raise
            return [Position(info.ledger_id, entry) for entry in ids]
        raise LedgerClosed(f"stream {name}: appends kept landing on closed ledgers; retry")

    # --- message deduplication (node.streams.dedup) --------------------------------------

    async def append_once(
        self, name: str, payloads: list[bytes], producer: str, first: int
    ) -> tuple[list[Position], bool]:
        """Append entries of ``producer`` numbered ``first``.. unless the stream holds them
        already: (their positions, False), or (where they were stored the first time, True;
        [] when that is older than the runs its table keeps) for a duplicate. One whose
        first send is still in flight waits for it and answers as it does."""
        stream = self.stream(name)
        if not stream.policies.deduplication:
            raise DeduplicationOff(
                f"stream {name} does not deduplicate: its deduplication policy is off, so "
                "producer headers would promise what it does not keep"
            )
        count = len(payloads)
        while True:
            # Without an await when the table is there (every append but the first).
            table = self._tables.get(name) or await self._table(stream)
            try:
                check = table.check(producer, first, count)
            except SequenceOverlap as e:
                raise SequenceConflict(str(e)) from None
            if check.positions is not None:
                self.duplicates[name] = self.duplicates.get(name, 0) + 1
                return check.positions, True
            if check.wait is None:
                break
            await asyncio.wait({check.wait.done})
            done = check.wait.done
            if done.cancelled():
                continue  # never sent: the stream does not hold it, look again
            error = done.exception()
            if error is not None:
                raise error
            self.duplicates[name] = self.duplicates.get(name, 0) + 1
            ledger_id, ids = done.result()
            return [Position(ledger_id, i) for i in ids], True
        if producer not in table.producers:
            self._admit_producer(table, producer)
        flight = table.push(producer, first, count)
        on_add = functools.partial(self._sent, stream, table, producer, flight)
        try:
            positions = await self._append(stream, payloads, producer, first, on_add)
        except BaseException as error:
            if not flight.done.done() and (flight.sent is None or flight.sent.done()):
                # Nothing of it is in flight (refused, or failed before an add was sent).
                table.land(producer, flight)
                if isinstance(error, Exception):
                    _fail(flight, error)
                else:
                    flight.done.cancel()
            raise
        return positions, False

    async def last_sequence(self, name: str, producer: str) -> tuple[int, Position]:
        """``producer``'s highest sequence id the stream holds and its position (Pulsar's
        getLastSequenceId: where a restarting producer resumes). Appends of it still in
        flight settle first: an id answered here is never one still in the air, so a producer
        that resumes after it never reuses an id that lands later."""
        stream = self.stream(name)
        if not (stream.policies.deduplication or any(i.envelope for i in stream.ledgers)):
            raise DeduplicationOff(
                f"stream {name} does not deduplicate: its deduplication policy is off, so it "
                "keeps no producer's sequence ids"
            )
        while True:
            table = self._tables.get(name) or await self._table(stream)
            flights = table.flights.get(producer)
            if not flights:
                break
            await asyncio.wait([flight.done for flight in flights])
        last = table.last(producer)
        if last is None:
            raise ProducerNotFound(
                f"stream {name} holds no append of producer {producer[:100]!r} (never seen, or "
                "idle past stream_dedup_producer_inactivity_minutes): start from any id"
            )
        return last

    def _admit_producer(self, table: Table, producer: str) -> None:
        """A new producer past the cap: idle ones are forgotten first, then TooManyProducers."""
        if producer in table.producers or producer in table.flights:
            return
        cap = self._settings.stream_dedup_max_producers
        if table.tracked() < cap:
            return
        table.expire(self._clock.now_ms(), self._idle_ms())
        if table.tracked() >= cap:
            raise TooManyProducers(
                f"the stream tracks {cap} producers (stream_dedup_max_producers): a new one "
                f"is refused until one is idle for "
                f"{self._settings.stream_dedup_producer_inactivity_minutes} minutes"
            )

    def _idle_ms(self) -> int:
        return self._settings.stream_dedup_producer_inactivity_minutes * MINUTE_MS

    def _sent(
        self,
        stream: Stream,
        table: Table,
        producer: str,
        flight: Flight,
        info: LedgerInfo,
        add: asyncio.Future[list[int]],
    ) -> Settled:
        """``on_add`` of a producer's append: what the table learns once the add settled."""
        flight.sent = add
        return functools.partial(self._landed, stream, table, producer, flight, info)

    def _landed(
        self,
        stream: Stream,
        table: Table,
        producer: str,
        flight: Flight,
        info: LedgerInfo,
        add: asyncio.Future[list[int]],
    ) -> None:
        """A producer's add settled (a callback, so that it counts even when the request
        that sent it is gone): the table learns where it went, or that it went nowhere."""
        if flight.done.done():
            return
        error = None if add.cancelled() else add.exception()
        if error is None and not add.cancelled():
            ids = add.result()
            at = Position(info.ledger_id, ids[0])
            table.record(producer, flight.first, at, len(ids), self._clock.now_ms())
            table.land(producer, flight)
            flight.done.set_result((info.ledger_id, ids))  # positions only if one waits
            self._snapshot_soon(stream, table)
            return
        if isinstance(error, (LedgerClosed, LedgerFenced)):
            return  # nothing of it was sent: the append tries again on another ledger
        table.land(producer, flight)
        if error is None or isinstance(error, AppendOutcomeUnknown):
            # In the ledger or not: only its entries can tell, once the ledger's end is
            # settled. No append lands on it any more (closing: the next one settles its end
            # first, as for a ledger closed under an append), and the table is rebuilt from
            # the entries, that end settled, before the next producer append is checked.
            if not info.closed_ms:
                info.closed_ms, info.closing = self._clock.now_ms(), True
            self._forget_table(stream.name)
        _fail(flight, error or AppendOutcomeUnknown("the append was cancelled"))

    def _through(self, name: str, info: LedgerInfo, add: asyncio.Future[list[int]]) -> None:
        """An append without producer headers of a deduplicating stream: the table's
        ``through`` moves past it."""
        table = self._tables.get(name)
        if table is not None and not add.cancelled() and add.exception() is None:
            ids = add.result()
            table.record(None, 0, Position(info.ledger_id, ids[0]), len(ids), 0)

    def _forget_table(self, name: str) -> None:
        table = self._tables.pop(name, None)
        if table is not None and table.flights:
            self._stale[name] = table

    async def _table(self, stream: Stream) -> Table:
        """The stream's producer table, rebuilt first when this node has none (started,
        took the stream over, or lost an append's outcome): the snapshot, then the entries
        after it."""
        table = self._tables.get(stream.name)
        if table is not None:
            return table
        async with self._loading.setdefault(stream.name, asyncio.Lock()):
            table = self._tables.get(stream.name)
            if table is not None:
                return table
            stale = self._stale.pop(stream.name, None)
            if stale is not None:  # its adds land, or fail, before the entries are read
                pending = [f.done for fs in stale.flights.values() for f in fs]
                if pending:
                    await asyncio.wait(pending)
            if any(info.closing for info in stream.ledgers):
                # A ledger an append's unknown outcome left: its end decides what is in it.
                async with self._rolling.setdefault(stream.name, asyncio.Lock()):
                    await self._settle_closing(stream)
            table = await self._rebuild(stream)
            if self._streams.get(stream.name) is not stream:
                raise self._gone(stream.name)
            self._tables[stream.name] = table
            return table

    def _gone(self, name: str) -> StorageError:
        if name in self._moved:
            return NotOwner(f"stream {name[:100]!r} is served by another node now: retry")
        return StreamNotFound(f"stream {name[:100]!r} was deleted")

    async def _rebuild(self, stream: Stream) -> Table:
        raw = self._snapshots.get(stream.name)
        table = Table.decode(raw) if raw is not None else Table()
        now = self._clock.now_ms()
        replayed = 0
        for info in list(stream.ledgers):
            if not info.envelope or info.ledger_id < table.through.ledger_id:
                continue
            start = table.through.entry_id + 1 if info.ledger_id == table.through.ledger_id else 0
            last = self._last_entry(info)
            if start > last:
                continue
            async for entry_id, entry in self.stored_entries(stream, info, start, last):
                producer, sequence, _ = open_envelope(entry)
                table.record(producer, sequence, Position(info.ledger_id, entry_id), 1, now)
                replayed += 1
        table.since_snapshot = replayed
        log.info(
            "stream %s: producer table rebuilt (%d producers; %d entries read after the "
            "snapshot at %s)",
            stream.name,
            len(table.producers),
            replayed,
            table.through,
        )
        return table

    async def load_table(self, name: str) -> None:
        """Rebuild the table of a deduplicating stream now (a takeover, before serving)."""
        stream = self.stream(name)
        if stream.policies.deduplication or any(i.envelope for i in stream.ledgers):
            await self._table(stream)

    def _snapshot_soon(self, stream: Stream, table: Table) -> None:
        interval = self._settings.stream_dedup_snapshot_interval_entries
        if table.since_snapshot < interval or stream.name in self._snapshotting:
            return
        task = asyncio.get_running_loop().create_task(self._write_snapshot(stream, table))
        self._snapshotting[stream.name] = task
        task.add_done_callback(lambda _: self._snapshotting.pop(stream.name, None))

    async def _write_snapshot(self, stream: Stream, table: Table) -> None:
        try:
            async with self._writing.setdefault(stream.name, asyncio.Lock()):
                if self._streams.get(stream.name) is not stream or (
                    self._tables.get(stream.name) is not table
                ):
                    return
                await self._storage.write_records(self._snapshot_change(stream.name, table))
        except StorageError as error:
            log.warning("stream %s: producer table snapshot not written (the next one is "
                        "tried after as many appends): %s", stream.name, error)  # fmt: skip

    def _snapshot_change(self, name: str, table: Table) -> dict[bytes, bytes | None]:
        """The snapshot record of the table as it is now (called under the writing lock;
        ``_snapshots`` is set at once: a record written later holds newer state)."""
        now = self._clock.now_ms()
        table.expire(now, self._idle_ms())
        value = table.encode(now)
        table.since_snapshot, table.snapshot_ms = 0, now
        self._snapshots[name] = value
        return {snapshot_key(name): value}

    def dedup_stats(self) -> dict[str, tuple[int, int]]:
        """Per deduplicating stream served here with a table: (producers tracked, the age
        of its snapshot in ms; -1 without one)."""
        now = self._clock.now_ms()
        return {
            name: (len(t.producers), now - t.snapshot_ms if t.snapshot_ms else -1)
            for name, t in self._tables.items()
        }

    def _add(self, ledger_id: int, payloads: list[bytes]) -> Coroutine[Any, Any, list[int]]:
        """The add, begun now where the storage begins in its call (a replicated ledger's
        writer sends at once; the local engine starts in the task)."""
        if len(payloads) == 1:
            return _listed(self._storage.add_entry(ledger_id, None, payloads[0]))
        return self._storage.add_entries(ledger_id, payloads)

    def _reserve(self, info: LedgerInfo, count: int, size: int) -> LedgerInfo:
        flight = self._in_flight.get(info.ledger_id)
        if flight is None:
            flight = self._in_flight[info.ledger_id] = _InFlight()
        flight.appends += 1
        flight.entries += count
        flight.size_bytes += size
        return info

    def _settle(
        self,
        info: LedgerInfo,
        count: int,
        size: int,
        then: Settled | None,
        name: str,
        payloads: list[bytes],
        add: asyncio.Future[list[int]],
    ) -> None:
        """An add on ``info`` is over: its reservation becomes counted entries, or nothing;
        then ``then`` learns it (the producer table). Acknowledged ``payloads`` go to the
        cache and the stream's waiting readers wake here, not once the append's own task
        has resumed: a tailing consumer's entry is on its way a turn of the loop sooner."""
        if not add.cancelled() and add.exception() is None:
            ids = add.result()
            info.entries = max(info.entries, ids[-1] + 1)
            info.size_bytes += size
            entries, total = self.appended.get(name, (0, 0))
            self.appended[name] = (entries + len(ids), total + size)
            self.cache.put(info.ledger_id, ids[0], payloads)
            self._wake(name)
        self._release(info, count, size)
        if then is not None:
            then(add)

    def _reserve_now(self, stream: Stream, count: int, size: int) -> LedgerInfo | None:
        """Room for the append in the ledger taking appends, reserved (no await: nothing
        else reserves between the check and the reservation); None: it must roll first, or
        the ledger before it is still closing (its rollover's close is under way or failed:
        see _settle_closing)."""
        current = stream.ledgers[-1] if stream.ledgers else None
        if current is None or not self._has_room(stream, current, count, size):
            return None
        if len(stream.ledgers) > 1 and stream.ledgers[-2].closing:
            return None
        return self._reserve(current, count, size)

    async def _ledger_for_append(self, stream: Stream, count: int, size: int) -> LedgerInfo:
        """The ledger the append goes to, with room reserved in it."""
        info = self._reserve_now(stream, count, size)
        if info is not None:
            return info
        async with self._rolling.setdefault(stream.name, asyncio.Lock()):
            await self._settle_closing(stream)
            info = self._reserve_now(stream, count, size)  # another append rolled meanwhile
            if info is not None:
                return info
            fresh, old = await self._open_next(stream)
            # Synchronously after the new ledger appeared: no other append took its room.
            info = self._reserve(fresh, count, size)
            try:
                await self._seal(stream, old)
            except BaseException:
                self._release(info, count, size)
                raise
            return info

    def _release(self, info: LedgerInfo, count: int, size: int) -> None:
        """The reservation of an append ends (sent or not: what landed is counted by
        ``_settle``)."""
        flight = self._in_flight[info.ledger_id]
        flight.appends -= 1
        flight.entries -= count
        flight.size_bytes -= size
        if not flight.appends:
            del self._in_flight[info.ledger_id]
            flight.settled.set()

    def _has_room(self, stream: Stream, info: LedgerInfo, count: int, size: int) -> bool:
        """Whether the ledger takes an append of ``count`` entries and ``size`` bytes, with
        the appends in flight on it: Pulsar's currentLedgerIsFull, checked before the add."""
        if info.closed_ms:
            return False
        p = stream.policies
        if info.envelope != p.deduplication:
            return False  # deduplication was turned on or off: it takes the next ledger
        age_ms = self._clock.now_ms() - info.created_ms
        if age_ms < p.minLedgerRolloverTimeMinutes * MINUTE_MS:
            return True  # Pulsar: a ledger younger than the minimum time passes its limits
        flight = self._in_flight.get(info.ledger_id) or _InFlight()
        entries = info.entries + flight.entries
        if not entries:
            return True  # an empty ledger takes any one append whole, and never rolls by time
        if age_ms >= p.maxLedgerRolloverTimeMinutes * MINUTE_MS:
            return False
        return (
            entries + count <= p.maxEntriesPerLedger
            and info.size_bytes + flight.size_bytes + size <= p.maxSizePerLedgerMbytes * MiB
        )

    def _full(self, stream: Stream, info: LedgerInfo) -> bool:
        """Pulsar's currentLedgerIsFull: no room for one more entry of at least a byte."""
        return not self._has_room(stream, info, 1, 1)

    async def _open_next(self, stream: Stream) -> tuple[LedgerInfo, LedgerInfo | None]:
        """Create the stream's next ledger and write the record naming it; only then does
        it take appends. Returns it and the ledger it replaces (None: none was open)."""
        envelope = stream.policies.deduplication
        properties = {STREAM_PROPERTY: stream.name}
        if envelope:
            properties[ENVELOPE_PROPERTY] = ENVELOPE_MARK
        meta, _ = await self._storage.create_ledger(properties=properties)
        async with self._writing.setdefault(stream.name, asyncio.Lock()):
            if self._streams.get(stream.name) is not stream:
                # Deleted while the ledger was created: it must not take appends.
                await self._storage.delete_ledger(meta.ledger_id)
                raise StreamNotFound(f"stream {stream.name[:100]!r} was deleted")
            now = self._clock.now_ms()
            last = stream.ledgers[-1] if stream.ledgers else None
            old = last if last is not None and not last.closed_ms else None
            fresh = LedgerInfo(meta.ledger_id, created_ms=now, envelope=envelope)
            written = [dataclasses.replace(info) for info in stream.ledgers]
            if old is not None:
                written[-1].closed_ms, written[-1].closing = now, True
            record = dataclasses.replace(stream, ledgers=[*written, fresh])
            try:
                await self._storage.write_records({record.key(): record.encode()})
            except BaseException:
                with contextlib.suppress(StorageError):  # else start() deletes it: empty
                    await self._storage.delete_ledger(meta.ledger_id)
                raise
            if old is not None:
                old.closed_ms, old.closing = now, True
            stream.ledgers = [*stream.ledgers, fresh]
        if old is not None:
            self._crash.hit("stream.rollover.after_record")  # the old ledger closes after this
        self.rollovers += 1
        if last is not None:  # the stream's first ledger is no rollover
            count = self.rollovers_by_stream.get(stream.name, 0)
            self.rollovers_by_stream[stream.name] = count + 1
        log.info("stream %s rolled over to ledger %d", stream.name, meta.ledger_id)
        return fresh, old

    async def _seal(self, stream: Stream, old: LedgerInfo | None) -> None:
        """Close the ledger a rollover replaced (``closing`` since the record named the new
        one) and write its final counts into the stream record."""
        if old is not None:
            await self._settle_closing(stream)

    async def _settle_closing(self, stream: Stream) -> None:
        """Close every ``closing`` ledger of the stream once the adds in flight on it
        settled, so that its final counts are theirs, and write them into the stream record.
        Called under the stream's rolling lock before anything reaches a later ledger: an
        add of a closing ledger may have an unknown outcome, and its fate is only fixed by
        the close (the writer's end, or a recovery's). Were appends to go on past it, a
        client that read the stream without its unknown append and appended it again
        would see it twice once the close (or a takeover's recovery) kept the first one,
        behind positions readers had consumed. A close that fails (the metadata store down)
        fails the append that needed it; nothing of that append was sent."""
        closing = [info for info in stream.ledgers if info.closing]
        for info in closing:
            flight = self._in_flight.get(info.ledger_id)
            if flight is not None:
                await flight.settled.wait()
            await self._close_ledger(info)
        if closing:
            await self._save(stream)

    async def save(self, name: str) -> None:
        """Write the stream's record as it is now (a takeover that recovered its ledgers'
        ends but could not open a new ledger)."""
        await self._save(self.stream(name))

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
            _fresh, old = await self._open_next(stream)
            await self._seal(stream, old)
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

    def _resume(self, stream: Stream, start: Position) -> Position:
        """Where a read from ``start`` begins: there, or at the stream's first entry when
        retention deleted ``start``'s ledger (its entries are gone; Pulsar's readers skip
        deleted ledgers too). A tailing read's next position, or the mark-delete a cursor
        read started from, is left in such a ledger by a trim. InvalidPosition when the
        ledger is not the stream's."""
        if stream.ledgers and start.ledger_id < stream.ledgers[0].ledger_id:
            try:
                owner = self._storage.ledger(start.ledger_id).properties.get(STREAM_PROPERTY)
            except LedgerNotFound:
                owner = stream.name  # deleted: trimmed (ids of a stream only grow)
            if owner == stream.name:  # or not deleted yet: a trim deletes them paced
                return self.first_position(stream)
        self._index_of(stream, start.ledger_id)
        return start

    async def read(
        self,
        name: str,
        start: Position | None,
        limit: int,
        wait_s: float,
        admit: Admit | None = None,
    ) -> Read:
        """Up to ``limit`` entries from ``start`` (default: the first), waiting up to
        ``wait_s`` for new ones when there is nothing to read yet. ``admit`` is asked about
        each entry's size before it joins the result; False ends the result there."""
        stream = self.stream(name)
        if start is not None and stream.ledgers:
            start = self._resume(stream, start)
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
            found = await self._read_now(self.stream(name), start, limit, admit)
            remaining = deadline - loop.time()
            if found or remaining <= 0:
                return found
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                return []

    async def _read_now(
        self, stream: Stream, start: Position | None, limit: int, admit: Admit | None
    ) -> Read:
        if not stream.ledgers:
            return []
        ahead = self._reading_ahead.get(stream.name)
        if ahead is not None:  # most likely fetching what this read asks for: into the cache
            await asyncio.shield(ahead)
        start = self.first_position(stream) if start is None else self._resume(stream, start)
        found: Read = []
        first = self._index_of(stream, start.ledger_id)
        entry = max(0, start.entry_id)
        misses = self.cache.stats.misses
        for info in stream.ledgers[first:]:
            last = self._last_entry(info)
            while entry <= last and len(found) < limit:
                payload = self.cache.get(info.ledger_id, entry)
                if payload is None:
                    break
                if admit is not None and not await admit(len(payload)):
                    return found
                found.append((Position(info.ledger_id, entry), payload))
                entry += 1
            while entry <= last and len(found) < limit:
                cold = _replicas_deleted(info)
                try:
                    async for eid, payload in self.ledger_entries(
                        stream, info, entry, min(last, entry + limit - len(found) - 1)
                    ):
                        if admit is not None and not await admit(len(payload)):
                            return found
                        found.append((Position(info.ledger_id, eid), payload))
                        entry = eid + 1
                        self.cache.stats.misses += 1
                    break
                except StorageError as e:
                    if not cold and _replicas_deleted(info):
                        continue  # its replicas went during the read: the rest from the store
                    if not isinstance(e, LedgerNotFound) or info in stream.ledgers:
                        raise
                    break  # trimmed meanwhile: the rest of it is gone, as for _resume
            if len(found) >= limit:
                break
            entry = 0
        if len(found) >= limit and self.cache.stats.misses > misses:
            self._read_ahead(stream, found[-1][0], limit)
        return found

    def _read_ahead(self, stream: Stream, after: Position, count: int) -> None:
        """A read that went to the ledgers and stopped at its limit is likely a reader
        catching up: the next ``count`` entries are fetched into the entry cache meanwhile
        (Pulsar's read-ahead of a dispatcher behind), so its next read finds them there.
        Only entries at or below the LAC are read: what the cache may hold. One per stream."""
        if stream.name in self._reading_ahead or not self.cache.max_bytes:
            return
        task = asyncio.get_running_loop().create_task(self._fetch(stream, after, count))
        self._reading_ahead[stream.name] = task
        task.add_done_callback(lambda _: self._reading_ahead.pop(stream.name, None))

    async def _fetch(self, stream: Stream, after: Position, count: int) -> None:
        start = self.next_position(stream, after)
        if start is None:
            return
        budget = self.cache.max_bytes // READ_AHEAD_CACHE_SHARE
        payloads: list[bytes] = []
        try:
            info = stream.ledgers[self._index_of(stream, start.ledger_id)]
            last = min(self._last_entry(info), start.entry_id + count - 1)
            async for _, payload in self.ledger_entries(stream, info, start.entry_id, last):
                payloads.append(payload)
                budget -= len(payload)
                if budget <= 0:
                    break  # more would push out of the cache what it just read
        except StorageError as error:  # the reader's own read meets it, and says it
            log.debug("read-ahead of stream %s stopped: %s", stream.name, error)
        if self._streams.get(stream.name) is stream and info in stream.ledgers:
            self.cache.put(info.ledger_id, start.entry_id, payloads)

    def ledger_entries(
        self, stream: Stream, info: LedgerInfo, first: int, last: int
    ) -> AsyncIterator[tuple[int, bytes]]:
        """A ledger's entries [first, last]: from the object store once an offload deleted
        its replicas (replicated streams), else from the backend."""
        entries = self.stored_entries(stream, info, first, last)
        return _stripped(entries) if info.envelope else entries

    def stored_entries(
        self, stream: Stream, info: LedgerInfo, first: int, last: int
    ) -> AsyncIterator[tuple[int, bytes]]:
        """The entries as stored (a deduplicating stream's with their producer header)."""
        offload = info.offload
        if offload is None or not offload.local_deleted:
            return self._storage.read_range(info.ledger_id, first, last)
        cold = self.cold
        if cold is None:
            raise LedgerNotFound(f"ledger {info.ledger_id} is offloaded: no store to read it")
        meta = info.meta(stream.name)

        async def entries() -> AsyncIterator[tuple[int, bytes]]:
            for entry_id in range(first, last + 1):
                yield entry_id, await cold.read(meta, entry_id)

        return entries()

    # --- tiered storage of replicated streams (node.offload) -----------------------------

    async def record_offload(self, name: str, ledger_id: int, offload: OffloadInfo) -> None:
        """Write a replicated stream's ledger's offload record (in the stream record).
        LedgerNotFound when the ledger left the stream (retention, deletion)."""
        await self._write_offload(name, ledger_id, offload, {})

    async def drop_replicas(self, name: str, ledger_id: int) -> None:
        """After an offload's deletion lag: the stream reads the ledger from the object
        store from now on, and its replicated ledger is deleted (each node reclaims its
        replica). The record says so first, with a ``doomed`` record, so that a crash before
        the deletion leaves it for the next start to finish, not forgotten."""
        offload = self.stream(name).ledgers[self._index_of_kept(name, ledger_id)].offload
        if offload is None or not offload.offloaded:
            raise LedgerNotFound(f"ledger {ledger_id} is not offloaded")
        dropped = dataclasses.replace(offload, local_deleted=True)
        doomed: dict[bytes, bytes | None] = {doomed_key(ledger_id): encode_doomed(name)}
        await self._write_offload(name, ledger_id, dropped, doomed)
        with contextlib.suppress(LedgerNotFound):
            await self._storage.delete_ledger(ledger_id)
        await self._storage.write_records({doomed_key(ledger_id): None})

    async def _write_offload(
        self, name: str, ledger_id: int, offload: OffloadInfo, more: dict[bytes, bytes | None]
    ) -> None:
        stream = self.stream(name)
        async with self._writing.setdefault(name, asyncio.Lock()):
            if self._streams.get(name) is not stream:
                raise LedgerNotFound(f"stream {name} was deleted")
            index = self._index_of_kept(name, ledger_id)
            written = list(stream.ledgers)
            written[index] = dataclasses.replace(written[index], offload=offload)
            record = dataclasses.replace(stream, ledgers=written)
            await self._storage.write_records({record.key(): record.encode(), **more})
            stream.ledgers[index].offload = offload

    def _index_of_kept(self, name: str, ledger_id: int) -> int:
        """Where the ledger is in the stream; LedgerNotFound once a trim dropped it."""
        for i, info in enumerate(self.stream(name).ledgers):
            if info.ledger_id == ledger_id:
                return i
        raise LedgerNotFound(f"ledger {ledger_id} is no longer part of stream {name}")

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

    def _check_readable(self, stream: Stream, mark: Position, asked: Position) -> None:
        """``mark`` (a mark-delete) must lie in the stream; the message names ``asked``, the
        position the client gave (a reset's and a cursor start's mark is the entry before)."""
        info = stream.ledgers[self._index_of(stream, mark.ledger_id)]
        last = self._last_entry(info)
        if mark.entry_id > last:
            raise InvalidPosition(
                f"entry {asked.entry_id} of ledger {asked.ledger_id} does not exist yet (its "
                f"last entry is {last})"
            )
        if mark.entry_id < -1:
            raise InvalidPosition(f"{asked} names no entry: entry ids start at 0")

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
                position = parse_position(start)
                if not stream.ledgers:
                    raise InvalidPosition(
                        f"stream {name} has no entries yet, so {start} is not one of them: "
                        'create the cursor at "earliest" or "latest"'
                    )
                self._check_readable(
                    stream, Position(position.ledger_id, position.entry_id - 1), position
                )
                mark = self._before(stream, position)
            created = Cursor(name, cursor, mark, self._clock.now_ms())
            await self._storage.write_records({created.key(): created.encode()})
            self._cursors.setdefault(name, {})[cursor] = created
        return created, True

    async def acknowledge(self, name: str, cursor: str, position: Position) -> Cursor:
        """Mark-delete up to ``position`` (never moves back: use reset for that)."""
        found = self.cursor(name, cursor)
        self._check_readable(self.stream(name), position, position)
        await self._move(found, position, forward_only=True)
        return found

    async def reset(self, name: str, cursor: str, position: Position) -> Cursor:
        """Make ``position`` the next entry the cursor reads (back or forth)."""
        found = self.cursor(name, cursor)
        stream = self.stream(name)
        mark = self._before(stream, position)
        self._check_readable(stream, mark, position)
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
            self._evict_read(stream)
            return True

    def _evict_read(self, stream: Stream) -> None:
        """Drop the cached entries every cursor of the stream has acknowledged (Pulsar
        evicts its entry cache behind the slowest cursor)."""
        cursors = self._cursors.get(stream.name)
        if not cursors or not self.cache.max_bytes:
            return
        slowest = min(c.mark_delete for c in cursors.values())
        behind = {i.ledger_id for i in stream.ledgers if i.ledger_id < slowest.ledger_id}
        self.cache.drop_ledgers(behind)
        self.cache.drop_through(slowest.ledger_id, slowest.entry_id)

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
        self, name: str, cursor: str, limit: int, wait_s: float, admit: Admit | None = None
    ) -> Read:
        found = self.cursor(name, cursor)
        stream = self.stream(name)
        start = self.next_position(stream, found.mark_delete)
        if start is None:
            start = (
                Position(stream.ledgers[-1].ledger_id, self._last_entry(stream.ledgers[-1]) + 1)
                if stream.ledgers
                else None
            )
        return await self.read(name, start, limit, wait_s, admit)

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

    # --- trimming (retention) ------------------------------------------------------------

    async def trim(self, name: str, ledger_ids: Iterable[int], pace_s: float) -> list[int]:
        """Drop the oldest ledgers (a prefix of the stream, never the one taking appends):
        the stream record first, then the ledgers, ``pace_s`` apart. Cursors left before the
        first ledger kept move to it (Pulsar), in the same batch as the stream record, so
        that no mark-delete names a deleted ledger."""
        stream = self.stream(name)
        doomed = set(ledger_ids)
        # The snapshot written with the trim holds what the dropped ledgers' entries told.
        table = await self._table(stream) if any(i.envelope for i in stream.ledgers) else None
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
            for info in removed:
                changes[doomed_key(info.ledger_id)] = encode_doomed(name, _attempt(info))
            if table is not None and self._tables.get(name) is table:
                changes.update(self._snapshot_change(name, table))
            await self._storage.write_records({stream.key(): stream.encode(), **changes})
            for cursor in behind:
                cursor.mark_delete = first
        await self._delete_dropped(removed, pace_s)
        return [info.ledger_id for info in removed]

    async def _delete_dropped(self, dropped: list[LedgerInfo], pace_s: float = 0) -> None:
        """Delete ledgers a trim or a stream deletion dropped (``pace_s`` apart), the objects
        of offloaded ones, then their ``doomed`` records. A record whose objects the store
        could not delete stays: the next offload run, or the next start, finishes it."""
        done = []
        self.cache.drop_ledgers({info.ledger_id for info in dropped})
        for n, info in enumerate(dropped):
            if n and pace_s > 0:
                await self._clock.sleep(pace_s)
            with contextlib.suppress(LedgerNotFound):
                await self._storage.delete_ledger(info.ledger_id)
            attempt = _attempt(info)
            if attempt is not None and self.remove_objects is not None:
                try:
                    await self.remove_objects(info.ledger_id, attempt)
                except StorageError as e:
                    log.warning("ledger %d is deleted; its objects stay for now: %s",
                                info.ledger_id, e.message)  # fmt: skip
                    continue
            done.append(info.ledger_id)
        if done:
            await self._storage.write_records({doomed_key(lid): None for lid in done})

    async def expire(self, name: str, end: Position) -> list[str]:
        """Message TTL: move every cursor of the stream forward to ``end``
        (``rules.ttl_mark``); a cursor already past it stays. Returns the moved cursors."""
        moved = []
        for cursor in list(self._cursors.get(name, {}).values()):
            with contextlib.suppress(CursorNotFound):  # deleted meanwhile
                if await self._move(cursor, end, forward_only=True):
                    moved.append(cursor.name)
        return moved


async def _stripped(
    entries: AsyncIterator[tuple[int, bytes]],
) -> AsyncIterator[tuple[int, bytes]]:
    async for entry_id, entry in entries:
        yield entry_id, strip_envelope(entry)


def _fail(flight: Flight, error: BaseException) -> None:
    """A flight's failure is its waiters' to raise; none may be waiting (no warning then)."""
    flight.done.set_exception(error)
    flight.done.exception()


def _replicas_deleted(info: LedgerInfo) -> bool:
    return info.offload is not None and info.offload.local_deleted


def _attempt(info: LedgerInfo) -> str | None:
    """The offload attempt whose objects go with the ledger (replicated streams)."""
    return info.offload.attempt if info.offload is not None else None


def parse_position(text: str) -> Position:
    """``L:E`` as a position; MalformedPosition or InvalidPosition (out of range) otherwise."""
    try:
        return Position.parse(text)
    except PositionOutOfRange as e:
        raise InvalidPosition(str(e)) from None
    except ValueError as e:
        raise MalformedPosition(str(e)) from None


async def _listed(entry_id: Awaitable[int]) -> list[int]:
    return [await entry_id]
