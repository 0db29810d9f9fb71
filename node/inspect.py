"""``python -m node inspect journal|entrylog|index|wal PATH [--records]``: print and check files.

- ``journal`` (a ``.txn`` file): the header, then every record with its CRC checked, stopping
  at the end of data or at the first invalid record. For an invalid record it tells, in the
  engine's terms, a torn tail (no later group write: replay cuts
  the newest journal there) from corruption (valid records follow: replay refuses to start).
- ``entrylog`` (a ``.log`` file): the header, the ledgers map (or, for a log without one,
  the map GC kept beside it) checked against a scan of the records, per-ledger counts and
  bytes, and every record whose CRC is bad.
- ``index`` (the RocksDB directory, e.g. ``data/index``): ledger metadata, locations per
  ledger and, when the entry logs are in the sibling ``../ledgers``, that every location
  holds its entry with a valid CRC. The database is opened read-only (RocksDB's
  ``OpenForReadOnly``, which takes no lock and replays the live WAL in memory only), so this
  runs beside a live node; it sees what the node had written when it was opened.
- ``wal`` (the raw-device WAL's block device or file): both header slots and which one wins,
  the trim offset, then a scan exactly as recovery does it: the records it would recover
  (count, bytes, per ledger), holes, where valid data ends, and the offset where the node
  would write next. Read with O_DIRECT, read-only. After a graceful shutdown whose header
  gives the end of the records, any invalid data before that end (a hole, a torn or
  damaged record) is corruption (the node refuses to start on it).

Exit code: 0 when everything checks out (last line ``OK``), 1 when a check fails (last line
``FAILED: <what>``), 2 when the path is not of the named kind (or cannot be read).

A progress bar (stderr) is shown for files larger than ``PROGRESS_MIN_BYTES``, by bytes
scanned; for the index, when the index directory is that large, by locations checked.

Every layout comes from the engine's modules (``journal``, ``entrylog``, ``index``, ``wal``):
nothing here re-defines a format.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from rocksdict import AccessType, Options, Rdict
from tqdm import tqdm

from node.settings import MiB, Settings
from node.storage import entrylog, journalformat, logformat, ringformat, ringscan
from node.storage.directio import open_raw
from node.storage.errors import CorruptRecord
from node.storage.index import (
    LEDGER_KEY,
    LedgerMeta,
    LedgerState,
    expand_runs,
)
from node.storage.wal import (
    BATCH,
    CLOSE,
    DELETE,
    EXPLICIT_LAC,
    FENCE,
    LEDGER_CREATED,
    BatchRecord,
    LogMark,
    record_crc,
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_WRONG_KIND = 2

PROGRESS_MIN_BYTES = 64 * MiB  # files above this get a progress bar
MAX_LISTED = 20  # bad records listed one by one before "... and N more"
MAX_EXAMPLES = 5  # dangling or wrong locations shown by value
MAX_OPEN_LOGS = 64  # entry log handles kept open while checking locations
ZERO_CHECK_CHUNK = 1 * MiB  # read size when checking that a tail is all zeros

# The engine looks for valid groups at multiples of journal_alignment_size after an invalid
# record; inspect has no settings of a node, so it uses the default (512, one sector).
JOURNAL_ALIGNMENT = int(Settings.model_fields["journal_alignment_size"].default)

KIND_NAMES = {
    LEDGER_CREATED: "LEDGER_CREATED",
    FENCE: "FENCE",
    CLOSE: "CLOSE",
    DELETE: "DELETE",
    EXPLICIT_LAC: "EXPLICIT_LAC",
}

INDEX_LOCATIONS_CF = "locations"
INDEX_LEDGERS_CF = "ledgers"
INDEX_CURRENT_FILE = "CURRENT"  # every RocksDB directory has it
ENTRY_LOGS_SIBLING = "ledgers"  # data/index -> data/ledgers


class NotThisKind(Exception):
    """The path is not a file of the kind asked for (exit code 2)."""


class _Report:
    """Lines to stdout, failures collected for the final ``OK`` / ``FAILED`` line."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    @staticmethod
    def line(text: str = "") -> None:
        print(text)

    def fail(self, what: str) -> None:
        self.failures.append(what)

    def finish(self) -> int:
        if self.failures:
            print(f"FAILED: {'; '.join(self.failures)}")
            return EXIT_FAILED
        print("OK")
        return EXIT_OK


