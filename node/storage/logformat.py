"""The entry log's bytes (BookKeeper's DefaultEntryLogger format), defined once: the layout
tables, then encode and decode side by side. Standard library only (and the record CRC), so
that what reads logs without the engine (the Spark audit's workers, ``inspect``) imports
this and not ``entrylog``'s writers and readers.

Entry log file ``<id in hex>.log``::

    offset  size   field
    0       4      magic "BKLO"
    4       4      version u32 = 1
    8       8      ledgers map offset u64   (0 until the log is rolled)
    16      4      ledgers map count u32    (ledgers in the map)
    20      1004   zero padding
    1024    ...    records

Record::

    0   4     size u32       bytes after this field: 20 + payload length
    4   8     ledger id i64  (-1: a ledgers-map record)
    12  8     entry id i64   (-2 in a ledgers-map record)
    20  4     crc32c u32     over ledger id | entry id | payload (wal.record_crc)
    24  ...   payload

Ledgers map record payload (at most 10,000 ledgers per record, as BookKeeper)::

    count u32, then count x (ledger id u64, bytes of that ledger in this log u64)

A location is ``(log id << 32) | offset of the record``.

A map file ``<id in hex>.log.map`` keeps what a scan of a log without a map learnt (see
``entrylog``)::

    offset  size   field
    0       4      magic "BKLM"
    4       4      version u32 = 1
    8       8      log size u64             (the map holds while the log keeps this size)
    16      4      ledgers map count u32
    20      ...    the ledgers map records, as in a log
"""

from __future__ import annotations

import struct
from pathlib import Path

from node.storage.wal import record_crc

MAGIC = b"BKLO"
VERSION = 1
HEADER_SIZE = 1024
HEADER = struct.Struct(">4sIQI")
MAP_FIELDS = struct.Struct(">QI")  # the patched part of the header, at offset 8
MAP_FIELDS_OFFSET = 8
RECORD_HEADER = struct.Struct(">IqqI")
RECORD_OVERHEAD = RECORD_HEADER.size
SIZE_FIELD = 4
LEDGERS_MAP_LEDGER_ID = -1
LEDGERS_MAP_ENTRY_ID = -2
LEDGERS_MAP_COUNT = struct.Struct(">I")
LEDGERS_MAP_ITEM = struct.Struct(">QQ")
LEDGERS_MAP_MAX_BATCH = 10_000
MAP_FILE_MAGIC = b"BKLM"
MAP_FILE_VERSION = 1
MAP_FILE_HEADER = struct.Struct(">4sIQI")
MAP_FILE_SUFFIX = ".map"  # after the log's name: <id>.log.map
SUFFIX = ".log"


def location(log_id: int, offset: int) -> int:
    return (log_id << 32) | offset


def split_location(loc: int) -> tuple[int, int]:
    return loc >> 32, loc & 0xFFFF_FFFF


def encode_header(map_offset: int = 0, map_count: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, map_offset, map_count).ljust(HEADER_SIZE, b"\0")


def decode_header(data: bytes) -> tuple[int, int, int]:
    """(version, ledgers map offset, ledgers map count); ValueError if not an entry log."""
    magic, version, map_offset, map_count = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r}")
    if version != VERSION:
        raise ValueError(f"unsupported entry log version {version}")
    return version, map_offset, map_count


def encode_record(ledger_id: int, entry_id: int, crc: int, payload: bytes) -> bytes:
    return (
        RECORD_HEADER.pack(RECORD_OVERHEAD - SIZE_FIELD + len(payload), ledger_id, entry_id, crc)
        + payload
    )


def decode_record_header(data: bytes | memoryview, pos: int = 0) -> tuple[int, int, int, int]:
    """(payload length, ledger id, entry id, crc) of the record at ``pos``."""
    size, ledger_id, entry_id, crc = RECORD_HEADER.unpack_from(data, pos)
    return size - (RECORD_OVERHEAD - SIZE_FIELD), ledger_id, entry_id, crc


def encode_ledgers_map(sizes: dict[int, int]) -> bytes:
    """The ledgers map as records with ledger id -1, at most 10,000 ledgers each."""
    items = sorted(sizes.items())
    records = []
    for start in range(0, len(items), LEDGERS_MAP_MAX_BATCH):
        batch = items[start : start + LEDGERS_MAP_MAX_BATCH]
        payload = LEDGERS_MAP_COUNT.pack(len(batch)) + b"".join(
            LEDGERS_MAP_ITEM.pack(lid, size) for lid, size in batch
        )
        crc = record_crc(LEDGERS_MAP_LEDGER_ID, LEDGERS_MAP_ENTRY_ID, payload)
        records.append(encode_record(LEDGERS_MAP_LEDGER_ID, LEDGERS_MAP_ENTRY_ID, crc, payload))
    return b"".join(records)


def decode_ledgers_map(payload: bytes) -> dict[int, int]:
    (count,) = LEDGERS_MAP_COUNT.unpack_from(payload)
    if len(payload) != LEDGERS_MAP_COUNT.size + count * LEDGERS_MAP_ITEM.size:
        raise ValueError("ledgers map length does not match its count")
    return dict(LEDGERS_MAP_ITEM.iter_unpack(payload[LEDGERS_MAP_COUNT.size :]))


def log_path(directory: Path, log_id: int) -> Path:
    return directory / f"{log_id:x}{SUFFIX}"


def map_file_path(log: Path) -> Path:
    return log.with_name(log.name + MAP_FILE_SUFFIX)


def decode_map_records(data: bytes, count: int) -> dict[int, int] | None:
    """The ledgers map of ``count`` ledgers that ``data`` holds whole, or None."""
    sizes: dict[int, int] = {}
    pos = 0
    while pos + RECORD_OVERHEAD <= len(data):
        length, ledger_id, entry_id, crc = decode_record_header(data, pos)
        end = pos + RECORD_OVERHEAD + length
        payload = data[pos + RECORD_OVERHEAD : end]
        if (ledger_id, entry_id) != (LEDGERS_MAP_LEDGER_ID, LEDGERS_MAP_ENTRY_ID) or end > len(
            data
        ):
            return None
        if record_crc(ledger_id, entry_id, payload) != crc:
            return None
        try:
            sizes.update(decode_ledgers_map(payload))
        except (ValueError, struct.error):
            return None
        pos = end
    return sizes if len(sizes) == count else None


def encode_map_file(log_size: int, sizes: dict[int, int]) -> bytes:
    header = MAP_FILE_HEADER.pack(MAP_FILE_MAGIC, MAP_FILE_VERSION, log_size, len(sizes))
    return header + encode_ledgers_map(sizes)


def decode_map_file(data: bytes, log_size: int) -> dict[int, int] | None:
    """The map a map file holds for a log of ``log_size`` bytes, or None (not a map file,
    another version, a log of another size, a record that does not check out)."""
    if len(data) < MAP_FILE_HEADER.size:
        return None
    magic, version, size, count = MAP_FILE_HEADER.unpack_from(data)
    if (magic, version, size) != (MAP_FILE_MAGIC, MAP_FILE_VERSION, log_size):
        return None
    return decode_map_records(data[MAP_FILE_HEADER.size :], count)
