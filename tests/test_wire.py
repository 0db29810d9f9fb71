"""The wire format's frames (node/wire.py): each frame's round trip, and bodies cut
short or claiming more bytes than they hold, which raise FrameError and never decode to a
short payload; over HTTP, such bodies get a 400 JSON error and the node keeps serving.
(The batch and range round trips and cuts are in tests/storage/test_formats.py.)"""

from __future__ import annotations

import asyncio
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node import wire
from node.http.fastlane import SERVER_HEADER as FAST_LANE_SERVER
from node.streams.model import Position
from tests.http.test_fastlane import Conn

PAYLOADS = st.binary(max_size=300)
IDS = st.integers(0, (1 << 64) - 1)
STREAM_FRAMES = st.lists(st.tuples(st.builds(Position, IDS, IDS), PAYLOADS), max_size=20)
U32_MAX = (1 << 32) - 1


def _stream_body(items: list[tuple[Position, bytes]]) -> bytes:
    return b"".join(wire.encode_stream_frame(p, payload) for p, payload in items)


def _decode_batch(body: bytes) -> list[bytes]:
    return asyncio.run(wire.decode_batch(body, 1 << 30))


# Each frame: its header, and a decoder that reads a whole body (a list, not a generator).
DECODERS: dict[str, tuple[struct.Struct, Callable[[bytes], list[Any]]]] = {
    "batch": (wire.BATCH_HEADER, _decode_batch),
    "range": (wire.RANGE_HEADER, lambda body: list(wire.decode_range(body))),
    "stream": (wire.STREAM_HEADER, wire.decode_stream_frames),
}


def _bodies(kind: str, payloads: list[bytes]) -> tuple[bytes, list[int]]:
    """A body of ``payloads`` in the frame of ``kind`` (ids 0, 1, ...), and where each of its
    frames starts."""
    if kind == "batch":
        pieces = [wire.encode_batch([p]) for p in payloads]
    elif kind == "range":
        pieces = [wire.encode_range_frame(i, p) for i, p in enumerate(payloads)]
    else:
        pieces = [wire.encode_stream_frame(Position(7, i), p) for i, p in enumerate(payloads)]
    starts = [sum(len(piece) for piece in pieces[:i]) for i in range(len(pieces))]
    return b"".join(pieces), starts


@given(items=STREAM_FRAMES)
def test_stream_round_trip(items: list[tuple[Position, bytes]]) -> None:
    body = _stream_body(items)
    assert len(body) == sum(wire.STREAM_HEADER.size + len(p) for _, p in items)
    assert wire.decode_stream_frames(body) == items
    assert b"".join(wire.stream_pieces(items)) == body  # what a read's reply writes


@given(items=STREAM_FRAMES.filter(bool), data=st.data())
def test_stream_cut_inside_a_frame_raises_frame_error(
    items: list[tuple[Position, bytes]], data: st.DataObject
) -> None:
    body = _stream_body(items)
    ends = {0}
    for _, payload in items:
        ends.add(max(ends) + wire.STREAM_HEADER.size + len(payload))
    cut = data.draw(st.integers(1, len(body) - 1).filter(lambda c: c not in ends))
    with pytest.raises(wire.FrameError):
        wire.decode_stream_frames(body[:cut])


@pytest.mark.parametrize("kind", DECODERS)
@given(payloads=st.lists(PAYLOADS, min_size=1, max_size=10), data=st.data())
def test_a_frame_claiming_past_the_body_raises_frame_error(
    kind: str, payloads: list[bytes], data: st.DataObject
) -> None:
    """One frame's length made larger than what is left of the body, up to u32's maximum:
    a FrameError, not a payload that takes the next frames' bytes or stops at the end."""
    header, decode = DECODERS[kind]
    body, starts = _bodies(kind, payloads)
    victim = data.draw(st.integers(0, len(payloads) - 1))
    at = starts[victim]
    left = len(body) - at - header.size
    claimed = data.draw(st.integers(left + 1, U32_MAX))
    fields = header.unpack_from(body, at)
    hostile = bytearray(body)
    header.pack_into(hostile, at, *fields[:-1], claimed)
    with pytest.raises(wire.FrameError, match="past the body's end"):
        decode(bytes(hostile))