def _progress(total: int, show: bool, unit: str = "B") -> Any:
    """A tqdm bar on stderr, or a disabled one (a no-op) when ``show`` is false."""
    return tqdm(
        total=total,
        unit=unit,
        unit_scale=unit == "B",
        file=sys.stderr,
        disable=not show,
        leave=False,
    )


def _listed(values: list[int]) -> str:
    shown = ", ".join(str(v) for v in values[:MAX_LISTED])
    more = len(values) - MAX_LISTED
    return f"{shown} ... and {more} more" if more > 0 else shown


def _kind_name(entry_id: int) -> str:
    return KIND_NAMES.get(entry_id, f"kind {entry_id}")


# --- journal -------------------------------------------------------------------------------


@dataclass(slots=True)
class _LedgerFigures:
    entries: int = 0
    payload_bytes: int = 0
    record_bytes: int = 0
    kinds: Counter[str] = field(default_factory=Counter)  # metadata records by kind


def _journal_record_line(mm: mmap.mmap, found: journalformat.ScannedRecord) -> str:
    pos, end, ledger_id, entry_id = found[:4]
    length = end - pos - journalformat.RECORD_HEADER.size
    if entry_id == journalformat.PADDING_ENTRY_ID:
        return f"offset {pos} padding len {end - pos - journalformat.PADDING_HEADER.size}"
    if entry_id >= 0:
        what = f"entry {entry_id}"
    elif entry_id == BATCH:
        batch = _decode_batch(mm, found)
        if isinstance(batch, str):
            what = f"batch INVALID: {batch};"
        else:
            last = batch.first_entry_id + len(batch.payloads) - 1
            what = f"batch of {len(batch.payloads)} entries {batch.first_entry_id}..{last}"
    elif entry_id == journalformat.GROUP_START_ENTRY_ID:
        what = "group start"
    else:
        what = _kind_name(entry_id)
    return f"offset {pos} ledger {ledger_id} {what} len {length} crc ok"


def _decode_batch(mm: mmap.mmap, found: journalformat.ScannedRecord) -> BatchRecord | str:
    pos, end, ledger_id = found[:3]
    return journalformat.decode_batch(mm, pos + journalformat.RECORD_HEADER.size, end, ledger_id)


def _last_mark(report: _Report, path: Path) -> LogMark | None:
    """lastMark, printed, when the journal sits in a data dir (data/journal next to
    data/ledgers); None when there is none."""
    ledgers_dir = path.parent.parent / ENTRY_LOGS_SIBLING
    if not (ledgers_dir / journalformat.LAST_MARK_FILE).is_file():
        return None
    try:
        mark = journalformat.read_last_mark(ledgers_dir)
    except CorruptRecord as e:
        report.line(f"lastMark: unreadable ({e})")
        return None
    report.line(f"lastMark: journal {mark.log_id:x} offset {mark.offset}")
    return mark


