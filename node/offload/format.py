"""Byte layouts of an offloaded ledger's two objects, defined once (big-endian).

Data object ``<ledger id>/<attempt>.data``: blocks one after another (one upload part
each when they are large enough), every block::

    0   4   magic u32 = 0x4E4F4442 ("NODB")
    4   2   version u16 = 1
    6   2   header length u16 = 32      a reader starts the entries here
    8   8   block length u64            header included
    16  8   first entry id i64
    24  4   entry count u32
    28  4   reserved (0)
    32  ..  entries: len u32 | entry id u64 | payload

An entry is never split across blocks; a block closes before the entry that would take it
past the maximum block size (an entry larger than that gets a block of its own).

Index object ``<ledger id>/<attempt>.index``::

    0   4   magic u32 = 0x4E4F4458 ("NODX")
    4   2   version u16 = 1
    6   2   header length u16 = 48
    8   8   ledger id u64
    16  8   data object length u64
    24  4   block count u32
    28  4   index point count u32
    32  4   metadata length u32
    36  4   stride u32                  index points are at most this many bytes apart
    40  8   reserved (0)
    48  ..  metadata: the ledger's metadata as UTF-8 JSON
    ..  28  per block: offset u64 | length u64 | first entry id i64 | CRC32C u32 (whole block)
    ..  24  per index point: entry id i64 | offset u64 | span length u32 | CRC32C u32 (span)
    ..  4   CRC32C u32 of everything before it

Index points are finer than blocks (Pulsar indexes one entry per block and re-reads whole
64 MiB blocks): one at the first entry of every block, then one before any entry that would
take the span since the last point past the stride. A span (from one point to the next, or
to the end of its block) holds whole entries and no block header, so a random read fetches
one span (at most the stride, or one larger entry) and checks its CRC before trusting a byte.
"""

from __future__ import annotations

import json
import struct
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any

import crc32c

VERSION = 1
DATA_MAGIC = 0x4E4F4442
INDEX_MAGIC = 0x4E4F4458
BLOCK_HEADER = struct.Struct(">IHHQqII")
ENTRY_HEADER = struct.Struct(">IQ")
INDEX_HEADER = struct.Struct(">IHHQQIIIIQ")
BLOCK_RECORD = struct.Struct(">QQqI")
POINT_RECORD = struct.Struct(">qQII")
CRC = struct.Struct(">I")


class FormatError(ValueError):
    """Bytes that are not what the layout says (damaged or foreign)."""


# Audit snapshots (POST /api/v1/audit/snapshot {"to": "offload"}) live under this prefix of
# the same store: no ledger names them, and they are not offload's to remove.
AUDIT_PREFIX = "audit/"


def data_key(ledger_id: int, attempt: str) -> str:
    return f"{ledger_id}/{attempt}.data"


def index_key(ledger_id: int, attempt: str) -> str:
    return f"{ledger_id}/{attempt}.index"


def parse_key(key: str) -> tuple[int, str] | None:
    """(ledger id, attempt) of an object key of ours; None for anything else."""
    head, _, name = key.rpartition("/")
    lid = head.rpartition("/")[2]
    attempt, dot, kind = name.rpartition(".")
    if not lid.isascii() or not lid.isdigit() or not dot or kind not in ("data", "index"):
        return None
    return int(lid), attempt


@dataclass(slots=True, frozen=True)
class Block:
    offset: int
    length: int
    first_entry_id: int
    crc: int


@dataclass(slots=True, frozen=True)
class Point:
    entry_id: int
    offset: int
    length: int
    crc: int


@dataclass(slots=True)
class LedgerIndex:
    ledger_id: int
    data_length: int
    stride: int
    metadata: dict[str, Any]
    blocks: list[Block]
    points: list[Point]
    _ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._ids = [p.entry_id for p in self.points]

    def point_of(self, entry_id: int) -> int:
        """The span that holds ``entry_id`` (if the ledger has it); -1 before the first."""
        return bisect_right(self._ids, entry_id) - 1

    def encode(self) -> bytes:
        meta = json.dumps(self.metadata, separators=(",", ":"), sort_keys=True).encode()
        parts = [
            INDEX_HEADER.pack(
                INDEX_MAGIC,
                VERSION,
                INDEX_HEADER.size,
                self.ledger_id,
                self.data_length,
                len(self.blocks),
                len(self.points),
                len(meta),
                self.stride,
                0,
            ),
            meta,
            *(BLOCK_RECORD.pack(b.offset, b.length, b.first_entry_id, b.crc) for b in self.blocks),
            *(POINT_RECORD.pack(p.entry_id, p.offset, p.length, p.crc) for p in self.points),
        ]
        body = b"".join(parts)
        return body + CRC.pack(crc32c.crc32c(body))

    @classmethod
    def decode(cls, data: bytes) -> LedgerIndex:
        if len(data) < INDEX_HEADER.size + CRC.size:
            raise FormatError(f"index object of {len(data)} bytes is too short")
        (stored_crc,) = CRC.unpack_from(data, len(data) - CRC.size)
        body = memoryview(data)[: len(data) - CRC.size]
        if crc32c.crc32c(body) != stored_crc:
            raise FormatError("index object CRC mismatch")
        magic, version, header_len, lid, length, nblocks, npoints, meta_len, stride, _ = (
            INDEX_HEADER.unpack_from(data)
        )
        if magic != INDEX_MAGIC or version != VERSION:
            raise FormatError(f"not an index object of version {VERSION} (magic {magic:#x})")
        expected = header_len + meta_len + nblocks * BLOCK_RECORD.size + npoints * POINT_RECORD.size
        if expected != len(body):
            raise FormatError("index object length does not match its counts")
        pos = header_len
        metadata = json.loads(bytes(body[pos : pos + meta_len]))
        pos += meta_len
        blocks = [
            Block(*BLOCK_RECORD.unpack_from(data, pos + i * BLOCK_RECORD.size))
            for i in range(nblocks)
        ]
        pos += nblocks * BLOCK_RECORD.size
        points = [
            Point(*POINT_RECORD.unpack_from(data, pos + i * POINT_RECORD.size))
            for i in range(npoints)
        ]
        return cls(lid, length, stride, metadata, blocks, points)


