"""The RocksDB index (BookKeeper's EntryLocationIndex and LedgerMetadataIndex).

Column families of one database, so that a checkpoint updates them in one write batch:

``locations``  key ``ledger id u64 | entry id u64`` (big-endian: a ledger's entries are
               contiguous and its last entry is a reverse seek), the first entry of a run
               of consecutive entries of the ledger; value the run's locations (below).
``ledgers``    key ``ledger id u64``, value a ``LedgerMeta`` (layout below); loaded into
               memory at start.
``streams``    records of the streams layer (its own format, see node/streams); the
               engine stores them durably and does not read them.
``node``       the engine's own counters: ``next_ledger_id`` -> u64, written with every
               purge of deleted ledgers, so that a purged id is never allocated again.

A run's value, version 1: ``version u8 = 1``, then one ``location u64`` (big-endian) per
entry, the key's entry id first. A checkpoint writes a ledger's consecutive entries as
runs of up to RUN_ENTRIES (one RocksDB put per run, not per entry); an entry is in one
run only, so the run holding an entry is the nearest key at or before it (a reverse
seek). An 8-byte value (no version byte: 8 is never 1 + 8n) is a run of one entry, as
indexes from before runs hold them; they are read as they are.

LedgerMeta value, version 1::

    0   1   version u8 = 1
    1   1   state u8 (0 open, 1 fenced, 2 closed, 3 deleted)
    2   8   lac i64                 last add confirmed, -1 = none
    10  8   last entry id i64       highest entry id added, -1 = none
    18  8   entries u64
    26  8   bytes u64               payload bytes
    34  8   created ms u64
    42  8   closed ms u64           0 = not closed
    50  2   write token length u16, then the token's SHA-256 digest (or nothing)
    ..  4   properties length u32, then properties as UTF-8 JSON

Version 2 (written only for a ledger with an offload record; version 1 otherwise) appends
the offload record (tiered storage, node/offload), durable before any upload::

    ..  1   offload state u8 (0 none, 1 in progress, 2 offloaded)
    ..  1   attempt id length u8, then the attempt id (ASCII; it names the objects)
    ..  8   data object bytes u64
    ..  8   offloaded ms u64        when the upload was verified, 0 before
    ..  1   local copy deleted u8   1 = the entries are only in the object store

Version 3 (written only for a replicated ledger, one whose writer is a client of the
fleet, node/client) has an offload flag where version 2 starts its record, then the
replication fields::

    ..  1   has offload u8, then (if 1) the offload record of version 2
    ..  2   ensemble size u16       E of E/Qw/Qa; 0/0/0 = replicated, quorums not known yet
    ..  2   write quorum u16        (a fencing read created the ledger)
    ..  2   ack quorum u16
    ..  8   writer lac i64          highest X-Lac an add carried, -1 = none
    ..  8   writer lac length i64   X-Lac-Length that came with it
"""

from __future__ import annotations

import contextlib
import enum
import errno
import gc
import json
import logging
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from rocksdict import AccessType, Options, Rdict, RdictIter, ReadOptions, WriteBatch, WriteOptions

log = logging.getLogger(__name__)

LOCATION_KEY = struct.Struct(">QQ")
LOCATION_VALUE = struct.Struct(">Q")
RUN_VERSION = 1
RUN_HEADER = 1  # the version byte before a run's locations
# A run's value fills at most one 4 KiB RocksDB data block: a point read costs one block.
# Lookups rely on it as the longest run there is: it may grow in a later version, never
# shrink.
RUN_ENTRIES = 511
LEDGER_KEY = struct.Struct(">Q")
META_FIXED = struct.Struct(">BBqqQQQQ")
U16 = struct.Struct(">H")
U32 = struct.Struct(">I")
META_VERSION = 1
META_VERSION_OFFLOAD = 2
META_VERSION_REPLICATED = 3
OFFLOAD_FIXED = struct.Struct(">QQB")
REPLICATION_FIXED = struct.Struct(">HHHqq")
# A replicated ledger a fencing read created before any add told its quorums.
UNKNOWN_REPLICATION = (0, 0, 0)
U8 = struct.Struct(">B")
MAX_ID = (1 << 63) - 1
# Ledger property naming the stream that owns the ledger. Here, below both the streams
# package (which sets it) and the HTTP ledger routes (which refuse to let clients set it or
# change such a ledger), so that neither imports the other for it.
STREAM_PROPERTY = "stream"
COLUMN_FAMILIES = ("locations", "ledgers", "streams", "node")
NEXT_LEDGER_ID_KEY = b"next_ledger_id"
# Reopening after a failed write waits for reads still using the old database (it holds
# the LOCK until the last of them lets go): a few short pauses, then the next write retries.
REOPEN_ATTEMPTS = 3
REOPEN_PAUSE_S = 0.01