def inspect_journal(path: Path, records: bool) -> int:
    report = _Report()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < journalformat.HEADER_SIZE:
            raise NotThisKind(f"{path}: {size} bytes, shorter than a journal header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                version = journalformat.decode_header(mm[: journalformat.HEADER_SIZE])
            except ValueError as e:
                raise NotThisKind(f"{path}: not a journal: {e}") from None
            report.line(f"journal {path}")
            report.line(f"header: magic {journalformat.MAGIC.decode()}, version {version}")
            report.line(f"file size: {size}")
            mark = _last_mark(report, path)
            _scan_journal(report, path, mm, size, records, mark)
    return report.finish()


def _scan_journal(
    report: _Report, path: Path, mm: mmap.mmap, size: int, records: bool, mark: LogMark | None
) -> None:
    data_records = 0
    padding_records = 0
    group_writes = 0
    batch_records = 0  # (their entries count as data records)
    payload_bytes = 0
    kinds: Counter[str] = Counter()
    ledgers: dict[int, _LedgerFigures] = {}
    invalid: tuple[int, str] | None = None
    # No node settings here: any record that fits in the file is checked by its CRC.
    max_length = size
    if records:
        report.line("records:")
    with _progress(size, size > PROGRESS_MIN_BYTES) as bar, memoryview(mm) as view:
        bar.update(journalformat.HEADER_SIZE)
        scan = journalformat.RecordScan(mm, journalformat.HEADER_SIZE, size, max_length, view)
        for found in scan:
            at, end, ledger_id, entry_id, _crc, payload = found
            if records:
                report.line(f"  {_journal_record_line(mm, found)}")
            bar.update(end - at)
            if entry_id == journalformat.PADDING_ENTRY_ID:
                padding_records += 1
                continue
            if entry_id == journalformat.GROUP_START_ENTRY_ID:
                group_writes += 1
                continue
            figures = ledgers.setdefault(ledger_id, _LedgerFigures())
            if entry_id == BATCH:
                batch = _decode_batch(mm, found)
                if isinstance(batch, str):
                    invalid = (at, batch)
                    break
                batch_records += 1
                entries = batch.payloads
            elif entry_id >= 0:
                entries = [payload]
            else:
                kinds[_kind_name(entry_id)] += 1
                figures.kinds[_kind_name(entry_id)] += 1
                continue
            entry_bytes = sum(map(len, entries))
            data_records += len(entries)
            payload_bytes += entry_bytes
            figures.entries += len(entries)
            figures.payload_bytes += entry_bytes
        if invalid is None and scan.invalid is not None:
            if records:
                report.line(f"  offset {scan.end} INVALID: {scan.invalid}")
            invalid = (scan.end, scan.invalid)
        if invalid is None:  # replay stops at the end of data: is anything written after it?
            verdict = None
            later = journalformat.find_later_write(
                mm, scan.end, size, JOURNAL_ALIGNMENT, max_length
            )
        else:
            verdict = journalformat.judge_invalid(
                mm, *invalid, size, _is_newest_journal(path), JOURNAL_ALIGNMENT, max_length
            )
        bar.update(size - bar.n)

    report.line("summary:")
    report.line(f"  data records: {data_records}")
    report.line(f"  batch records: {batch_records}")
    names = [*KIND_NAMES.values(), *sorted(k for k in kinds if k not in KIND_NAMES.values())]
    report.line(f"  metadata records: {sum(kinds.values())}")
    for name in names:
        report.line(f"    {name}: {kinds[name]}")
    report.line(f"  group writes: {group_writes}")
    report.line(f"  padding records: {padding_records}")
    report.line(f"  ledgers seen: {len(ledgers)}")
    for ledger_id in sorted(ledgers):
        figures = ledgers[ledger_id]
        listed = (name if n == 1 else f"{name} x{n}" for name, n in figures.kinds.items())
        meta = f", metadata {' '.join(listed)}" if figures.kinds else ""
        report.line(
            f"    ledger {ledger_id}: {figures.entries} entries, "
            f"{figures.payload_bytes} payload bytes{meta}"
        )
    report.line(f"  payload bytes: {payload_bytes}")

    if verdict is None:
        pos = scan.end
        report.line(f"  end of data: offset {pos}")
        if later is not None:
            report.line(
                f"a group write at offset {later} after the end of data at {pos}: "
                "replay stops at the end of data and will not see it"
            )
            report.fail(f"valid records after the end of data at offset {pos} (at {later})")
        return
    offset, reason = verdict.offset, verdict.reason
    report.line(f"  end of valid data: offset {offset}")
    report.line(f"invalid record at offset {offset}: {reason}")
    journal_id = _journal_id(path)
    checkpointed = mark is not None and journal_id is not None and (journal_id, offset) < mark
    if verdict.later is not None:
        report.line(
            f"a group write at offset {verdict.later} after it: corruption, not a torn tail"
        )
        what = f"corrupt journal record at offset {offset} ({reason}), valid data after it"
    elif verdict.torn:
        report.line("no group write after it: a torn tail")
        what = f"torn tail at offset {offset} ({reason})"
    else:
        report.line("no group write after it, but a newer journal exists")
        what = f"invalid journal record at offset {offset} ({reason}) in an older journal"
    if checkpointed:
        report.line(
            "it lies before lastMark: replay starts after it (its data, if it was an entry, "
            "is in the entry logs since that checkpoint)"
        )
    elif verdict.later is not None:
        report.line(
            "replay refuses to start unless skip_replay_journal_invalid_record=true, "
            "which skips to the valid record and loses what lies between"
        )
    elif verdict.torn:
        report.line("replay cuts this newest journal here (nothing after it was acknowledged)")
    else:
        report.line("replay refuses to start (a torn tail is only expected in the newest journal)")
    report.fail(what)


def _journal_id(path: Path) -> int | None:
    """The id in a journal's name (``<id in hex>.txn``), or None for another name."""
    try:
        return int(path.stem, 16)
    except ValueError:
        return None


def _is_newest_journal(path: Path) -> bool:
    journal_id = _journal_id(path)
    if journal_id is None:
        return True  # not named like a journal: cannot tell, assume it stands alone
    ids = journalformat.list_journals(path.parent)
    return not ids or journal_id >= ids[-1]


# --- entry log -----------------------------------------------------------------------------


def _read_entrylog_header(path: Path) -> tuple[int, int, int, int]:
    """(version, map offset, map count, file size); NotThisKind for another kind of file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(logformat.HEADER_SIZE)
    if len(head) < logformat.HEADER_SIZE:
        raise NotThisKind(f"{path}: {len(head)} bytes, shorter than an entry log header")
    try:
        version, map_offset, map_count = logformat.decode_header(head)
    except ValueError as e:
        raise NotThisKind(f"{path}: not an entry log: {e}") from None
    return version, map_offset, map_count, size


def _nonzero_from(path: Path, start: int, size: int) -> int | None:
    """The offset of the first non-zero byte in ``[start, size)``, or None."""
    with open(path, "rb") as f:
        f.seek(start)
        pos = start
        while pos < size:
            chunk = f.read(min(ZERO_CHECK_CHUNK, size - pos))
            if not chunk:
                return None
            stripped = chunk.lstrip(b"\0")
            if stripped:
                return pos + len(chunk) - len(stripped)
            pos += len(chunk)
    return None


def inspect_entrylog(path: Path, records: bool) -> int:
    report = _Report()
    version, map_offset, map_count, size = _read_entrylog_header(path)
    report.line(f"entry log {path}")
    report.line(
        f"header: magic {logformat.MAGIC.decode()}, version {version}, "
        f"ledgers map offset {map_offset}, count {map_count}"
    )
    report.line(f"file size: {size}")

    ledgers: dict[int, _LedgerFigures] = {}
    bad_crc: list[int] = []
    map_records: list[entrylog.ScannedRecord] = []
    total = 0
    end = logformat.HEADER_SIZE
    if records:
        report.line("records:")
    with _progress(size, size > PROGRESS_MIN_BYTES) as bar:
        bar.update(end)
        try:
            for record in entrylog.scan(path):
                length = len(record.payload)
                record_end = record.offset + logformat.RECORD_OVERHEAD + length
                bar.update(record_end - end)
                end = record_end
                total += 1
                crc = "ok" if record.crc_ok else "BAD"
                if not record.crc_ok:
                    bad_crc.append(record.offset)
                if record.ledger_id == logformat.LEDGERS_MAP_LEDGER_ID:
                    map_records.append(record)
                    what = "ledgers-map"
                else:
                    figures = ledgers.setdefault(record.ledger_id, _LedgerFigures())
                    figures.entries += 1
                    figures.payload_bytes += length
                    figures.record_bytes += logformat.RECORD_OVERHEAD + length
                    what = f"ledger {record.ledger_id} entry {record.entry_id}"
                if records:
                    report.line(f"  offset {record.offset} {what} len {length} crc {crc}")
        except CorruptRecord as e:  # the header changed under us
            raise NotThisKind(str(e)) from None

    report.line("summary:")
    report.line(
        f"  records: {total} ({total - len(map_records)} entries, {len(map_records)} ledgers-map)"
    )
    report.line(f"  ledgers: {len(ledgers)}")
    for ledger_id in sorted(ledgers):
        figures = ledgers[ledger_id]
        report.line(
            f"    ledger {ledger_id}: {figures.entries} entries, {figures.payload_bytes} "
            f"payload bytes, {figures.record_bytes} bytes"
        )
    report.line(f"  end of data: offset {end}")
    report.line(f"  bad CRC records: {len(bad_crc)}")
    if bad_crc:
        report.line(f"    at offsets: {_listed(bad_crc)}")
        report.fail(f"{len(bad_crc)} records with a bad CRC at offsets {_listed(bad_crc)}")

    garbage = _nonzero_from(path, end, size)
    if garbage is not None:
        report.line(
            f"data that is not a record from offset {end} (non-zero at {garbage}) to {size}: "
            "the scan stops there, records after it are invisible"
        )
        report.fail(f"unreadable data at offset {end}")

    scanned = {lid: figures.record_bytes for lid, figures in ledgers.items()}
    if map_offset == 0 and not map_records:
        report.line("ledgers map: none (the current log, or a crash before its roll)")
        _check_kept_map(report, path, size, scanned)
    else:
        _check_ledgers_map(report, map_offset, map_count, map_records, scanned)
    return report.finish()


def _check_kept_map(report: _Report, path: Path, size: int, scanned: dict[int, int]) -> None:
    """The map GC kept beside a log without one: it is what GC acts on after a restart."""
    kept_path = logformat.map_file_path(path)
    try:
        data = kept_path.read_bytes()
    except FileNotFoundError:
        report.line(f"kept map {kept_path.name}: none (GC reads this log once it is sealed)")
        return
    kept = logformat.decode_map_file(data, size)
    if kept is None:
        report.line(
            f"kept map {kept_path.name}: does not hold for this log (another size, version or "
            "a bad record): GC ignores it and reads the log again"
        )
        return
    report.line(f"kept map {kept_path.name}: {len(kept)} ledgers")
    _compare_maps(report, "kept map", kept, scanned)


def _check_ledgers_map(
    report: _Report,
    map_offset: int,
    map_count: int,
    map_records: list[entrylog.ScannedRecord],
    scanned: dict[int, int],
) -> None:
    if map_offset == 0:
        report.line(
            f"ledgers map: records at offset {map_records[0].offset} but the header was "
            "not patched (a crash during the roll): readers scan this log"
        )
    elif not map_records or map_records[0].offset != map_offset:
        found = f"at {map_records[0].offset}" if map_records else "none"
        report.line(f"ledgers map: header names offset {map_offset}, records found: {found}")
        report.fail(f"ledgers map not at the offset {map_offset} named by the header")
        return
    ledgers_map: dict[int, int] = {}
    for record in map_records:
        try:
            ledgers_map.update(logformat.decode_ledgers_map(record.payload))
        except (ValueError, IndexError) as e:
            report.line(f"ledgers map record at offset {record.offset}: undecodable ({e})")
            report.fail(f"undecodable ledgers map record at offset {record.offset}")
            return
    report.line(f"ledgers map: {len(ledgers_map)} ledgers in {len(map_records)} records")
    for ledger_id in sorted(ledgers_map):
        report.line(f"    ledger {ledger_id}: {ledgers_map[ledger_id]} bytes")
    if map_offset != 0 and len(ledgers_map) != map_count:
        report.fail(f"ledgers map holds {len(ledgers_map)} ledgers, header says {map_count}")
    _compare_maps(report, "ledgers map", ledgers_map, scanned)


def _compare_maps(
    report: _Report, name: str, ledgers_map: dict[int, int], scanned: dict[int, int]
) -> None:
    differ = sorted(
        lid
        for lid in ledgers_map.keys() | scanned.keys()
        if ledgers_map.get(lid) != scanned.get(lid)
    )
    if differ:
        for lid in differ[:MAX_EXAMPLES]:
            report.line(
                f"    ledger {lid}: {name} says {ledgers_map.get(lid, 0)} bytes, "
                f"scan finds {scanned.get(lid, 0)}"
            )
        report.fail(f"{name} disagrees with the scan for {len(differ)} ledgers")
    else:
        report.line(f"{name} matches the scan")


# --- index ---------------------------------------------------------------------------------


def _open_index(path: Path) -> Rdict:
    """The index, read-only: RocksDB's read-only mode takes no lock (it runs beside a live
    node) and replays the WAL into memory without touching the files."""
    if not (path / INDEX_CURRENT_FILE).is_file():
        raise NotThisKind(f"{path}: not a RocksDB directory (no {INDEX_CURRENT_FILE})")
    try:
        families = Rdict.list_cf(str(path), Options(raw_mode=True))
    except Exception as e:  # rocksdict raises plain Exception
        raise NotThisKind(f"{path}: not a readable RocksDB: {e}") from None
    missing = {INDEX_LOCATIONS_CF, INDEX_LEDGERS_CF} - set(families)
    if missing:
        raise NotThisKind(f"{path}: not a node index (no column family {sorted(missing)})")
    return Rdict(
        str(path),
        Options(raw_mode=True),
        column_families={name: Options(raw_mode=True) for name in families},
        access_type=AccessType.read_only(error_if_log_file_exist=False),
    )


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


class _LogFiles:
    """Open entry logs by id, a bounded number at a time."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._open: OrderedDict[int, tuple[int, int] | None] = OrderedDict()  # fd, size

    def get(self, log_id: int) -> tuple[int, int] | None:
        """(fd, size) of the log, or None when the file does not exist."""
        if log_id in self._open:
            self._open.move_to_end(log_id)
            return self._open[log_id]
        try:
            fd = os.open(logformat.log_path(self._dir, log_id), os.O_RDONLY)
        except FileNotFoundError:
            handle = None
        else:
            handle = (fd, os.fstat(fd).st_size)
        self._open[log_id] = handle
        while len(self._open) > MAX_OPEN_LOGS:
            _, old = self._open.popitem(last=False)
            if old is not None:
                os.close(old[0])
        return handle

    def close(self) -> None:
        for handle in self._open.values():
            if handle is not None:
                os.close(handle[0])
        self._open.clear()


