"""``python -m node inspect``: real files written by the engine, read back by the command run
as a subprocess; then the same files with one flipped byte."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from node.settings import KiB, MiB, Settings, load
from node.storage import entrylog, journal, journalformat, logformat
from node.storage.ledgers import LedgerStorage
from node.storage.wal import LogMark
from tests.harness.files import flip_byte
from tests.lifecycle.gc_world import cut_ledgers_map

LOG_SIZE_LIMIT = 64 * KiB  # small: several entry logs, each sealed with its ledgers map
MAX_ENTRY_SIZE = 16 * KiB  # at most half of the log size limit
PRE_ALLOC = 1 * MiB
# Ledger index -> (entries, payload size of the first one; each next one is a byte longer).
LEDGERS = [(40, 1000), (55, 700), (30, 1500)]
DELETED_ENTRIES = 5  # entries of a ledger created, checkpointed, then deleted
LAC = 7  # explicit LAC set on the last live ledger
BATCHED = 1  # the ledger of LEDGERS whose entries are added as one batch
EXIT_OK, EXIT_FAILED, EXIT_WRONG_KIND = 0, 1, 2
BIG_FILE = 65 * MiB  # just past inspect's progress-bar threshold (64 MiB)


@dataclass(frozen=True)
class Data:
    data_dir: Path
    ledger_ids: list[int]  # live ledgers, in LEDGERS order
    deleted_id: int
    entries: dict[int, int]  # ledger id -> entries added (deleted ledger included)
    payload_bytes: dict[int, int]

    @property
    def journal_file(self) -> Path:
        (only,) = sorted((self.data_dir / "journal").glob(f"*{journalformat.SUFFIX}"))
        return only

    @property
    def logs(self) -> list[Path]:
        ledgers_dir = self.data_dir / "ledgers"
        return [logformat.log_path(ledgers_dir, i) for i in entrylog.list_logs(ledgers_dir)]


def _settings(data_dir: Path) -> Settings:
    return load(
        data_dir=data_dir,
        log_size_limit=LOG_SIZE_LIMIT,
        max_entry_size=MAX_ENTRY_SIZE,
        journal_pre_alloc_size=PRE_ALLOC,
    )


def _payload(index: int, n: int, size: int) -> bytes:
    return bytes([index + 1]) * (size + n)


async def _build(data_dir: Path) -> Data:
    storage = LedgerStorage(_settings(data_dir))
    await storage.start()
    ids: list[int] = []
    entries: dict[int, int] = {}
    payload_bytes: dict[int, int] = {}
    for index, (count, size) in enumerate(LEDGERS):
        meta, _ = await storage.create_ledger()
        ids.append(meta.ledger_id)
        if index == BATCHED:
            payloads = [_payload(index, n, size) for n in range(count)]
            await storage.add_entries(meta.ledger_id, payloads)  # one batch record
        else:
            for n in range(count):
                await storage.add_entry(meta.ledger_id, None, _payload(index, n, size))
        entries[meta.ledger_id] = count
        payload_bytes[meta.ledger_id] = sum(size + n for n in range(count))
        await storage.checkpoint()
    doomed, _ = await storage.create_ledger()
    for n in range(DELETED_ENTRIES):
        await storage.add_entry(doomed.ledger_id, None, _payload(len(LEDGERS), n, 10))
    entries[doomed.ledger_id] = DELETED_ENTRIES
    payload_bytes[doomed.ledger_id] = sum(10 + n for n in range(DELETED_ENTRIES))
    await storage.checkpoint()
    await storage.delete_ledger(doomed.ledger_id)
    await storage.fence(ids[0])
    await storage.close_ledger(ids[1])
    await storage.set_explicit_lac(ids[2], LAC)
    await storage.close()
    return Data(data_dir, ids, doomed.ledger_id, entries, payload_bytes)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    return asyncio.run(_build(tmp_path_factory.mktemp("inspect") / "data"))


@pytest.fixture
def copy(data: Data, tmp_path: Path) -> Data:
    """A copy of the data dir that a test may damage."""
    target = tmp_path / "data"
    shutil.copytree(data.data_dir, target)
    return Data(target, data.ledger_ids, data.deleted_id, data.entries, data.payload_bytes)


def inspect(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "node", "inspect", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _figures(pattern: str, text: str) -> dict[int, int]:
    return {int(a): int(b) for a, b in re.findall(pattern, text, re.MULTILINE)}


def _one(pattern: str, text: str) -> int:
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"{pattern!r} not in:\n{text}"
    return int(match.group(1))


def _journal_data_records(path: Path) -> list[tuple[int, int, int, int]]:
    """(offset, ledger id, entry id, payload length) of each record, walked by the format."""
    data = path.read_bytes()
    pos = journalformat.HEADER_SIZE
    found = []
    while pos + journalformat.RECORD_HEADER.size <= len(data):
        mask, pad = journalformat.PADDING_HEADER.unpack_from(data, pos)
        if mask == journalformat.PADDING_MASK:
            pos += journalformat.PADDING_HEADER.size + pad
            continue
        length, ledger_id, entry_id, _crc = journalformat.decode_record(data, pos)
        if (length, ledger_id, entry_id) == (0, 0, 0):
            break
        found.append((pos, ledger_id, entry_id, length))
        pos += journalformat.RECORD_HEADER.size + length
    return found


# --- good files --------------------------------------------------------------------------


def test_journal_figures(data: Data) -> None:
    result = inspect("journal", data.journal_file)
    out = result.stdout
    assert result.returncode == EXIT_OK, out + result.stderr
    assert f"magic BKLG, version {journalformat.VERSION}" in out
    assert _one(r"^  data records: (\d+)$", out) == sum(data.entries.values())
    # The batch (55 entries of about 700 bytes) takes records of max_entry_size at most.
    count, size = LEDGERS[BATCHED]
    whole = sum(8 + size + n for n in range(count))
    assert _one(r"^  batch records: (\d+)$", out) == -(-whole // (MAX_ENTRY_SIZE - 12))
    assert _figures(r"^    ledger (\d+): (\d+) entries", out) == data.entries
    assert _figures(r"^    ledger (\d+): \d+ entries, (\d+) payload bytes", out) == (
        data.payload_bytes
    )
    assert _one(r"^  payload bytes: (\d+)$", out) == sum(data.payload_bytes.values())
    kinds = dict(re.findall(r"^    ([A-Z_]+): (\d+)$", out, re.MULTILINE))
    assert kinds == {
        "LEDGER_CREATED": str(len(LEDGERS) + 1),
        "FENCE": "1",
        "CLOSE": "1",
        "DELETE": "1",
        "EXPLICIT_LAC": "1",
    }
    assert _one(r"^  ledgers seen: (\d+)$", out) == len(LEDGERS) + 1
    assert _one(r"^  padding records: (\d+)$", out) > 0
    # close() checkpointed everything: the mark sits exactly at the end of data.
    mark = journalformat.read_last_mark(data.data_dir / "ledgers")
    assert mark == LogMark(int(data.journal_file.stem, 16), _one(r"end of data: offset (\d+)", out))
    assert out.rstrip().endswith("OK")
    assert result.stderr == ""  # a small file: no progress bar


def test_journal_records_flag(data: Data) -> None:
    result = inspect("journal", data.journal_file, "--records")
    assert result.returncode == EXIT_OK
    lines = [line for line in result.stdout.splitlines() if line.startswith("  offset ")]
    records = _journal_data_records(data.journal_file)
    data_lines = [line for line in lines if "padding" not in line]
    assert len(data_lines) == len(records)
    offset, ledger_id, entry_id, length = next(r for r in records if r[2] >= 0)
    assert f"  offset {offset} ledger {ledger_id} entry {entry_id} len {length} crc ok" in lines
    offset, ledger_id, _kind, length = next(r for r in records if r[2] == journal.BATCH)
    first = next(line for line in lines if f"offset {offset} " in line)
    batch = r"batch of (\d+) entries 0\.\.(\d+)"
    found = re.fullmatch(
        rf"  offset {offset} ledger {ledger_id} {batch} len {length} crc ok", first
    )
    assert found and int(found.group(2)) == int(found.group(1)) - 1, first
    assert all(line.endswith("crc ok") for line in data_lines)


def test_entrylogs_figures(data: Data) -> None:
    logs = data.logs
    assert len(logs) >= 3, "the test wants several rolled logs"
    entries: Counter[int] = Counter()
    payload_bytes: Counter[int] = Counter()
    mapped_bytes: Counter[int] = Counter()
    for path in logs:
        result = inspect("entrylog", path)
        out = result.stdout
        assert result.returncode == EXIT_OK, out + result.stderr
        per_ledger = _figures(r"^    ledger (\d+): (\d+) entries", out)
        scanned = Counter(r.ledger_id for r in entrylog.scan(path) if r.ledger_id >= 0)
        assert per_ledger == dict(scanned)
        entries.update(per_ledger)
        payload_bytes.update(_figures(r"^    ledger (\d+): \d+ entries, (\d+) payload bytes", out))
        mapped_bytes.update(_figures(r"^    ledger (\d+): (\d+) bytes$", out))
        assert "ledgers map matches the scan" in out  # close() sealed even the last log
        assert _one(r"ledgers map offset (\d+)", out) > 0
        assert _one(r"^  bad CRC records: (\d+)$", out) == 0
        assert _one(r"end of data: offset (\d+)", out) == path.stat().st_size
    # The deleted ledger was checkpointed before its deletion: its entries are in the logs.
    assert dict(entries) == data.entries
    assert dict(payload_bytes) == data.payload_bytes
    # The maps count whole records: payload plus the record header of each entry.
    assert dict(mapped_bytes) == {
        lid: data.payload_bytes[lid] + logformat.RECORD_OVERHEAD * n
        for lid, n in data.entries.items()
    }


def test_entrylog_records_flag(data: Data) -> None:
    path = data.logs[0]
    result = inspect("entrylog", path, "--records")
    assert result.returncode == EXIT_OK
    lines = [line for line in result.stdout.splitlines() if line.startswith("  offset ")]
    scanned = list(entrylog.scan(path))
    assert len(lines) == len(scanned)
    first = scanned[0]
    assert lines[0] == (
        f"  offset {first.offset} ledger {first.ledger_id} entry {first.entry_id} "
        f"len {len(first.payload)} crc ok"
    )
    assert "ledgers-map" in lines[-1]


def test_index_figures(data: Data) -> None:
    result = inspect("index", data.data_dir / "index")
    out = result.stdout
    assert result.returncode == EXIT_OK, out + result.stderr
    assert _figures(r"^  ledger (\d+): (\d+) locations$", out) == data.entries
    assert _figures(
        r"^  ledger (\d+): state \w+ lac -?\d+ last entry -?\d+ entries (\d+)", out
    ) == (data.entries)
    states = dict(re.findall(r"^  ledger (\d+): state (\w+)", out, re.MULTILINE))
    first, second, third = (str(i) for i in data.ledger_ids)
    assert states == {
        first: "FENCED",
        second: "CLOSED",
        third: "OPEN",
        str(data.deleted_id): "DELETED",
    }
    # The explicit LAC is below the LAC the adds reached: it does not lower it.
    assert f"  ledger {third}: state OPEN lac {LEDGERS[2][0] - 1} " in out
    live = sum(n for lid, n in data.entries.items() if lid != data.deleted_id)
    assert f": {live} ok, 0 dangling, 0 wrong, 0 bad CRC" in out
    assert f"not checked: {DELETED_ENTRIES} locations of deleted ledgers" in out
    assert out.rstrip().endswith("OK")


async def test_index_beside_a_live_node(tmp_path: Path) -> None:
    """Read-only: the node holds the RocksDB lock, inspect still reads the index."""
    storage = LedgerStorage(_settings(tmp_path / "data"))
    await storage.start()
    try:
        meta, _ = await storage.create_ledger()
        for n in range(3):
            await storage.add_entry(meta.ledger_id, None, _payload(0, n, 100))
        await storage.checkpoint()
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "node",
            "inspect",
            "index",
            str(tmp_path / "data" / "index"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await process.communicate()
        out = stdout.decode()
        assert process.returncode == EXIT_OK, out + stderr.decode()
        assert f"  ledger {meta.ledger_id}: 3 locations" in out
        assert ": 3 ok, 0 dangling" in out
        await storage.add_entry(meta.ledger_id, None, b"after")  # the node still writes
    finally:
        await storage.close()


# --- damaged files -----------------------------------------------------------------------


def test_entrylog_without_a_map_and_the_map_gc_kept(copy: Data) -> None:
    """A log as a crash leaves it, without its map; then the map GC keeps beside such a log,
    checked against the scan as the log's own map is: GC acts on it after a restart."""
    path = copy.logs[1]
    sealed_with = cut_ledgers_map(path)
    kept = logformat.map_file_path(path)
    result = inspect("entrylog", path)
    assert result.returncode == EXIT_OK, result.stdout
    assert "ledgers map: none" in result.stdout
    assert f"kept map {kept.name}: none" in result.stdout

    size = path.stat().st_size
    kept.write_bytes(logformat.encode_map_file(size, sealed_with))
    result = inspect("entrylog", path)
    assert result.returncode == EXIT_OK, result.stdout
    assert f"kept map {kept.name}: {len(sealed_with)} ledgers" in result.stdout
    assert "kept map matches the scan" in result.stdout

    kept.write_bytes(logformat.encode_map_file(size + 1, sealed_with))  # kept for another log
    result = inspect("entrylog", path)
    assert result.returncode == EXIT_OK, result.stdout
    assert "does not hold for this log" in result.stdout

    wrong = {lid: n + 1 for lid, n in sealed_with.items()}
    kept.write_bytes(logformat.encode_map_file(size, wrong))
    result = inspect("entrylog", path)
    assert result.returncode == EXIT_FAILED, result.stdout
    last = result.stdout.rstrip().splitlines()[-1]
    assert last == f"FAILED: kept map disagrees with the scan for {len(wrong)} ledgers", last


