"""What the crash tests' clients share: content types, the exceptions that mean a reply was
lost to the kill, and reads of what the node holds after a restart."""

from __future__ import annotations

import urllib.error
import urllib.request

import aiohttp

from node.streams.model import Position
from node.wire import decode_range, decode_stream_frames
from tests.harness.node import NodeProcess

OCTET = {"Content-Type": "application/octet-stream"}
BATCH = {"Content-Type": "application/x-entry-batch"}
# A request that ends in one of these got no answer: it may or may not have taken effect.
REPLY_LOST = (TimeoutError, aiohttp.ClientError, ConnectionError)


def http_status(node: NodeProcess, path: str) -> int:
    try:
        node.get_bytes(path)
    except urllib.error.HTTPError as e:
        return e.code
    return 200


def read_ledger(node: NodeProcess, ledger_id: int) -> dict[int, bytes]:
    """Every entry the node serves of the ledger, by id, through range reads (on from
    X-Next-Entry-Id while a reply is cut short by max_read_reply_bytes)."""
    found: dict[int, bytes] = {}
    following: str | None = "0"
    while following is not None:
        url = f"{node.url}/api/v1/ledgers/{ledger_id}/entries?from={following}"
        with urllib.request.urlopen(url, timeout=30) as r:
            found.update(decode_range(r.read()))
            following = r.headers.get("X-Next-Entry-Id")
    return found


def read_stream(node: NodeProcess, name: str, start: Position) -> list[tuple[Position, bytes]]:
    """Every entry from ``start`` to the end, a page at a time through ``?from=L:E``."""
    found: list[tuple[Position, bytes]] = []
    while True:
        body = node.get_bytes(f"/api/v1/streams/{name}/entries?from={start}&limit=1000")
        frames = decode_stream_frames(body)
        if not frames:
            return found
        found.extend(frames)
        last = frames[-1][0]
        start = Position(last.ledger_id, last.entry_id + 1)