def _check_location(logs: _LogFiles, ledger_id: int, entry_id: int, loc: int) -> tuple[str, str]:
    """(verdict, detail): verdict "ok", "dangling" (no such log or offset), "wrong" (another
    record there) or "crc" (the record is there, its CRC is not)."""
    log_id, offset = logformat.split_location(loc)
    handle = logs.get(log_id)
    if handle is None:
        return "dangling", f"log {log_id:x}{logformat.SUFFIX} does not exist"
    fd, size = handle
    if offset < logformat.HEADER_SIZE or offset + logformat.RECORD_OVERHEAD > size:
        return "dangling", f"offset {offset} is outside the records of a {size}-byte log"
    head = os.pread(fd, logformat.RECORD_OVERHEAD, offset)
    length, lid, eid, crc = logformat.decode_record_header(head)
    if (lid, eid) != (ledger_id, entry_id):
        return "wrong", f"holds ledger {lid} entry {eid}"
    start = offset + logformat.RECORD_OVERHEAD
    if length < 0 or start + length > size:
        return "wrong", f"record length {length} does not fit in the log"
    payload = os.pread(fd, length, start)
    if record_crc(ledger_id, entry_id, payload) != crc:
        return "crc", "CRC32C mismatch"
    return "ok", ""


def _format_meta(meta: LedgerMeta) -> str:
    props = f" properties {meta.properties}" if meta.properties else ""
    token = " token yes" if meta.token_digest else ""
    return (
        f"state {meta.state.name} lac {meta.lac} last entry {meta.last_entry_id} "
        f"entries {meta.entries} bytes {meta.payload_bytes} created {meta.created_ms} "
        f"closed {meta.closed_ms}{token}{props}"
    )


