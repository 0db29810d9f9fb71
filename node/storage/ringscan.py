"""Reading the raw-device WAL's ring back (recovery and ``inspect``): its header slots and
which one wins, and the scan of records from the trim offset, with the holes and damage it
finds (the rules: blockwal.py's docstring, Recovery)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

import crc32c

from node.settings import MiB
from node.storage.directio import (
    RawFile,
    aligned_buffer,
    read_exactly,
)
from node.storage.ringformat import (
    BLOCK_ALIGNMENT,
    BODY_PREFIX,
    HEADER_AREA,
    HEADER_MAGIC,
    HEADER_SLOT_SIZE,
    HEADER_SLOTS,
    PADDING_MAGIC,
    RECORD_HEADER_SIZE,
    Shutdown,
    WalHeader,
    align_next,
    align_up,
    decode_header,
    decode_record_header,
)
from node.storage.wal import WalRecord

RECOVERY_READ_SIZE = 1 * MiB  # recovery reads the ring in chunks this large (AutoMQ: 1 MiB)


class RingReader:
    """Reads of the ring through one aligned buffer (O_DIRECT needs aligned buffers)."""

    def __init__(self, raw: RawFile, capacity: int) -> None:
        self._raw = raw
        self._capacity = capacity
        self._buffer = aligned_buffer(RECOVERY_READ_SIZE)
        self._cached_at = 0
        self._cached = b""

    def read(self, position: int, length: int) -> bytes:
        """``length`` bytes at physical ``position`` (within the capacity)."""
        offset = position - self._cached_at
        if offset >= 0 and offset + length <= len(self._cached):
            return self._cached[offset : offset + length]
        start = position - position % BLOCK_ALIGNMENT
        size = max(RECOVERY_READ_SIZE, align_up(position + length) - start)
        size = min(size, self._capacity - start)
        if size > len(self._buffer):
            self._buffer.close()
            self._buffer = aligned_buffer(size)
        view = read_exactly(self._raw, self._buffer, size, start)
        try:
            self._cached, self._cached_at = bytes(view), start
        finally:
            view.release()
        offset = position - start
        return self._cached[offset : offset + length]

    def read_header_slots(self) -> list[bytes]:
        data = self.read(0, HEADER_AREA)
        return [
            data[slot * HEADER_SLOT_SIZE : (slot + 1) * HEADER_SLOT_SIZE]
            for slot in range(HEADER_SLOTS)
        ]

    def close(self) -> None:
        self._buffer.close()


class SlotState(NamedTuple):
    """What one header slot holds: a header, or why not."""

    slot: int
    header: WalHeader | None
    problem: str  # "" when the header is valid
    has_magic: bool


def read_slots(reader: RingReader) -> list[SlotState]:
    states = []
    for slot, data in enumerate(reader.read_header_slots()):
        try:
            states.append(SlotState(slot, decode_header(data), "", True))
        except ValueError as e:
            states.append(SlotState(slot, None, str(e), data[:4] == HEADER_MAGIC))
    return states


def winning_slot(states: list[SlotState]) -> SlotState | None:
    valid = [s for s in states if s.header is not None]
    return max(valid, key=lambda s: s.header.sequence if s.header else -1, default=None)


class ScanKind(IntEnum):
    RECORD = 0
    PADDING = 1
    INVALID = 2  # no record here
    TORN = 3  # a record header whose body fails its CRC: a write that landed in part


class ScanEvent(NamedTuple):
    offset: int  # logical offset of the record (or of the invalid data)
    kind: ScanKind
    length: int  # bytes of the record, header included (0 for invalid data)
    record: WalRecord | None = None
    reason: str = ""


@dataclass(slots=True)
class Hole:
    """A block boundary with no valid record, and valid records after it."""

    offset: int
    reason: str
    next_valid: int


class Damage(NamedTuple):
    """Invalid data where a graceful shutdown says records are."""

    offset: int
    reason: str


@dataclass
class RingScan:
    """One scan of the ring from ``start``, as recovery does it; iterate for the events,
    then read the figures.

    With ``stop`` (the end offset of a graceful shutdown), records must fill [start, stop)
    back to back, each block's zero tail aside: any other invalid data there is damage,
    reported as an event and in ``damage``. Without it (after a crash), only invalid data at
    block boundaries (a hole, or the end) and records whose body fails its CRC (a torn write)
    are reported; the zeros after the last record of a block are not."""

    read: Callable[[int, int], bytes]
    capacity: int
    start: int
    window: int
    stop: int | None = None
    records: int = 0
    payload_bytes: int = 0
    paddings: int = 0
    end: int = 0  # logical end of the last valid record (start if none)
    end_reason: str = ""  # why the record at the end is not valid
    holes: list[Hole] = field(default_factory=list)
    damage: list[Damage] = field(default_factory=list)

    def __iter__(self) -> Iterator[ScanEvent]:
        if self.stop is not None:
            yield from self._to_stop(self.stop)
            return
        area = self.capacity - HEADER_AREA
        offset = self.end = self.start
        limit = self.start + area  # one lap at most
        first_invalid: tuple[int, str] | None = None
        while offset < limit and (first_invalid is None or offset < first_invalid[0] + self.window):
            event, following = self._at(offset, HEADER_AREA + offset % area)
            if event.kind in (ScanKind.INVALID, ScanKind.TORN):
                if offset % BLOCK_ALIGNMENT == 0 or event.kind is ScanKind.TORN:
                    if first_invalid is None:
                        first_invalid = (offset, event.reason)
                    yield event
                offset = following
                continue
            if first_invalid is not None:
                self.holes.append(Hole(first_invalid[0], first_invalid[1], offset))
                first_invalid = None
            self._count(event)
            yield event
            offset = self.end = following
        self.end_reason = first_invalid[1] if first_invalid else "a full lap of records"

    def _to_stop(self, stop: int) -> Iterator[ScanEvent]:
        area = self.capacity - HEADER_AREA
        offset = self.end = self.start
        while offset < stop:
            position = HEADER_AREA + offset % area
            event, following = self._at(offset, position)
            if event.kind is ScanKind.INVALID and offset % BLOCK_ALIGNMENT:
                tail = self.read(position, following - offset)
                if not any(tail):
                    offset = following  # the zeros that pad a block
                    continue
            if event.kind in (ScanKind.INVALID, ScanKind.TORN):
                self.damage.append(Damage(offset, event.reason))
                yield event
                offset = following
                continue
            self._count(event)
            yield event
            offset = self.end = following
        self.end_reason = "the end offset of the graceful shutdown"

    def _count(self, event: ScanEvent) -> None:
        if event.kind is ScanKind.RECORD:
            self.records += 1
            assert event.record is not None
            self.payload_bytes += len(event.record.payload)
        else:
            self.paddings += 1

    def _at(self, offset: int, position: int) -> tuple[ScanEvent, int]:
        """The event at ``offset`` and the offset to look at next."""
        to_end = self.capacity - position
        if to_end < RECORD_HEADER_SIZE:
            return ScanEvent(offset, ScanKind.INVALID, 0, reason="too close to the end"), (
                align_next(offset)
            )
        header = decode_record_header(self.read(position, RECORD_HEADER_SIZE), offset)
        if isinstance(header, str):
            return ScanEvent(offset, ScanKind.INVALID, 0, reason=header), align_next(offset)
        length = RECORD_HEADER_SIZE + header.body_length
        if header.magic == PADDING_MAGIC:
            if length != to_end:
                reason = f"padding of {length} bytes does not end at the end of the ring"
                return ScanEvent(offset, ScanKind.INVALID, 0, reason=reason), align_next(offset)
            return ScanEvent(offset, ScanKind.PADDING, length), offset + length
        if header.body_length < BODY_PREFIX.size or length > to_end:
            reason = f"body length {header.body_length} does not fit"
            return ScanEvent(offset, ScanKind.INVALID, 0, reason=reason), align_next(offset)
        body = self.read(position + RECORD_HEADER_SIZE, header.body_length)
        if crc32c.crc32c(body) != header.body_crc:
            reason = "torn or corrupt body (CRC32C mismatch)"
            return ScanEvent(offset, ScanKind.TORN, 0, reason=reason), align_up(offset + length)
        ledger_id, entry_id = BODY_PREFIX.unpack_from(body)
        record = WalRecord(ledger_id, entry_id, body[BODY_PREFIX.size :])
        return ScanEvent(offset, ScanKind.RECORD, length, record), offset + length


def scan_stop(header: WalHeader) -> int | None:
    """Where the records end, if the header knows (see RingScan's ``stop``)."""
    return header.end if header.shutdown == Shutdown.GRACEFUL and header.end else None


def restart_offset(header: WalHeader) -> int:
    """Where the first block goes after a recovery."""
    stop = scan_stop(header)
    if stop is not None:
        return stop  # no block was in flight at the stop: nothing was written past it
    # A full ring ahead of the trim offset: every record ever written lies below it, so
    # nothing on the medium matches an offset of the new lap.
    return align_up(header.trim + header.capacity - HEADER_AREA)
