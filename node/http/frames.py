"""Binary frames of the HTTP API (all integers big-endian).

Batch body (``application/x-entry-batch``), repeated::

    len u32 | payload

Range stream (``application/x-entry-range``), repeated::

    entry id u64 | len u32 | payload
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterator, Mapping
from typing import Any

from node.streams.model import Position

BATCH_CONTENT_TYPE = "application/x-entry-batch"
RANGE_CONTENT_TYPE = "application/x-entry-range"
BATCH_LENGTH = struct.Struct(">I")
RANGE_HEADER = struct.Struct(">QI")
DECODE_YIELD_FRAMES = 2048  # about a millisecond of decoding between two hand-overs


class FrameError(ValueError):
    """A body that is not a well-formed sequence of frames."""


class TooManyEntries(FrameError):
    """A batch of more entries than max_entries_per_batch."""


def encode_batch(payloads: list[bytes]) -> bytes:
    return b"".join(BATCH_LENGTH.pack(len(p)) + p for p in payloads)


async def decode_batch(body: bytes, max_entries: int) -> list[bytes]:
    """The payloads of a batch body; at most ``max_entries`` of them (TooManyEntries past
    that, found without decoding the rest). Hands the event loop over every
    DECODE_YIELD_FRAMES frames: a body of many small frames is long to walk."""
    view = memoryview(body)
    payloads: list[bytes] = []
    pos = 0
    while pos < len(view):
        if len(payloads) == max_entries:
            raise TooManyEntries(f"more than {max_entries} entries in one batch")
        if pos + BATCH_LENGTH.size > len(view):
            raise FrameError(f"truncated length field at byte {pos}")
        (length,) = BATCH_LENGTH.unpack_from(view, pos)
        pos += BATCH_LENGTH.size
        if pos + length > len(view):
            raise FrameError(f"frame at byte {pos - 4} claims {length} bytes, past the body's end")
        payloads.append(bytes(view[pos : pos + length]))
        pos += length
        if not len(payloads) % DECODE_YIELD_FRAMES:
            await asyncio.sleep(0)
    return payloads


def encode_range_frame(entry_id: int, payload: bytes) -> bytes:
    return RANGE_HEADER.pack(entry_id, len(payload)) + payload


def decode_range(body: bytes) -> Iterator[tuple[int, bytes]]:
    view = memoryview(body)
    pos = 0
    while pos < len(view):
        if pos + RANGE_HEADER.size > len(view):
            raise FrameError(f"truncated frame header at byte {pos}")
        entry_id, length = RANGE_HEADER.unpack_from(view, pos)
        pos += RANGE_HEADER.size
        if pos + length > len(view):
            raise FrameError(f"frame of entry {entry_id} is cut short")
        yield entry_id, bytes(view[pos : pos + length])
        pos += length


def batch_entry_ids(reply: Mapping[str, Any]) -> range:
    """The ids of a ledger batch's entries, from its reply (they are consecutive)."""
    if reply["firstEntryId"] is None:
        return range(0)
    return range(reply["firstEntryId"], reply["lastEntryId"] + 1)


def batch_positions(reply: Mapping[str, Any]) -> list[Position]:
    """The positions of a stream batch's entries, from its reply: one ledger, consecutive
    entry ids."""
    first, last = Position.parse(reply["firstPosition"]), Position.parse(reply["lastPosition"])
    return [Position(first.ledger_id, e) for e in range(first.entry_id, last.entry_id + 1)]