def _iter_locations(db: Rdict) -> Iterator[tuple[int, int, int]]:
    return expand_runs(db.get_column_family(INDEX_LOCATIONS_CF))


def inspect_index(path: Path, records: bool) -> int:
    if not path.is_dir():
        raise NotThisKind(f"{path}: not a directory (the index is a RocksDB directory)")
    db = _open_index(path)
    try:
        return _inspect_open_index(db, path, records)
    finally:
        db.close()


def _inspect_open_index(db: Rdict, path: Path, records: bool) -> int:
    report = _Report()
    report.line(f"index {path} (opened read-only)")
    metas: dict[int, LedgerMeta] = {}
    for key, value in db.get_column_family(INDEX_LEDGERS_CF).items():
        (ledger_id,) = LEDGER_KEY.unpack(cast(bytes, key))
        try:
            metas[ledger_id] = LedgerMeta.decode(ledger_id, cast(bytes, value))
        except (ValueError, IndexError) as e:
            report.line(f"ledger {ledger_id}: undecodable metadata ({e})")
            report.fail(f"undecodable metadata of ledger {ledger_id}")
    report.line(f"ledgers: {len(metas)}")
    for ledger_id in sorted(metas):
        report.line(f"  ledger {ledger_id}: {_format_meta(metas[ledger_id])}")

    logs_dir = path.resolve().parent / ENTRY_LOGS_SIBLING
    check = logs_dir.is_dir()
    if not check:
        report.line(f"no entry log directory at {logs_dir}: locations not checked")
    logs = _LogFiles(logs_dir)
    counts: Counter[int] = Counter()
    verdicts: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}
    unchecked_deleted = 0
    estimate = db.get_column_family(INDEX_LOCATIONS_CF).property_int_value(
        "rocksdb.estimate-num-keys"
    )
    if records:
        report.line("locations:")
    show = _dir_size(path) > PROGRESS_MIN_BYTES
    try:
        with _progress(int(estimate or 0), show, unit="loc") as bar:
            for ledger_id, entry_id, loc in _iter_locations(db):
                bar.update(1)
                counts[ledger_id] += 1
                log_id, offset = logformat.split_location(loc)
                meta = metas.get(ledger_id)
                if not check:
                    verdict, detail = "unchecked", ""
                elif meta is not None and meta.state == LedgerState.DELETED:
                    verdict, detail = "unchecked", "ledger deleted"
                    unchecked_deleted += 1
                else:
                    verdict, detail = _check_location(logs, ledger_id, entry_id, loc)
                verdicts[verdict] += 1
                value = (
                    f"ledger {ledger_id} entry {entry_id} location {loc:#x} "
                    f"(log {log_id:x} offset {offset})"
                )
                if verdict in ("dangling", "wrong", "crc"):
                    found = examples.setdefault(verdict, [])
                    if len(found) < MAX_EXAMPLES:
                        found.append(f"{value}: {detail}")
                if records:
                    report.line(f"  {value} {verdict}{': ' + detail if detail else ''}")
    finally:
        logs.close()

    report.line(f"locations: {sum(counts.values())}")
    for ledger_id in sorted(counts):
        report.line(f"  ledger {ledger_id}: {counts[ledger_id]} locations")
    unknown = sorted(set(counts) - set(metas))
    if unknown:
        report.line(f"locations of ledgers without metadata: {_listed(unknown)}")
        report.fail(f"locations of {len(unknown)} ledgers without metadata")
    if unchecked_deleted:
        report.line(f"not checked: {unchecked_deleted} locations of deleted ledgers")
    if check:
        report.line(
            f"checked against {logs_dir}: {verdicts['ok']} ok, {verdicts['dangling']} "
            f"dangling, {verdicts['wrong']} wrong, {verdicts['crc']} bad CRC"
        )
        for verdict, label in (
            ("dangling", "dangling locations"),
            ("wrong", "wrong locations"),
            ("crc", "locations with a bad CRC"),
        ):
            if verdicts[verdict]:
                report.line(f"{label}: {verdicts[verdict]}, first ones:")
                for example in examples[verdict]:
                    report.line(f"  {example}")
                report.fail(f"{verdicts[verdict]} {label}")
    return report.finish()


