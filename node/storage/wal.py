"""The write-ahead log interface shared by the file journal and the raw-device ring.

Ledger storage sees only this: append a record and get a future that completes once the
record is durable; ask for a sync point covering everything appended so far; tell the WAL
that everything up to a mark is safe in entry logs so it can trim; replay from a mark.

A record is ``(ledger id, entry id, crc32c, payload)``. Entry ids >= 0 are entries; the
negative ids below are metadata records, journaled like entries so that a ledger's state
changes are exactly as durable as its data (BookKeeper journals fence and LAC the same way).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterable, Iterator
from typing import NamedTuple, Protocol

from crc32c import crc32c as _crc32c

_ID_PREFIX = struct.Struct(">qq")

# Metadata record kinds, carried in the entry id field (BookKeeper uses -0x1000.. likewise).
LEDGER_CREATED = -0x1000  # payload: the ledger's metadata (index.LedgerMeta encoding)
FENCE = -0x2000  # payload: empty
CLOSE = -0x3000  # payload: i64 last entry id
DELETE = -0x5000  # payload: empty
EXPLICIT_LAC = -0x8000  # payload: i64 last add confirmed
# Entries at consecutive ids of one ledger in one record (the journal's format; replay hands
# them on as a BatchRecord, never as a WalRecord of this kind).
BATCH = -0x9000


class LogMark(NamedTuple):
    """A position in the WAL: (file id, offset) for the journal, (0, offset) for the ring."""

    log_id: int
    offset: int


class WalRecord(NamedTuple):
    ledger_id: int
    entry_id: int
    payload: bytes


class EntryRun(NamedTuple):
    """Entries at consecutive ids of one ledger, each with its ``record_crc``, as replay hands
    them on to be put back as one batch: a batch record's (BatchRecord), or single records
    that replay gathered (``replay_runs``)."""

    ledger_id: int
    first_entry_id: int
    crcs: list[int]
    payloads: list[bytes]

    def records(self) -> Iterator[WalRecord]:
        for n, payload in enumerate(self.payloads):
            yield WalRecord(self.ledger_id, self.first_entry_id + n, payload)


class BatchRecord(EntryRun):
    """A batch record of the journal (entry id BATCH), decoded: an add's entries, journaled
    as one record."""

    __slots__ = ()


# What replay yields: a record with its ``record_crc`` when the WAL checked that very value
# (the journal), else None (replay computes it); or a run of entries, crc None.
Replayed = tuple[WalRecord | EntryRun, int | None]
# The longest run of single records replay gathers into one EntryRun: the storage checks its
# write cache's size (to flush as it goes) between them.
REPLAY_RUN_ENTRIES = 1024


def replay_runs(records: Iterable[WalRecord]) -> Iterator[Replayed]:
    """``Wal.replay`` from records one by one (the block WAL, whose records carry no
    record_crc: computed here): entries of one ledger at consecutive ids as runs, metadata
    records as they are. The file journal gathers its runs the same way inside its scan."""
    run: EntryRun | None = None
    for record in records:
        ledger_id, entry_id, payload = record
        if (
            run is not None
            and ledger_id == run.ledger_id
            and entry_id == run.first_entry_id + len(run.payloads)
            and len(run.payloads) < REPLAY_RUN_ENTRIES
        ):
            run.payloads.append(payload)
            run.crcs.append(record_crc(ledger_id, entry_id, payload))
            continue
        if run is not None:
            yield run, None
            run = None
        if entry_id >= 0:
            run = EntryRun(
                ledger_id, entry_id, [record_crc(ledger_id, entry_id, payload)], [payload]
            )
        else:
            yield record, None
    if run is not None:
        yield run, None


def record_crc(ledger_id: int, entry_id: int, payload: bytes | memoryview) -> int:
    """CRC32C over ``ledger id | entry id | payload``: the same value guards the record in
    the WAL and in the entry log, and it catches a record read from the wrong place."""
    return _crc32c(payload, _crc32c(_ID_PREFIX.pack(ledger_id, entry_id)))


def failure_of(error: BaseException | None) -> str | None:
    """``Wal.failure`` from the error that stopped the WAL."""
    return None if error is None else str(error) or type(error).__name__


class Wal(Protocol):
    def recover(self, mark: LogMark) -> Iterator[WalRecord]:
        """Every valid record from ``mark`` on, a batch's entries one by one (blocking;
        called once, before start)."""
        ...

    def replay(self, mark: LogMark) -> Iterator[Replayed]:
        """``recover``, but batches whole and each record with its CRC (see Replayed)."""
        ...

    async def start(self) -> None:
        """Open for appends (after recovery); runs the writer on the running event loop."""
        ...

    def append(
        self, ledger_id: int, entry_id: int, crc: int, payload: bytes
    ) -> asyncio.Future[LogMark]:
        """Queue a record; the future completes after the fsync that covers it."""
        ...

    def append_batch(
        self, ledger_id: int, first_entry_id: int, crcs: list[int], payloads: list[bytes]
    ) -> asyncio.Future[LogMark]:
        """Queue a batch's records at consecutive entry ids; the future completes after
        the fsync that covers the last of them (and so every one: writes land in order)."""
        ...

    def sync_point(self) -> asyncio.Future[LogMark]:
        """A future completing with a mark at or past every record appended so far."""
        ...

    def checkpoint_point(self) -> asyncio.Future[LogMark]:
        """The mark for a checkpoint that has just swapped its cache: ``sync_point()``, except
        that a WAL whose appends wait for space (a full ring) puts the mark before them (they
        are in the swapped cache; waiting for them would wait for this checkpoint's trim)."""
        ...

    def checkpoint_complete(self, mark: LogMark) -> None:
        """Everything before ``mark`` is in entry logs: persist the mark, trim (blocking)."""
        ...

    def last_mark(self) -> LogMark:
        """The persisted checkpoint mark (where replay starts)."""
        ...

    async def close(self) -> None:
        """Write what is queued, fsync, stop the writer."""
        ...

    @property
    def failure(self) -> str | None:
        """Why the WAL stopped taking appends for good (a failed write or fdatasync; only
        a restart recovers), or None."""
        ...