class LedgerState(enum.IntEnum):
    OPEN = 0
    FENCED = 1
    CLOSED = 2
    DELETED = 3


class OffloadState(enum.IntEnum):
    NONE = 0
    IN_PROGRESS = 1
    OFFLOADED = 2


@dataclass(slots=True, frozen=True)
class OffloadInfo:
    """Where a ledger's offload stands. The engine keeps it durable with the metadata and
    reads an offloaded ledger through its cold reader; node/offload decides the rest."""

    state: OffloadState
    attempt: str  # names the attempt's objects; fresh per attempt
    data_bytes: int = 0
    offloaded_ms: int = 0
    local_deleted: bool = False  # the entry logs no longer hold the entries

    @property
    def offloaded(self) -> bool:
        return self.state == OffloadState.OFFLOADED


@dataclass(slots=True)
class LedgerMeta:
    ledger_id: int
    state: LedgerState = LedgerState.OPEN
    lac: int = -1
    last_entry_id: int = -1
    entries: int = 0
    payload_bytes: int = 0
    created_ms: int = 0
    closed_ms: int = 0
    token_digest: bytes = b""
    properties: dict[str, str] = field(default_factory=dict)
    offload: OffloadInfo | None = None
    # E/Qw/Qa of a replicated ledger (None: a node-local ledger). Its entries are striped
    # over the ensemble, so ``lac`` (the local durable prefix) means nothing for it: the
    # writer's LAC, as its adds carried it, is ``writer_lac``.
    replication: tuple[int, int, int] | None = None
    writer_lac: int = -1
    writer_lac_length: int = 0
    # Replica adds taken since this process started (not stored): the over-replicated sweep
    # deletes a replica only if none came between its look at the store and its delete.
    replica_adds: int = field(default=0, compare=False)

    def encode(self) -> bytes:
        props = json.dumps(self.properties, separators=(",", ":"), sort_keys=True).encode()
        offload = self.offload
        replication = self.replication
        tail = b""
        if offload is not None:
            attempt = offload.attempt.encode("ascii")
            tail = b"".join(
                (
                    U8.pack(offload.state),
                    U8.pack(len(attempt)),
                    attempt,
                    OFFLOAD_FIXED.pack(
                        offload.data_bytes, offload.offloaded_ms, int(offload.local_deleted)
                    ),
                )
            )
        if replication is None:
            version = META_VERSION if offload is None else META_VERSION_OFFLOAD
        else:
            version = META_VERSION_REPLICATED
            tail = b"".join(
                (
                    U8.pack(offload is not None),
                    tail,
                    REPLICATION_FIXED.pack(*replication, self.writer_lac, self.writer_lac_length),
                )
            )
        return b"".join(
            (
                META_FIXED.pack(
                    version,
                    self.state,
                    self.lac,
                    self.last_entry_id,
                    self.entries,
                    self.payload_bytes,
                    self.created_ms,
                    self.closed_ms,
                ),
                U16.pack(len(self.token_digest)),
                self.token_digest,
                U32.pack(len(props)),
                props,
                tail,
            )
        )

    @classmethod
    def decode(cls, ledger_id: int, data: bytes) -> LedgerMeta:
        version, state, lac, last, entries, size, created, closed = META_FIXED.unpack_from(data)
        if version not in (META_VERSION, META_VERSION_OFFLOAD, META_VERSION_REPLICATED):
            raise ValueError(f"unsupported ledger metadata version {version}")
        pos = META_FIXED.size
        (token_len,) = U16.unpack_from(data, pos)
        pos += U16.size
        token = bytes(data[pos : pos + token_len])
        pos += token_len
        (props_len,) = U32.unpack_from(data, pos)
        pos += U32.size
        end = pos + props_len
        props = json.loads(data[pos:end]) if props_len else {}
        offload = None
        has_offload = version == META_VERSION_OFFLOAD
        if version == META_VERSION_REPLICATED:
            if len(data) < end + 1:
                raise ValueError(f"ledger metadata version {version} ends before its flags")
            has_offload = data[end] == 1
            end += 1
        if has_offload:
            # A damaged record must fail as one, never as an IndexError or struct.error.
            if len(data) < end + 2:
                raise ValueError(f"ledger metadata version {version} ends before its offload")
            offload_state, attempt_len = data[end], data[end + 1]
            if len(data) < end + 2 + attempt_len + OFFLOAD_FIXED.size:
                raise ValueError(f"ledger metadata version {version} has a cut offload record")
            attempt = bytes(data[end + 2 : end + 2 + attempt_len]).decode("ascii")
            end += 2 + attempt_len
            data_bytes, offloaded_ms, local_deleted = OFFLOAD_FIXED.unpack_from(data, end)
            end += OFFLOAD_FIXED.size
            offload = OffloadInfo(
                OffloadState(offload_state), attempt, data_bytes, offloaded_ms, bool(local_deleted)
            )
        replication = None
        writer_lac, writer_lac_length = -1, 0
        if version == META_VERSION_REPLICATED:
            if len(data) != end + REPLICATION_FIXED.size:
                raise ValueError(f"ledger metadata version {version} has a cut replication")
            e, qw, qa, writer_lac, writer_lac_length = REPLICATION_FIXED.unpack_from(data, end)
            replication = (e, qw, qa)
            end += REPLICATION_FIXED.size
        if end != len(data):
            raise ValueError("ledger metadata length does not match its fields")
        return cls(
            ledger_id,
            LedgerState(state),
            lac,
            last,
            entries,
            size,
            created,
            closed,
            token,
            props,
            offload,
            replication,
            writer_lac,
            writer_lac_length,
        )