# --- raw-device WAL ------------------------------------------------------------------------


def _header_line(header: ringformat.WalHeader) -> str:
    return (
        f"sequence {header.sequence}, capacity {header.capacity}, trim {header.trim}, "
        f"window {header.window}, shutdown {header.shutdown.name.lower()}, "
        f"end {header.end or 'unknown'}, node id {header.node_id}, "
        f"written at {header.written_ms} ms"
    )


def _wal_event_line(event: ringscan.ScanEvent) -> str:
    if event.kind is ringscan.ScanKind.PADDING:
        return f"offset {event.offset} padding to the end of the ring ({event.length} bytes)"
    if event.record is None:
        return f"offset {event.offset} INVALID: {event.reason}"
    record = event.record
    what = f"entry {record.entry_id}" if record.entry_id >= 0 else _kind_name(record.entry_id)
    return (
        f"offset {event.offset} ledger {record.ledger_id} {what} len {len(record.payload)} crc ok"
    )


def inspect_wal(path: Path, records: bool) -> int:
    raw = open_raw(path, writable=False)
    try:
        if raw.size < ringformat.HEADER_AREA:
            raise NotThisKind(f"{path}: {raw.size} bytes, shorter than the WAL header area")
        reader = ringscan.RingReader(raw, raw.size)
        try:
            return _inspect_open_wal(raw.size, reader, path, raw.block_device, records)
        finally:
            reader.close()
    finally:
        raw.close()


