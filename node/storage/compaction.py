"""Compaction of entry logs: copy the live entries of some logs into a new log, make it
durable, point the index at the copies, and only then delete the sources.

An entry is live when its ledger is alive and the index points at this very record (a
replay or an earlier compaction may have left stale copies elsewhere). Copies keep their
stored CRC, so compaction never launders a damaged payload; a live record that fails its
check stops the compaction of its log, which GC then reports as unreadable.

The protocol, in one place (``C`` the output log id, ``S`` the sources; files in the
ledgers dir). Recovery runs at the start of every GC run:

| step | files after it | a crash here leaves | recovery |
|---|---|---|---|
| 1 copy, seal, fsync | ``C.log.compacting`` | partial copy, index -> S | delete it |
| 2 marker ``C.compacted`` lists S | marker, ``.compacting`` | same | delete both |
| 3 rename to ``C.log`` | marker, ``C.log`` | copies, index -> S | steps 4-6 |
| 4 index -> C where still into S | same | index partly -> C | steps 4-6 |
| 5 retire S | same | some S left | steps 4-6 |
| 6 delete the marker | ``C.log`` | done | nothing |

Recovery of steps 4-6 scans C to rebuild the moves. The index update runs serialized
with checkpoints (``serialize``), like BookKeeper's flushMutex, so that a location
written by a checkpoint is never overwritten by a stale one.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from node.settings import Settings
from node.storage import entrylog, logformat
from node.storage.errors import CorruptRecord
from node.storage.faults import Faults
from node.storage.fsutil import fsync_dir, write_file_atomically
from node.storage.index import Index

log = logging.getLogger(__name__)

MARKER_SUFFIX = ".compacted"
MIN_SLEEP_S = 0.01  # the throttle's smallest sleep
WRITE_BATCH_BYTES = 1024 * 1024  # copies are gathered into writes of about this size
COPY_BATCH_RECORDS = 256  # records read before one index multi-get and throttle charge


class Throttle:
    """A token bucket over entries or bytes per second. Compaction charges reads as well as
    writes: scanning a mostly dead log is I/O too (BookKeeper counted only what it copied,
    and saturated disks reading). Counting entries, reads go to a bytes throttle of their
    own: at 1,000 entries/s, reading past the dead records of small entries took most of
    a run (17 minutes for a log of 1 GB of 1 KiB entries)."""

    def __init__(
        self,
        rate: float,
        by_bytes: bool,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._rate = rate
        self._by_bytes = by_bytes
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._available = 0.0
        self._last = clock()
        self.cancelled = False

    def acquire(self, entries: int, size_bytes: int) -> None:
        cost = float(size_bytes if self._by_bytes else entries)
        with self._lock:
            now = self._clock()
            # At most one second of burst, so a pause does not buy a flood afterwards.
            self._available = min(self._rate, self._available + (now - self._last) * self._rate)
            self._last = now
            self._available -= cost
            debt = -self._available
        # Sleep only once a few milliseconds of debt have built up: a sleep per record
        # (thousands a second) costs a tenth of a core for nothing.
        if debt > self._rate * MIN_SLEEP_S and not self.cancelled:
            self._sleep(debt / self._rate)


@dataclass(slots=True)
class CompactionResult:
    compacted: list[int] = field(default_factory=list)  # sources now retired
    output_logs: list[int] = field(default_factory=list)
    bytes_read: int = 0
    bytes_written: int = 0
    entries_copied: int = 0
    reclaimed_bytes: int = 0  # source bytes minus copied bytes
    failed: dict[int, str] = field(default_factory=dict)  # source -> why it was skipped


Progress = Callable[[int, int, int], None]  # (log being compacted, bytes done, bytes left)


class _Output:
    """The compaction log being written (``<id>.log.compacting``)."""

    def __init__(self, directory: Path, log_id: int) -> None:
        self.log_id = log_id
        self.path = directory / f"{log_id:x}{logformat.SUFFIX}{entrylog.COMPACTING_SUFFIX}"
        self.fd = entrylog.create_log(self.path)
        self.position = logformat.HEADER_SIZE
        self.ledger_sizes: dict[int, int] = {}
        self.sources: list[int] = []
        self.moves: list[tuple[int, int, int, int]] = []  # ledger, entry, old, new location
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._flushed_to = self.position

    def add(self, ledger_id: int, entry_id: int, crc: int, payload: bytes, old: int) -> int:
        record = logformat.encode_record(ledger_id, entry_id, crc, payload)
        new = logformat.location(self.log_id, self.position)
        self._pending.append(record)
        self._pending_bytes += len(record)
        self.position += len(record)
        self.ledger_sizes[ledger_id] = self.ledger_sizes.get(ledger_id, 0) + len(record)
        self.moves.append((ledger_id, entry_id, old, new))
        if self._pending_bytes >= WRITE_BATCH_BYTES:
            self.write_pending()
        return len(record)

    def write_pending(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            entrylog.write_fully(self.fd, data, self._flushed_to)
            self._flushed_to += len(data)
            self._pending, self._pending_bytes = [], 0

    def seal(self) -> None:
        self.write_pending()
        self.position = entrylog.seal(self.fd, self.position, self.ledger_sizes)
        os.fsync(self.fd)

    def discard(self) -> None:
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


class Compactor:
    def __init__(
        self,
        settings: Settings,
        index: Index,
        reader: entrylog.EntryLogReader,
        allocator: entrylog.LogIdAllocator,
        serialize: Callable[[Callable[[], int]], int],
        crash: Faults,
    ) -> None:
        self._dir = settings.ledgers_dir
        self._limit = settings.log_size_limit
        self._index = index
        self._reader = reader
        self._allocator = allocator
        self._serialize = serialize
        self._crash = crash
        self.in_progress: set[int] = set()  # output logs being written: not GC candidates

    # --- recovery --------------------------------------------------------------------------

    def recover(self) -> list[str]:
        """Finish or undo what a crash interrupted (the state table above)."""
        done = []
        for marker in sorted(self._dir.glob(f"*{MARKER_SUFFIX}")):
            output_id, sources = _read_marker(marker)
            if output_id is None:
                marker.unlink()  # unreadable: it can only be one from before step 3
                continue
            final = logformat.log_path(self._dir, output_id)
            if not final.exists():
                # Steps 1-2: the copy never became a log; the index still points at S.
                Path(f"{final}{entrylog.COMPACTING_SUFFIX}").unlink(missing_ok=True)
                marker.unlink()
                done.append(f"undid compaction into {marker.name}")
                continue
            copies = [
                (record.ledger_id, record.entry_id, record.offset)
                for record in entrylog.scan(final)
                if record.ledger_id >= 0 and record.crc_ok
            ]
            found = self._index.get_locations([(lid, eid) for lid, eid, _offset in copies])
            moves = [
                (lid, eid, old, logformat.location(output_id, offset))
                for (lid, eid, offset), old in zip(copies, found, strict=True)
                if old is not None and logformat.split_location(old)[0] in sources
            ]
            self._commit(output_id, sources, moves, marker)
            done.append(f"finished compaction of {sources} into {output_id:x}")
        for partial in self._dir.glob(f"*{logformat.SUFFIX}{entrylog.COMPACTING_SUFFIX}"):
            partial.unlink()  # step 1 without a marker: nothing points into it
            done.append(f"deleted partial compaction output {partial.name}")
        if done:
            fsync_dir(self._dir)
            for line in done:
                log.warning("compaction recovery: %s", line)
        return done

    # --- compaction ------------------------------------------------------------------------

    def compact(
        self,
        sources: list[tuple[int, int]],
        is_live_ledger: Callable[[int], bool],
        throttle: Throttle,
        progress: Progress | None = None,
        deadline: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        output_limit: int | None = None,
        reads: Throttle | None = None,
    ) -> CompactionResult:
        """Compact ``sources`` ((log id, estimated live bytes), emptiest first) into as few
        output logs as fit ``log_size_limit`` (or the smaller ``output_limit``: on a full
        disk, an output that fits the free space, whose sources go before the next one
        starts), until ``deadline`` (a ``clock`` time). The records read are charged to
        ``reads`` when given, else to ``throttle`` with the copies."""
        limit = min(self._limit, output_limit) if output_limit is not None else self._limit
        throttles = (reads or throttle, throttle)  # (reads, copies)
        result = CompactionResult()
        output: _Output | None = None
        try:
            for source, live_estimate in sources:
                if deadline is not None and clock() >= deadline:
                    break
                if throttle.cancelled:
                    break
                if output is not None and output.position + live_estimate > limit:
                    self._finish(output, result)
                    output = None
                if output is None:
                    output = _Output(self._dir, self._allocator.allocate())
                    self.in_progress.add(output.log_id)
                try:
                    self._copy(source, output, is_live_ledger, throttles, progress, result)
                except (CorruptRecord, OSError) as e:
                    result.failed[source] = str(e)
                    log.error("compaction skipped entry log %x: %s", source, e)
                    # Its copies so far stay in the output unindexed: dead weight for the
                    # next compaction, never dangling.
                    continue
                output.sources.append(source)
            if output is not None:
                self._finish(output, result)
                output = None
        finally:
            if output is not None:
                self.in_progress.discard(output.log_id)
                output.discard()
        return result

    def _copy(
        self,
        source: int,
        output: _Output,
        is_live_ledger: Callable[[int], bool],
        throttles: tuple[Throttle, Throttle],
        progress: Progress | None,
        result: CompactionResult,
    ) -> None:
        path = logformat.log_path(self._dir, source)
        total = path.stat().st_size
        for batch, size in _batches(entrylog.scan(path)):
            self._copy_batch(source, batch, size, output, is_live_ledger, throttles, result)
            if progress is not None:
                end = batch[-1].offset + logformat.RECORD_OVERHEAD + len(batch[-1].payload)
                progress(source, end, max(0, total - end))
        self._crash.hit("compaction.after_copy")

    def _copy_batch(
        self,
        source: int,
        batch: list[entrylog.ScannedRecord],
        size: int,
        output: _Output,
        is_live_ledger: Callable[[int], bool],
        throttles: tuple[Throttle, Throttle],
        result: CompactionResult,
    ) -> None:
        """Copy the live records of ``batch`` (``size`` bytes read) with one charge to each
        of the (reads, copies) throttles and one index multi-get for all of them: per
        record, each cost as much as the copy."""
        reads, copies = throttles
        result.bytes_read += size
        reads.acquire(len(batch), size)
        live = [r for r in batch if r.ledger_id >= 0 and is_live_ledger(r.ledger_id)]
        found = self._index.get_locations([(r.ledger_id, r.entry_id) for r in live])
        entries = written = 0
        for record, location in zip(live, found, strict=True):
            here = logformat.location(source, record.offset)
            if location != here:
                continue  # a stale copy: the index points elsewhere
            if not record.crc_ok:
                path = logformat.log_path(self._dir, source)
                raise CorruptRecord(str(path), record.offset, "a live entry fails its CRC")
            copy = output.add(record.ledger_id, record.entry_id, record.crc, record.payload, here)
            result.bytes_written += copy
            result.entries_copied += 1
            entries += 1
            written += copy
        copies.acquire(entries, written)

    def _finish(self, output: _Output, result: CompactionResult) -> None:
        if not output.moves:
            # Nothing live was found: no index entry points into the sources.
            self.in_progress.discard(output.log_id)
            output.discard()
            for source in output.sources:
                result.reclaimed_bytes += logformat.log_path(self._dir, source).stat().st_size
                self._reader.retire(source)
            result.compacted.extend(output.sources)
            return
        output.seal()
        os.close(output.fd)
        self._crash.hit("compaction.after_seal")
        marker = self._dir / f"{output.log_id:x}{MARKER_SUFFIX}"
        write_file_atomically(marker, json.dumps({"sources": output.sources}).encode())
        self._crash.hit("compaction.after_marker")
        os.replace(output.path, logformat.log_path(self._dir, output.log_id))
        fsync_dir(self._dir)
        self.in_progress.discard(output.log_id)
        self._crash.hit("compaction.after_rename")
        sizes = {s: logformat.log_path(self._dir, s).stat().st_size for s in output.sources}
        self._commit(output.log_id, set(output.sources), output.moves, marker)
        result.compacted.extend(output.sources)
        result.output_logs.append(output.log_id)
        result.reclaimed_bytes += max(0, sum(sizes.values()) - output.position)

    def _commit(
        self,
        output_id: int,
        sources: set[int] | list[int],
        moves: list[tuple[int, int, int, int]],
        marker: Path,
    ) -> None:
        """Steps 4-6: index, retire the sources, drop the marker."""
        self._serialize(lambda: self._index.relocate(moves))
        self._crash.hit("compaction.after_index")
        for source in sources:
            self._reader.retire(source)
        self._crash.hit("compaction.after_retire")
        marker.unlink(missing_ok=True)
        fsync_dir(self._dir)


def _batches(
    records: Iterable[entrylog.ScannedRecord],
) -> Iterator[tuple[list[entrylog.ScannedRecord], int]]:
    """``records`` in batches of COPY_BATCH_RECORDS or WRITE_BATCH_BYTES, with their size."""
    batch: list[entrylog.ScannedRecord] = []
    size = 0
    for record in records:
        batch.append(record)
        size += logformat.RECORD_OVERHEAD + len(record.payload)
        if len(batch) >= COPY_BATCH_RECORDS or size >= WRITE_BATCH_BYTES:
            yield batch, size
            batch, size = [], 0
    if batch:
        yield batch, size


def _read_marker(marker: Path) -> tuple[int | None, set[int]]:
    try:
        output_id = int(marker.name.removesuffix(MARKER_SUFFIX), 16)
        sources = {int(s) for s in json.loads(marker.read_bytes())["sources"]}
    except (ValueError, KeyError, TypeError):
        return None, set()  # a marker torn before its atomic rename cannot exist; be safe
    return output_id, sources