# --- runs of locations -----------------------------------------------------------------------


def encode_run(locations: Sequence[int]) -> bytes:
    return struct.pack(f">B{len(locations)}Q", RUN_VERSION, *locations)


def run_length(value: bytes) -> int:
    """How many entries a run's value holds (ValueError if it is no run)."""
    if len(value) == LOCATION_VALUE.size:
        return 1  # from before runs
    count = len(value) // LOCATION_VALUE.size
    if len(value) % LOCATION_VALUE.size != RUN_HEADER or value[0] != RUN_VERSION or not count:
        raise ValueError(f"a location run of {len(value)} bytes, version {value[:1]!r}")
    return count


def _first_location_at(value: bytes) -> int:
    return 0 if len(value) == LOCATION_VALUE.size else RUN_HEADER


def run_location(value: bytes, index: int) -> int:
    """The location of the run's ``index``-th entry (checked against ``run_length``)."""
    at = _first_location_at(value) + index * LOCATION_VALUE.size
    return int(LOCATION_VALUE.unpack_from(value, at)[0])


def decode_run(value: bytes) -> tuple[int, ...]:
    return struct.unpack_from(f">{run_length(value)}Q", value, _first_location_at(value))


def split_runs(entry_ids: Sequence[int]) -> Iterator[tuple[int, int]]:
    """(start, end) slices of ``entry_ids`` (ascending) that are runs: consecutive ids, at
    most RUN_ENTRIES of them."""
    count = len(entry_ids)
    start = 0
    while start < count:
        end = min(count, start + RUN_ENTRIES)
        first = entry_ids[start]
        if entry_ids[end - 1] - first != end - 1 - start:  # a gap: the run ends before it
            end = start + 1
            while end < count and entry_ids[end] == first + end - start:
                end += 1
        yield start, end
        start = end


def expand_runs(locations: Rdict) -> Iterator[tuple[int, int, int]]:
    """(ledger id, entry id, location) of every entry in a locations column family, in key
    order (for inspect and audits)."""
    for key, value in cast(Iterable[tuple[bytes, bytes]], locations.items()):
        ledger_id, first = LOCATION_KEY.unpack(key)
        for n, loc in enumerate(decode_run(value)):
            yield ledger_id, first + n, loc