def test_entrylog_flipped_payload_byte(copy: Data) -> None:
    path = copy.logs[1]
    victim = list(entrylog.scan(path))[3]
    flip_byte(path, victim.offset + logformat.RECORD_OVERHEAD + len(victim.payload) // 2, mask=0xFF)

    result = inspect("entrylog", path)
    assert result.returncode == EXIT_FAILED, result.stdout
    assert _one(r"^  bad CRC records: (\d+)$", result.stdout) == 1
    assert f"at offsets: {victim.offset}" in result.stdout
    last = result.stdout.rstrip().splitlines()[-1]
    assert last.startswith("FAILED:") and str(victim.offset) in last
    assert "ledgers map matches the scan" in result.stdout  # sizes are untouched

    records = inspect("entrylog", path, "--records").stdout
    assert f"  offset {victim.offset} ledger {victim.ledger_id} entry {victim.entry_id} " in records
    assert records.count("crc BAD") == 1

    index = inspect("index", copy.data_dir / "index")
    assert index.returncode == EXIT_FAILED, index.stdout
    assert "0 dangling, 0 wrong, 1 bad CRC" in index.stdout
    log_id = int(path.stem, 16)
    assert (
        f"ledger {victim.ledger_id} entry {victim.entry_id} "
        f"location {logformat.location(log_id, victim.offset):#x} (log {log_id:x} "
        f"offset {victim.offset}): CRC32C mismatch"
    ) in index.stdout


def test_index_dangling_locations(copy: Data) -> None:
    path = copy.logs[-1]
    in_log = Counter(
        r.ledger_id
        for r in entrylog.scan(path)
        if r.ledger_id >= 0 and r.ledger_id != copy.deleted_id
    )
    path.unlink()
    result = inspect("index", copy.data_dir / "index")
    assert result.returncode == EXIT_FAILED
    dangling = sum(in_log.values())
    assert dangling > 0
    assert "0 bad CRC" in result.stdout and f", {dangling} dangling," in result.stdout
    assert "does not exist" in result.stdout
    assert result.stdout.rstrip().endswith(f"FAILED: {dangling} dangling locations")


def test_journal_corruption_with_valid_records_after(copy: Data) -> None:
    path = copy.journal_file
    records = [r for r in _journal_data_records(path) if r[2] >= 0 and r[3] > 0]
    offset, _lid, _eid, length = records[len(records) // 2]
    flip_byte(path, offset + journalformat.RECORD_HEADER.size + length // 2, mask=0xFF)

    result = inspect("journal", path)
    out = result.stdout
    assert result.returncode == EXIT_FAILED, out
    assert f"invalid record at offset {offset}: CRC32C mismatch" in out
    assert "corruption, not a torn tail" in out
    assert _one(r"end of valid data: offset (\d+)", out) == offset
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("FAILED: corrupt journal record at offset") and str(offset) in last


def test_journal_torn_tail(copy: Data) -> None:
    path = copy.journal_file
    offset, _lid, _eid, length = _journal_data_records(path)[-1]
    flip_byte(path, offset + journalformat.RECORD_HEADER.size + length - 1, mask=0xFF)

    result = inspect("journal", path)
    assert result.returncode == EXIT_FAILED, result.stdout
    assert f"invalid record at offset {offset}" in result.stdout
    assert "a torn tail" in result.stdout
    assert (
        result.stdout.rstrip().splitlines()[-1].startswith(f"FAILED: torn tail at offset {offset}")
    )


def test_journal_length_that_does_not_fit(copy: Data) -> None:
    path = copy.journal_file
    size = path.stat().st_size
    offset = _journal_data_records(path)[-1][0]
    with open(path, "r+b") as f:
        f.seek(offset)
        _length, ledger_id, entry_id, crc = journalformat.RECORD_HEADER.unpack(
            f.read(journalformat.RECORD_HEADER.size)
        )
        f.seek(offset)
        f.write(journalformat.RECORD_HEADER.pack(size, ledger_id, entry_id, crc))
    result = inspect("journal", path)
    assert result.returncode == EXIT_FAILED
    assert (
        f"invalid record at offset {offset}: record length {size} is not plausible" in result.stdout
    )


# --- not the named kind, progress ---------------------------------------------------------


def test_not_of_the_named_kind(data: Data, tmp_path: Path) -> None:
    assert inspect("journal", data.logs[0]).returncode == EXIT_WRONG_KIND
    assert inspect("entrylog", data.journal_file).returncode == EXIT_WRONG_KIND
    junk = tmp_path / "junk.txn"
    junk.write_bytes(b"not a journal at all" * 100)
    result = inspect("journal", junk)
    assert result.returncode == EXIT_WRONG_KIND
    assert "bad magic" in result.stderr
    assert inspect("index", data.data_dir / "ledgers").returncode == EXIT_WRONG_KIND
    assert inspect("journal", tmp_path / "missing.txn").returncode == EXIT_WRONG_KIND


def test_progress_bar_on_a_big_file(tmp_path: Path) -> None:
    path = tmp_path / "1.txn"
    with open(path, "wb") as f:  # sparse: an empty journal, preallocated past the threshold
        f.write(journalformat.encode_header())
        f.truncate(BIG_FILE)
    result = inspect("journal", path)
    assert result.returncode == EXIT_OK, result.stdout
    assert "end of data: offset 512" in result.stdout
    assert "%|" in result.stderr and "B/s" in result.stderr  # a tqdm bar, on stderr