def decode_span(data: bytes, point: Point, where: str) -> dict[int, bytes]:
    """The entries of one span, after its CRC checks out (FormatError naming ``where``)."""
    if len(data) != point.length or crc32c.crc32c(data) != point.crc:
        raise FormatError(f"{where}: the span at offset {point.offset} fails its CRC")
    entries: dict[int, bytes] = {}
    view = memoryview(data)
    pos = 0
    while pos < len(data):
        if pos + ENTRY_HEADER.size > len(data):
            raise FormatError(f"{where}: a torn entry header at offset {point.offset + pos}")
        size, entry_id = ENTRY_HEADER.unpack_from(data, pos)
        pos += ENTRY_HEADER.size
        if pos + size > len(data):
            raise FormatError(f"{where}: entry {entry_id} runs past its span")
        entries[entry_id] = bytes(view[pos : pos + size])
        pos += size
    return entries


def check_block(data: bytes, block: Block, where: str) -> None:
    """A block read back after upload: its header and CRC (FormatError otherwise)."""
    if len(data) != block.length or crc32c.crc32c(data) != block.crc:
        raise FormatError(f"{where}: the block at offset {block.offset} fails its CRC")
    magic, version, _hlen, length, first, _count, _ = BLOCK_HEADER.unpack_from(data)
    if magic != DATA_MAGIC or version != VERSION or length != block.length:
        raise FormatError(f"{where}: a bad block header at offset {block.offset}")
    if first != block.first_entry_id:
        raise FormatError(f"{where}: the block at offset {block.offset} starts elsewhere")


class DataWriter:
    """Lays out entries (in id order) into blocks and index points as they come."""

    def __init__(self, max_block_size: int, stride: int) -> None:
        self._max_block = max_block_size
        self._stride = stride
        self._offset = 0  # data object bytes in finished blocks
        self._parts: list[bytes] = []
        self._block_bytes = 0  # of the open block, header included
        self._first = -1
        self._count = 0
        self._span_start = 0  # object offset of the open span
        self._span_crc = 0
        self._span_first = -1
        self.blocks: list[Block] = []
        self.points: list[Point] = []

    @property
    def length(self) -> int:
        return self._offset

    def add(self, entry_id: int, payload: bytes) -> bytes | None:
        """Add one entry; returns a finished block when this entry opened a new one."""
        record = ENTRY_HEADER.pack(len(payload), entry_id) + payload
        done = None
        if self._count and self._block_bytes + len(record) > self._max_block:
            done = self._seal()
        if not self._count:
            self._first = entry_id
            self._block_bytes = BLOCK_HEADER.size
            self._start_span(entry_id)
        elif self._position() - self._span_start + len(record) > self._stride:
            self._end_span()
            self._start_span(entry_id)
        self._parts.append(record)
        self._span_crc = crc32c.crc32c(record, self._span_crc)
        self._block_bytes += len(record)
        self._count += 1
        return done

    def finish(self) -> bytes | None:
        return self._seal() if self._count else None

    def _position(self) -> int:
        return self._offset + self._block_bytes

    def _start_span(self, entry_id: int) -> None:
        self._span_start = self._position()
        self._span_first = entry_id
        self._span_crc = 0

    def _end_span(self) -> None:
        length = self._position() - self._span_start
        self.points.append(Point(self._span_first, self._span_start, length, self._span_crc))

    def _seal(self) -> bytes:
        self._end_span()
        header = BLOCK_HEADER.pack(
            DATA_MAGIC, VERSION, BLOCK_HEADER.size, self._block_bytes, self._first, self._count, 0
        )
        block = header + b"".join(self._parts)
        self.blocks.append(Block(self._offset, len(block), self._first, crc32c.crc32c(block)))
        self._offset += len(block)
        self._parts = []
        self._count = 0
        self._block_bytes = 0
        return block

    def index(self, ledger_id: int, metadata: dict[str, Any]) -> LedgerIndex:
        return LedgerIndex(
            ledger_id, self._offset, self._stride, metadata, list(self.blocks), list(self.points)
        )