@dataclass(slots=True, frozen=True)
class Run:
    """A run as read from the index: its key, ledger, first entry id, length and value."""

    key: bytes
    ledger_id: int
    first: int
    count: int
    value: bytes

    def holds(self, ledger_id: int, entry_id: int) -> bool:
        return ledger_id == self.ledger_id and self.first <= entry_id < self.first + self.count

    def location(self, entry_id: int) -> int:
        return run_location(self.value, entry_id - self.first)


def find_run(iterator: RdictIter, ledger_id: int, entry_id: int) -> Run | None:
    """The run holding the entry, None if none does. It is the nearest key at or before
    the entry (runs never overlap); should two ever overlap, the search goes on back while
    a run could still reach the entry (RUN_ENTRIES ids, a step or two), so an entry is
    never hidden by a later run that starts after it and does not reach it."""
    iterator.seek_for_prev(LOCATION_KEY.pack(ledger_id, entry_id))
    while iterator.valid():
        key = iterator.key()
        lid, first = LOCATION_KEY.unpack(key)
        if lid != ledger_id or first <= entry_id - RUN_ENTRIES:
            return None
        value = iterator.value()
        count = run_length(value)
        if entry_id < first + count:
            return Run(key, lid, first, count, value)
        iterator.prev()
    return None