def _inspect_open_wal(
    size: int, reader: ringscan.RingReader, path: Path, device: bool, records: bool
) -> int:
    report = _Report()
    states = ringscan.read_slots(reader)
    if not any(state.has_magic for state in states):
        raise NotThisKind(f"{path}: no WAL header in either slot")
    report.line(f"raw-device WAL {path} ({'block device' if device else 'file'}, {size} bytes)")
    for state in states:
        shown = _header_line(state.header) if state.header else f"INVALID ({state.problem})"
        report.line(f"header slot {state.slot}: {shown}")
    winner = ringscan.winning_slot(states)
    if winner is None or winner.header is None:
        report.fail("both header slots are invalid: the trim offset is lost")
        return report.finish()
    header = winner.header
    report.line(f"winner: slot {winner.slot} (sequence {header.sequence})")
    if header.capacity > size:
        report.fail(f"the header's capacity {header.capacity} exceeds the {size}-byte medium")
        return report.finish()
    area = header.capacity - ringformat.HEADER_AREA
    physical = ringformat.HEADER_AREA + header.trim % area
    report.line(f"trim offset: {header.trim} (lap {header.trim // area}, physical {physical})")

    stop = ringscan.scan_stop(header)
    scan = ringscan.RingScan(reader.read, header.capacity, header.trim, header.window, stop)
    ledgers: dict[int, _LedgerFigures] = {}
    kinds: Counter[str] = Counter()
    record_bytes = 0
    if records:
        report.line("records:")
    quiet = 0  # invalid block boundaries in a row after the first one (not listed)
    with _progress(area, area > PROGRESS_MIN_BYTES) as bar:
        for event in scan:
            bar.update(max(0, event.offset + event.length - header.trim - bar.n))
            invalid = event.kind in (ringscan.ScanKind.INVALID, ringscan.ScanKind.TORN)
            if records and invalid and quiet:
                quiet += 1
                continue
            if records and quiet > 1:
                report.line(f"  ... and {quiet - 1} more block boundaries without a record")
            quiet = 1 if invalid else 0
            if records:
                report.line(f"  {_wal_event_line(event)}")
            if event.record is None:
                continue
            record_bytes += event.length
            figures = ledgers.setdefault(event.record.ledger_id, _LedgerFigures())
            if event.record.entry_id >= 0:
                figures.entries += 1
                figures.payload_bytes += len(event.record.payload)
            else:
                kinds[_kind_name(event.record.entry_id)] += 1
                figures.kinds[_kind_name(event.record.entry_id)] += 1

    if records and quiet > 1:
        report.line(f"  ... and {quiet - 1} more block boundaries without a record")
    report.line("summary:")
    metadata = sum(kinds.values())
    report.line(
        f"  records: {scan.records} ({scan.records - metadata} entries, {metadata} metadata)"
    )
    for name, count in sorted(kinds.items()):
        report.line(f"    {name}: {count}")
    report.line(f"  ledgers seen: {len(ledgers)}")
    for ledger_id in sorted(ledgers):
        figures = ledgers[ledger_id]
        report.line(
            f"    ledger {ledger_id}: {figures.entries} entries, "
            f"{figures.payload_bytes} payload bytes"
        )
    report.line(f"  payload bytes: {scan.payload_bytes}")
    report.line(f"  record bytes: {record_bytes} (record headers included)")
    report.line(f"  padding records: {scan.paddings}")
    report.line(f"  end of valid data: offset {scan.end} ({scan.end_reason} there)")
    report.line(f"  holes: {len(scan.holes)}")
    for hole in scan.holes[:MAX_LISTED]:
        report.line(
            f"    hole at offset {hole.offset} ({hole.reason}), records again from "
            f"{hole.next_valid}"
        )
    if stop is not None:
        report.line(f"  invalid data before the end: {len(scan.damage)}")
        for damage in scan.damage[:MAX_LISTED]:
            report.line(f"    offset {damage.offset}: {damage.reason}")
    report.line(f"next offset: {ringscan.restart_offset(header)} (where the node writes next)")
    if scan.damage:
        report.fail(
            f"invalid data at offset {scan.damage[0].offset} ({scan.damage[0].reason}) before "
            f"offset {stop}, where the records end after a graceful shutdown: corruption (the "
            "node refuses to start)"
        )
    elif scan.holes:
        report.line("holes: blocks in flight at a crash")
    return report.finish()


# --- entry point ---------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    path = Path(args.path)
    inspectors = {
        "journal": inspect_journal,
        "entrylog": inspect_entrylog,
        "index": inspect_index,
        "wal": inspect_wal,
    }
    try:
        return inspectors[args.kind](path, bool(args.records))
    except NotThisKind as e:
        print(f"inspect {args.kind}: {e}", file=sys.stderr)
        return EXIT_WRONG_KIND
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        print(f"cannot read {path}: {e}", file=sys.stderr)
        return EXIT_WRONG_KIND
    except BrokenPipeError:
        # The reader went away (``| head``): the checks did not finish, so no verdict.
        # Point stdout at /dev/null so that the interpreter's final flush stays quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_FAILED
