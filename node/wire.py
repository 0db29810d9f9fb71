"""The wire format of the HTTP API: every content type it speaks, and its binary frames.

A body of frames is the frame below, repeated; integers are big-endian:

================================  ===========================  ==================================
content type                      carried by                   frame
================================  ===========================  ==================================
``application/x-entry-batch``     adds (request body)          len u32 | payload
``application/x-entry-range``     ledger range reads (reply)   entry id u64 | len u32 | payload
``application/x-stream-entries``  stream and cursor reads      ledger id u64 | entry id u64 |
                                  (reply)                      len u32 | payload
================================  ===========================  ==================================

No frame carries a version: the content type names the layout, and another layout would get
another content type. Each frame's encoder and decoder sit side by side below; every decoder
goes through ``_frame_at``, the bounds checks: a body that ends inside a frame (truncated), or
a frame whose length runs past the body's end (oversized), raises FrameError. A decoder never
returns a short payload.

HTTP's routes, the audit, the benches and test clients import this module, which sits below
them all (BookKeeper's proto, aiohttp's http_parser): it needs no aiohttp, and a test
(tests/test_wire.py) keeps it so.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from node.streams.model import Position

# --- content types ---------------------------------------------------------------------------

JSON_CONTENT_TYPE = "application/json"
OCTET_CONTENT_TYPE = "application/octet-stream"  # one entry, its payload as it is
RAW_CONTENT_TYPES = frozenset({OCTET_CONTENT_TYPE, ""})  # one entry: octet-stream, or no type
BATCH_CONTENT_TYPE = "application/x-entry-batch"
RANGE_CONTENT_TYPE = "application/x-entry-range"
STREAM_CONTENT_TYPE = "application/x-stream-entries"
TEXT_CONTENT_TYPE = "text/plain"  # /heartbeat
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus's text format
HTML_CONTENT_TYPE = "text/html"  # the status page, and its assets below
CSS_CONTENT_TYPE = "text/css"
JAVASCRIPT_CONTENT_TYPE = "text/javascript"


def media_type(content_type: str) -> str:
    """The media type of a Content-Type header, without parameters, in lower case: what the
    routes and the fast lane compare with the types above."""
    return content_type.partition(";")[0].strip().lower()


# --- frames ----------------------------------------------------------------------------------

BATCH_HEADER = struct.Struct(">I")  # len
RANGE_HEADER = struct.Struct(">QI")  # entry id, len
STREAM_HEADER = struct.Struct(">QQI")  # ledger id, entry id, len
BATCH_LAYOUT = "len u32 | payload"
RANGE_LAYOUT = "entry id u64 | len u32 | payload"
STREAM_LAYOUT = "ledger id u64 | entry id u64 | len u32 | payload"
DECODE_YIELD_FRAMES = 2048  # about a millisecond of decoding between two hand-overs


class FrameError(ValueError):
    """A body that is not a well-formed sequence of frames."""


class TooManyEntries(FrameError):
    """A batch of more entries than max_entries_per_batch."""


def _frame_at(view: memoryview, pos: int, header: struct.Struct) -> tuple[tuple[int, ...], int]:
    """The header fields of the frame at ``pos`` (its length last) and where its payload
    starts, once the whole frame is known to lie within the body."""
    if pos + header.size > len(view):
        raise FrameError(f"truncated frame header at byte {pos}")
    fields = header.unpack_from(view, pos)
    start = pos + header.size
    if start + fields[-1] > len(view):
        raise FrameError(f"frame at byte {pos} claims {fields[-1]} bytes, past the body's end")
    return fields, start


def encode_batch(payloads: list[bytes]) -> bytes:
    return b"".join(BATCH_HEADER.pack(len(p)) + p for p in payloads)


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
        (length,), start = _frame_at(view, pos, BATCH_HEADER)
        pos = start + length
        payloads.append(bytes(view[start:pos]))
        if not len(payloads) % DECODE_YIELD_FRAMES:
            await asyncio.sleep(0)
    return payloads


def range_pieces(frames: Iterable[tuple[int, bytes]]) -> Iterator[bytes]:
    """The range frames of (entry id, payload) pairs as header and payload pieces: a reply
    writes them as they come, without copying the payloads."""
    for entry_id, payload in frames:
        yield RANGE_HEADER.pack(entry_id, len(payload))
        yield payload


def encode_range_frame(entry_id: int, payload: bytes) -> bytes:
    return b"".join(range_pieces([(entry_id, payload)]))


def decode_range(body: bytes) -> Iterator[tuple[int, bytes]]:
    """The (entry id, payload) pairs of a range reply; the whole frames before a bad one come
    out before its FrameError."""
    view = memoryview(body)
    pos = 0
    while pos < len(view):
        (entry_id, length), start = _frame_at(view, pos, RANGE_HEADER)
        pos = start + length
        yield entry_id, bytes(view[start:pos])


def stream_pieces(frames: Iterable[tuple[Position, bytes]]) -> Iterator[bytes]:
    """The stream frames of (position, payload) pairs as header and payload pieces, as
    ``range_pieces``."""
    for position, payload in frames:
        yield STREAM_HEADER.pack(position.ledger_id, position.entry_id, len(payload))
        yield payload


def encode_stream_frame(position: Position, payload: bytes) -> bytes:
    return b"".join(stream_pieces([(position, payload)]))


def decode_stream_frames(body: bytes) -> list[tuple[Position, bytes]]:
    """The (position, payload) pairs of a stream or cursor read's reply."""
    view = memoryview(body)
    frames = []
    pos = 0
    while pos < len(view):
        (ledger_id, entry_id, length), start = _frame_at(view, pos, STREAM_HEADER)
        pos = start + length
        frames.append((Position(ledger_id, entry_id), bytes(view[start:pos])))
    return frames


# --- what an add's reply says of its batch ------------------------------------------------------


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
