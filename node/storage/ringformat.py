"""The raw-device WAL's bytes (blockwal.py writes them; ringscan.py reads them back, for
recovery and ``inspect``).

Medium of capacity C (fixed at creation and kept in the header; a larger device is used only
up to C)::

    physical range   content
    [0, 4 KiB)       header slot 0
    [4 KiB, 8 KiB)   header slot 1
    [8 KiB, C)       the ring: blocks of records

Logical offsets are u64 and never go back; the record at logical offset x sits at physical
``8 KiB + x mod (C - 8 KiB)``. A LogMark of the ring is ``(0, logical offset)``.

Header slot (these 88 bytes, then zeros to 4 KiB)::

    off  size  field
    0    4     magic "BKWH"
    4    4     version u32 = 3 (2: no instance id, a 72-byte header; still read)
    8    8     capacity u64: C, the header area included
    16   8     trim offset u64: records before it are dead; recovery starts here
    24   8     sequence u64: +1 per header write; of the valid slots the higher one wins
    32   8     last write time u64, ms since the epoch (for people; never compared)
    40   8     sliding window max length u64: how far past the first hole a write may land
    48   8     node id u64
    56   16    instance id: the one the ring's owner gives (the node: its cookie's,
               node/replication/cookie.py); zeros without. A start refuses a ring of
               another instance (the ids on disk: node/storage/walid.py).
    72   8     end offset u64: written by a graceful shutdown, where the next block goes: the
               ring from the trim offset to it holds records back to back, nothing else;
               0 when unknown (a running or crashed ring, or a crash's leftovers untrimmed)
    80   4     shutdown type u32: 0 graceful, 1 ungraceful
    84   4     crc32c u32 of bytes [0, 84)

Record (a 24-byte header, then the body)::

    0    4     magic "BKWR" (data) or "BKWP" (padding to the physical end of the ring)
    4    4     body length u32
    8    8     body offset u64: the logical offset of the body (record offset + 24); a record
               left from an earlier lap sits at the same place with another offset
    16   4     body crc32c u32 (0 for padding, whose body is not read)
    20   4     header crc32c u32 of bytes [0, 20)

    data body: ledger id i64 | entry id i64 | payload. Its CRC32C is exactly
    ``wal.record_crc(ledger id, entry id, payload)``, which the engine computes once per entry
    anyway, so the WAL checks what the entry log and every read check.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

import crc32c

from node.settings import KiB, Settings
from node.storage.journalformat import max_record_length

HEADER_MAGIC = b"BKWH"
DATA_MAGIC = b"BKWR"
PADDING_MAGIC = b"BKWP"
VERSION = 3  # 3: the instance id; 2: the end offset
BLOCK_ALIGNMENT = 4 * KiB  # block starts and sizes; a multiple of any logical block size
HEADER_SLOT_SIZE = 4 * KiB
HEADER_SLOTS = 2
HEADER_AREA = HEADER_SLOT_SIZE * HEADER_SLOTS  # records start here
HEADER = struct.Struct(">4sIQQQQQQ16sQI")  # the slot's fields, without its CRC
HEADER_V2 = struct.Struct(">4sIQQQQQQQI")  # version 2's: no instance id
HEADER_CRC = struct.Struct(">I")
HEADER_SIZE = HEADER.size + HEADER_CRC.size
NO_INSTANCE = bytes(16)
RECORD_PREFIX = struct.Struct(">4sIQI")  # the record header's fields, without its CRC
RECORD_CRC = struct.Struct(">I")
RECORD_HEADER_SIZE = RECORD_PREFIX.size + RECORD_CRC.size
BODY_PREFIX = struct.Struct(">qq")  # ledger id, entry id
RECORD_OVERHEAD = RECORD_HEADER_SIZE + BODY_PREFIX.size  # bytes of a record besides its payload
U64_LIMIT = 1 << 64


class Shutdown(IntEnum):
    GRACEFUL = 0
    UNGRACEFUL = 1


class WalHeader(NamedTuple):
    capacity: int
    trim: int
    sequence: int
    written_ms: int
    window: int
    node_id: int
    shutdown: Shutdown
    end: int = 0  # graceful: where the records from the trim offset end; 0: unknown
    version: int = VERSION
    instance_id: bytes = NO_INSTANCE  # the cookie's (version 3); zeros: none


def encode_header(header: WalHeader) -> bytes:
    common = (
        HEADER_MAGIC,
        header.version,
        header.capacity,
        header.trim,
        header.sequence,
        header.written_ms,
        header.window,
        header.node_id,
    )
    if header.version == 2:
        body = HEADER_V2.pack(*common, header.end, header.shutdown)
    else:
        body = HEADER.pack(*common, header.instance_id, header.end, header.shutdown)
    return body + HEADER_CRC.pack(crc32c.crc32c(body))


def decode_header(data: bytes | memoryview) -> WalHeader:
    """The header in a slot; ValueError saying why a slot holds none."""
    if len(data) < HEADER_V2.size + HEADER_CRC.size:
        raise ValueError("shorter than a header")
    magic, version = HEADER.unpack_from(data)[:2]
    if magic != HEADER_MAGIC:
        raise ValueError(f"bad magic {bytes(magic)!r}")
    layout = HEADER_V2 if version == 2 else HEADER
    if len(data) < layout.size + HEADER_CRC.size:
        raise ValueError("shorter than a header")
    (stored,) = HEADER_CRC.unpack_from(data, layout.size)
    if crc32c.crc32c(bytes(data[: layout.size])) != stored:
        raise ValueError("CRC32C mismatch")
    if version not in (2, VERSION):
        raise ValueError(f"unsupported WAL version {version}")
    fields = layout.unpack_from(data)
    capacity, trim, sequence, written_ms, window, node_id = fields[2:8]
    instance_id = NO_INSTANCE if version == 2 else bytes(fields[8])
    end, shutdown = fields[-2:]
    if shutdown not in (Shutdown.GRACEFUL, Shutdown.UNGRACEFUL):
        raise ValueError(f"unknown shutdown type {shutdown}")
    if end and not trim <= end <= trim + capacity - HEADER_AREA:
        raise ValueError(f"end offset {end} is not within a ring of the trim offset {trim}")
    return WalHeader(
        capacity,
        trim,
        sequence,
        written_ms,
        window,
        node_id,
        Shutdown(shutdown),
        end,
        version,
        instance_id,
    )


def encode_record_header(magic: bytes, body_length: int, body_offset: int, body_crc: int) -> bytes:
    prefix = RECORD_PREFIX.pack(magic, body_length, body_offset, body_crc)
    return prefix + RECORD_CRC.pack(crc32c.crc32c(prefix))


class RecordHeader(NamedTuple):
    magic: bytes
    body_length: int
    body_crc: int


def decode_record_header(data: bytes | memoryview, record_offset: int) -> RecordHeader | str:
    """The record header of the record at logical ``record_offset``, or why there is none."""
    magic, body_length, body_offset, body_crc = RECORD_PREFIX.unpack_from(data)
    if magic not in (DATA_MAGIC, PADDING_MAGIC):
        return "no record (zeros)" if not any(data[:RECORD_HEADER_SIZE]) else "bad magic"
    (stored,) = RECORD_CRC.unpack_from(data, RECORD_PREFIX.size)
    if crc32c.crc32c(bytes(data[: RECORD_PREFIX.size])) != stored:
        return "record header CRC32C mismatch"
    if body_offset != record_offset + RECORD_HEADER_SIZE:
        return f"record of another lap (body offset {body_offset})"
    return RecordHeader(bytes(magic), body_length, body_crc)


def align_up(value: int, alignment: int = BLOCK_ALIGNMENT) -> int:
    return -(-value // alignment) * alignment


def align_next(value: int) -> int:
    """The first block boundary strictly after ``value``."""
    return (value // BLOCK_ALIGNMENT + 1) * BLOCK_ALIGNMENT


def largest_block(settings: Settings) -> int:
    """The largest block: the soft limit, or one record as large as a record may be."""
    largest_record = RECORD_OVERHEAD + max_record_length(settings)
    return max(align_up(settings.wal_block_soft_limit), align_up(largest_record))


def minimum_capacity(settings: Settings) -> int:
    """The header area and room for two largest blocks: after a checkpoint trims everything
    before a waiting block, that block (and a padding block before it) always fits."""
    return HEADER_AREA + 2 * largest_block(settings)