class Index:
    """Thread safe: RocksDB serializes writers itself; reads run on reader threads."""

    def __init__(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self._path = path
        self._open(read_only=False)
        self._sync = WriteOptions()
        self._sync.sync = True
        self._lock = threading.Lock()  # close() must not race a reader
        self._closed = False
        self._write_lock = threading.Lock()  # writes, and the reopen after a failed one
        self._failed: str | None = None  # why the last write failed; reopen before the next
        self._serving_read_only = False  # reads go to a read-only instance meanwhile

    def _open(self, read_only: bool) -> None:
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        options.create_missing_column_families(True)
        access = AccessType.read_only() if read_only else AccessType.read_write()
        db = Rdict(
            str(self._path),
            options=options,
            column_families={name: Options(raw_mode=True) for name in COLUMN_FAMILIES},
            access_type=access,
        )
        handles = (
            db.get_column_family("locations"),
            db.get_column_family("ledgers"),
            db.get_column_family("streams"),
            db.get_column_family("node"),
            db.get_column_family_handle("locations"),
            db.get_column_family_handle("ledgers"),
            db.get_column_family_handle("streams"),
            db.get_column_family_handle("node"),
        )
        self._db = db
        (
            self._locations,
            self._ledgers,
            self._streams,
            self._node,
            self._locations_cf,
            self._ledgers_cf,
            self._streams_cf,
            self._node_cf,
        ) = handles

    def _commit(self, batch: WriteBatch) -> None:
        """Write a batch synchronously. After a failed write RocksDB refuses every write
        (a sticky background error; its own recovery from a full disk waits for a whole
        write buffer of free space, 64 MiB, polled every 5 s): the next write reopens it.
        A full disk is reported as ENOSPC, like the other files report it."""
        with self._write_lock:
            self._reopen_if_failed()
            try:
                self._db.write(batch, self._sync)
            except Exception as e:
                self._failed = str(e)
                raise _as_os_error(e) from e

    def ensure_writable(self) -> None:
        """Reopen the database if a write failed (OSError if it still cannot be)."""
        with self._write_lock:
            self._reopen_if_failed()

    def _reopen_if_failed(self) -> None:
        """Readers move to a read-only instance first (it takes no LOCK and sees what the
        WAL holds), so reads go on while the failed instance closes and a new one opens;
        that one replays the WAL, which needs space: until then, writes fail and reads
        stay on the read-only instance."""
        if self._failed is None:
            return
        if not self._serving_read_only:
            failed = self._db
            self._open(read_only=True)
            self._serving_read_only = True
            with contextlib.suppress(Exception):
                failed.close()  # reports the sticky error again, and closes all the same
            del failed
        reader = self._db
        error: Exception | None = None
        for attempt in range(REOPEN_ATTEMPTS):
            if attempt:
                time.sleep(REOPEN_PAUSE_S)
            # The failed write's traceback (a frame <-> exception cycle, freed only by the
            # cycle collector) may still hold column family handles of the old instance.
            gc.collect()
            try:
                self._open(read_only=False)
            except Exception as e:
                error = e
                continue
            self._failed = None
            self._serving_read_only = False
            with contextlib.suppress(Exception):
                reader.close()
            log.warning("index %s reopened after a failed write", self._path)
            return
        assert error is not None
        raise _as_os_error(error) from error

    def get_location(self, ledger_id: int, entry_id: int) -> int | None:
        return self.get_locations([(ledger_id, entry_id)])[0]

    def get_locations(self, keys: list[tuple[int, int]]) -> list[int | None]:
        """``get_location`` of many (ledger id, entry id) with one iterator: keys in the
        same run as the one before (compaction asks in log order) cost no seek."""
        if not keys:
            return []
        found: list[int | None] = []
        read_options = ReadOptions()  # kept referenced: collected mid-scan, rocksdict misreads
        iterator = self._locations.iter(read_options)
        run: Run | None = None
        for ledger_id, entry_id in keys:
            if run is None or not run.holds(ledger_id, entry_id):
                run = find_run(iterator, ledger_id, entry_id)
            found.append(None if run is None else run.location(entry_id))
        del iterator, read_options
        return found

    def entry_ids(self, ledger_id: int, first: int = 0, last: int = MAX_ID) -> Iterator[int]:
        """Entry ids of a ledger present in the index, ascending, within [first, last]."""
        next_id = first  # runs never overlap; if they did, no id would come twice
        for run_first, run_last in self.held_runs(ledger_id, first, last):
            yield from range(max(next_id, run_first), run_last + 1)
            next_id = max(next_id, run_last + 1)

    def held_runs(self, ledger_id: int, first: int, last: int) -> list[tuple[int, int]]:
        """The ids of a ledger present in the index within [first, last], as its runs
        (first, last), ascending (two may touch): a run of RUN_ENTRIES ids costs one step,
        never one per id (the ledger check asks about whole fragments)."""
        read_options = ReadOptions()  # kept referenced: collected mid-scan, rocksdict misreads
        read_options.set_iterate_upper_bound(LOCATION_KEY.pack(ledger_id + 1, 0))
        iterator = self._locations.iter(read_options)
        # No run that starts before this reaches ``first``. (rocksdict's lower bound is
        # not one for raw keys; its upper bound is.)
        iterator.seek(LOCATION_KEY.pack(ledger_id, max(0, first - RUN_ENTRIES + 1)))
        held: list[tuple[int, int]] = []
        while iterator.valid():
            lid, run_first = LOCATION_KEY.unpack(iterator.key())
            if lid != ledger_id or run_first > last:
                break
            start = max(first, run_first)
            end = min(last, run_first + run_length(iterator.value()) - 1)
            if start <= end:
                held.append((start, end))
            iterator.next()
        del iterator, read_options
        return held

    def locations(self) -> Iterator[tuple[int, int, int]]:
        """Every (ledger id, entry id, location), in key order (for inspect and audits)."""
        return expand_runs(self._locations)

    def load_ledgers(self) -> dict[int, LedgerMeta]:
        ledgers = {}
        for key, value in self._ledgers.items():
            (ledger_id,) = LEDGER_KEY.unpack(cast(bytes, key))
            ledgers[ledger_id] = LedgerMeta.decode(ledger_id, cast(bytes, value))
        return ledgers

    def write(
        self,
        locations: Iterable[tuple[int, Sequence[int], Sequence[int]]],
        ledgers: Iterable[LedgerMeta],
    ) -> None:
        """One synchronous write batch: new locations, as (ledger id, entry ids ascending,
        their locations) per ledger, in runs; and changed ledger metadata."""
        batch = WriteBatch(raw_mode=True)
        cf = self._locations_cf
        for ledger_id, entry_ids, ledger_locations in locations:
            assert len(entry_ids) == len(ledger_locations)
            for start, end in split_runs(entry_ids):
                key = LOCATION_KEY.pack(ledger_id, entry_ids[start])
                batch.put(key, encode_run(ledger_locations[start:end]), cf)
        for meta in ledgers:
            batch.put(LEDGER_KEY.pack(meta.ledger_id), meta.encode(), self._ledgers_cf)
        self._commit(batch)

    def relocate(self, moves: list[tuple[int, int, int, int]]) -> int:
        """Point (ledger, entry) from ``old`` to ``new`` location where it still points at
        ``old`` (compaction), in one synchronous batch. Returns how many moved.

        Each run that holds a moved entry is written again whole (the index's writes run
        on one thread, the checkpoint's: nothing changes a run in between)."""
        runs: dict[bytes, list[int]] = {}  # key of each run met -> its locations
        changed: set[bytes] = set()
        read_options = ReadOptions()  # kept referenced: collected mid-scan, rocksdict misreads
        iterator = self._locations.iter(read_options)
        run: Run | None = None
        locations: list[int] = []
        moved = 0
        for ledger_id, entry_id, old, new in moves:
            if run is None or not run.holds(ledger_id, entry_id):
                run = find_run(iterator, ledger_id, entry_id)
                if run is None:
                    continue
                if run.key not in runs:
                    runs[run.key] = list(decode_run(run.value))
                locations = runs[run.key]
            index = entry_id - run.first
            if locations[index] == old:
                locations[index] = new
                changed.add(run.key)
                moved += 1
        del iterator, read_options
        batch = WriteBatch(raw_mode=True)
        for key in changed:
            batch.put(key, encode_run(runs[key]), self._locations_cf)
        self._commit(batch)
        return moved

    def drop_locations(self, meta: LedgerMeta) -> None:
        """The ledger's metadata and the removal of all its locations, in one batch: its
        entries become garbage in the entry logs while the ledger stays known."""
        batch = WriteBatch(raw_mode=True)
        lid = meta.ledger_id
        batch.delete_range(
            LOCATION_KEY.pack(lid, 0), LOCATION_KEY.pack(lid + 1, 0), self._locations_cf
        )
        batch.put(LEDGER_KEY.pack(lid), meta.encode(), self._ledgers_cf)
        self._commit(batch)

    def next_ledger_id(self) -> int:
        """The allocation floor the last purge recorded (0 if none)."""
        value = self._node.get(NEXT_LEDGER_ID_KEY)
        return 0 if value is None else LEDGER_KEY.unpack(cast(bytes, value))[0]

    def delete_ledgers(self, ledger_ids: list[int], next_ledger_id: int) -> None:
        """Forget ledgers entirely: their locations and their metadata, in one batch that
        also records ``next_ledger_id`` (the purged ids may have been the highest)."""
        batch = WriteBatch(raw_mode=True)
        batch.put(NEXT_LEDGER_ID_KEY, LEDGER_KEY.pack(next_ledger_id), self._node_cf)
        for ledger_id in ledger_ids:
            batch.delete_range(
                LOCATION_KEY.pack(ledger_id, 0),
                LOCATION_KEY.pack(ledger_id + 1, 0),
                self._locations_cf,
            )
            batch.delete(LEDGER_KEY.pack(ledger_id), self._ledgers_cf)
        self._commit(batch)

    # --- the streams keyspace: opaque records of the streams layer -------------------------

    def write_records(self, changes: dict[bytes, bytes | None]) -> None:
        """Put (or delete, for None) records of the streams keyspace: one synchronous batch,
        so a change is durable when this returns and several land together or not at all."""
        batch = WriteBatch(raw_mode=True)
        for key, value in changes.items():
            if value is None:
                batch.delete(key, self._streams_cf)
            else:
                batch.put(key, value, self._streams_cf)
        self._commit(batch)

    def records(self) -> dict[bytes, bytes]:
        """Every record of the streams keyspace (loaded once at start)."""
        return {cast(bytes, k): cast(bytes, v) for k, v in self._streams.items()}

    def estimated_keys(self) -> int:
        """Keys of the locations column family: one per run of entries (RocksDB estimate)."""
        return int(self._locations.property_int_value("rocksdb.estimate-num-keys") or 0)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                # Column family handles keep the database (and its LOCK) alive: drop them,
                # or the next open in this process fails.
                del self._locations, self._ledgers, self._locations_cf, self._ledgers_cf
                del self._streams, self._streams_cf, self._node, self._node_cf
                if self._failed is None:
                    self._db.close()
                else:
                    with contextlib.suppress(Exception):
                        self._db.close()  # reports the failed write again; closes anyway


def _as_os_error(error: Exception) -> OSError:
    """RocksDB reports errors as text; a full disk becomes ENOSPC, anything else EIO."""
    text = str(error)
    if "No space left on device" in text:
        code = errno.ENOSPC
    elif "quota exceeded" in text.lower():
        code = errno.EDQUOT
    else:
        code = errno.EIO
    return OSError(code, f"index write failed: {text}")
