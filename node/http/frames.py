"""Binary frames of the HTTP API (all integers big-endian).

Batch body (``application/x-entry-batch``), repeated::

    len u32 | payload

Range stream (``application/x-entry-range``), repeated::

    entry id u64 | len u32 | payload
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

BATCH_CONTENT_TYPE = "application/x-entry-batch"
RANGE_CONTENT_TYPE = "application/x-entry-range"
BATCH_LENGTH = struct.Struct(">I")
RANGE_HEADER = struct.Struct(">QI")


class FrameError(ValueError):
    """A body that is not a well-formed sequence of frames."""


def encode_batch(payloads: list[bytes]) -> bytes:
    return b"".join(BATCH_LENGTH.pack(len(p)) + p for p in payloads)


def decode_batch(body: bytes, max_entries: int = 1 << 20) -> list[bytes]:
    view = memoryview(body)
    payloads: list[bytes] = []
    pos = 0
    while pos < len(view):
        if pos + BATCH_LENGTH.size > len(view):
            raise FrameError(f"truncated length field at byte {pos}")
        (length,) = BATCH_LENGTH.unpack_from(view, pos)
        pos += BATCH_LENGTH.size
        if pos + length > len(view):
            raise FrameError(f"frame at byte {pos - 4} claims {length} bytes, past the body's end")
        payloads.append(bytes(view[pos : pos + length]))
        pos += length
        if len(payloads) > max_entries:
            raise FrameError(f"more than {max_entries} entries in one batch")
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