@pytest.mark.parametrize("kind", DECODERS)
def test_a_header_cut_short_raises_frame_error(kind: str) -> None:
    header, decode = DECODERS[kind]
    body, _ = _bodies(kind, [b"abc"])
    for cut in range(1, header.size):
        with pytest.raises(wire.FrameError, match="truncated frame header"):
            decode(body + body[:cut])


def test_the_wire_module_imports_without_aiohttp() -> None:
    """Benches and test clients decode with this module: it must not pull in the server."""
    code = "import sys, node.wire; print('aiohttp' in sys.modules)"
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert found.strip() == "False"


# --- over HTTP ---------------------------------------------------------------------------------

STREAM = "hostile"
APPEND = f"/api/v1/streams/{STREAM}/entries"
GOOD = wire.encode_batch([b"one", b"two"])
HOSTILE_BATCHES = {
    "header cut short": b"\x00\x00",
    "frame past the end": wire.BATCH_HEADER.pack(100) + b"short",
    "u32 max length": wire.BATCH_HEADER.pack(U32_MAX) + b"x" * 5,
    "good frames, then one cut short": GOOD + b"\x00",
    "good frames, then one past the end": GOOD + wire.BATCH_HEADER.pack(U32_MAX),
}


def _request(method: str, path: str, body: bytes = b"", content_type: str = "") -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: localhost", f"Content-Length: {len(body)}"]
    if content_type:
        head.append(f"Content-Type: {content_type}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


@pytest.mark.parametrize("through", ["fast lane", "aiohttp"])
async def test_hostile_batch_bodies_get_400_and_the_node_keeps_serving(
    client: Any, through: str
) -> None:
    """Each hostile body on one keep-alive connection, through the fast lane (a connection
    that starts with adds) and through aiohttp (one that starts with a GET, handed over for
    good): 400 invalid_frame as JSON, nothing appended, and the connection and node serve on."""
    r = await client.put(f"/api/v1/streams/{STREAM}", json={})
    assert r.status == 201, await r.text()
    conn = Conn(*await asyncio.open_connection(client.host, client.port))
    try:
        if through == "aiohttp":
            await conn.send(_request("GET", "/heartbeat"))
            assert (await conn.answer())[0] == 200
        for name, body in HOSTILE_BATCHES.items():
            await conn.send(_request("POST", APPEND, body, wire.BATCH_CONTENT_TYPE))
            status, headers, error = await conn.answer()
            assert status == 400, (name, error)
            lane = headers["server"] == FAST_LANE_SERVER.decode()
            assert lane == (through == "fast lane"), headers["server"]
            assert set(error) == {"code", "message"} and error["code"] == "invalid_frame", name
        # The stream's own read format is no body for an add: 415, as for any other type.
        stream_body = wire.encode_stream_frame(Position(0, 0), b"x")
        await conn.send(_request("POST", APPEND, stream_body, wire.STREAM_CONTENT_TYPE))
        status, _, error = await conn.answer()
        assert status == 415 and error["code"] == "unsupported_media_type"
        await conn.send(_request("POST", APPEND, GOOD, wire.BATCH_CONTENT_TYPE))
        assert (await conn.answer())[0] == 201
    finally:
        conn.writer.close()
        await conn.writer.wait_closed()
    r = await client.get(APPEND, params={"limit": "100"})
    assert r.status == 200
    assert r.headers["Content-Type"] == wire.STREAM_CONTENT_TYPE
    found = wire.decode_stream_frames(await r.read())
    assert [payload for _, payload in found] == [b"one", b"two"]  # the good batch alone
