"""The stream, cursor and retention routes (docs/api.md) over the real HTTP server on
loopback: shapes, status codes, positions across rollovers, backlog, long polls, retention
runs, and bad input answered with 4xx JSON errors while the node keeps serving."""

from __future__ import annotations

import asyncio
import io
import struct
from pathlib import Path
from typing import Any

import pytest

from node.http.app import build_app
from node.settings import Settings
from node.wire import batch_positions, decode_stream_frames, encode_batch
from tests.harness.settings import make_settings

OCTET = {"Content-Type": "application/octet-stream"}
BATCH = {"Content-Type": "application/x-entry-batch"}
JSON = {"Content-Type": "application/json"}
FRAMES_TYPE = "application/x-stream-entries"
# Small ledgers that roll over at once: 3 entries each, no minimum age.
ROLLING = {"maxEntriesPerLedger": 3, "minLedgerRolloverTimeMinutes": 0}
POLICY_KEYS = {
    "minLedgerRolloverTimeMinutes",
    "maxLedgerRolloverTimeMinutes",
    "maxEntriesPerLedger",
    "maxSizePerLedgerMbytes",
    "retentionTimeInMinutes",
    "retentionSizeInMB",
    "messageTtlInSeconds",
    "offloadThresholdInBytes",
    "offloadThresholdInSeconds",
    "offloadDeletionLagInMillis",
}
NODE_DEFAULTS = {  # the settings' defaults (docs/api.md, "Streams")
    "minLedgerRolloverTimeMinutes": 10,
    "maxLedgerRolloverTimeMinutes": 240,
    "maxEntriesPerLedger": 50_000,
    "maxSizePerLedgerMbytes": 2048,
    "retentionTimeInMinutes": 72 * 60,
    "retentionSizeInMB": -1,
    "messageTtlInSeconds": 0,
    "offloadThresholdInBytes": -1,  # offload off (Pulsar's broker default)
    "offloadThresholdInSeconds": -1,
    "offloadDeletionLagInMillis": 4 * 3600 * 1000,  # Pulsar: 4 h
    "deduplication": False,  # exactly-once appends are asked for per stream
}
POLL_S = 5  # a long poll that should be answered by an append waits at most this long
NOT_YET_S = 0.05  # how long a long poll is watched to see that it does not return early
ENTRY = b"0123456789"  # ten bytes: backlog bytes are ten times the backlog entries


async def _error(response: Any, status: int, code: str) -> None:
    assert response.status == status, await response.text()
    assert response.headers["Content-Type"].startswith("application/json")
    body = await response.json()
    assert set(body) == {"code", "message"}, body
    assert body["code"] == code, body
    assert isinstance(body["message"], str) and body["message"]


async def _stream(client: Any, name: str = "orders", **policies: int) -> dict[str, Any]:
    r = await client.put(f"/api/v1/streams/{name}", json=policies)
    assert r.status in (200, 201), await r.text()
    return dict(await r.json())


async def _details(client: Any, name: str = "orders") -> dict[str, Any]:
    r = await client.get(f"/api/v1/streams/{name}")
    assert r.status == 200, await r.text()
    return dict(await r.json())


async def _append(client: Any, payload: bytes = ENTRY, name: str = "orders") -> str:
    r = await client.post(f"/api/v1/streams/{name}/entries", data=payload, headers=OCTET)
    assert r.status == 201, await r.text()
    body = await r.json()
    assert set(body) == {"position"}
    return str(body["position"])


async def _append_batch(client: Any, payloads: list[bytes], name: str = "orders") -> list[str]:
    r = await client.post(
        f"/api/v1/streams/{name}/entries", data=io.BytesIO(encode_batch(payloads)), headers=BATCH
    )
    assert r.status == 201, await r.text()
    body = await r.json()
    assert set(body) == {"firstPosition", "lastPosition"}
    return [str(p) for p in batch_positions(body)]


def _frames(body: bytes) -> list[tuple[str, bytes]]:
    """Strictly: whole frames only, nothing left over (else FrameError)."""
    return [(str(position), payload) for position, payload in decode_stream_frames(body)]


async def _read(client: Any, path: str) -> tuple[list[tuple[str, bytes]], str | None]:
    """The frames of a read and its X-Next-Position (None when nothing was read)."""
    r = await client.get(path)
    assert r.status == 200, await r.text()
    assert r.headers["Content-Type"] == FRAMES_TYPE
    return _frames(await r.read()), r.headers.get("X-Next-Position")


async def _cursor(client: Any, cursor: str = "c1", name: str = "orders") -> dict[str, Any]:
    r = await client.get(f"/api/v1/streams/{name}/cursors/{cursor}")
    assert r.status == 200, await r.text()
    return dict(await r.json())


async def _post_cursor(
    client: Any, action: str, position: str, cursor: str = "c1", name: str = "orders"
) -> dict[str, Any]:
    r = await client.post(
        f"/api/v1/streams/{name}/cursors/{cursor}/{action}", json={"position": position}
    )
    assert r.status == 200, await r.text()
    return dict(await r.json())


def _ledger(position: str) -> int:
    return int(position.split(":")[0])


def _check_cursor_shape(cursor: dict[str, Any]) -> None:
    assert set(cursor) == {
        "name",
        "markDeletePosition",
        "backlogEntries",
        "backlogBytes",
        "createdTime",
    }
    assert isinstance(cursor["name"], str)
    assert isinstance(cursor["markDeletePosition"], str | None)
    for key in ("backlogEntries", "backlogBytes", "createdTime"):
        assert type(cursor[key]) is int, (key, cursor)


# --- streams ---------------------------------------------------------------------------------


async def test_create_update_get_list_delete_a_stream(client: Any) -> None:
    r = await client.put("/api/v1/streams/orders", json={"maxEntriesPerLedger": 7})
    assert r.status == 201
    created = await r.json()
    assert set(created) == {
        "name", "createdTime", "policies", "replication", "owner", "ledgers", "entries",
        "bytes", "oldestDataTime", "cursors",
    }  # fmt: skip
    assert created["name"] == "orders" and type(created["createdTime"]) is int
    # No metadata store: the node's own ledgers, served here.
    assert created["replication"] == {"ensemble": 1, "writeQuorum": 1, "ackQuorum": 1}
    assert created["owner"] is None
    assert created["policies"] == {**NODE_DEFAULTS, "maxEntriesPerLedger": 7}
    assert created["ledgers"] == [] and created["cursors"] == []
    assert created["entries"] == 0 and created["bytes"] == 0 and created["oldestDataTime"] is None

    # Again: 200, and the policies are replaced (absent keys take the node's defaults).
    r = await client.put("/api/v1/streams/orders", json={"retentionSizeInMB": 5})
    assert r.status == 200
    updated = await r.json()
    assert updated["policies"] == {**NODE_DEFAULTS, "retentionSizeInMB": 5}
    assert updated["createdTime"] == created["createdTime"]
    r = await client.put("/api/v1/streams/events")  # no body: every default
    assert r.status == 201 and (await r.json())["policies"] == NODE_DEFAULTS
    assert (await _details(client))["policies"]["retentionSizeInMB"] == 5

    r = await client.get("/api/v1/streams")
    assert r.status == 200
    listing = await r.json()
    assert set(listing) == {"streams", "total", "offset", "limit"}
    assert [s["name"] for s in listing["streams"]] == ["events", "orders"]  # by name
    assert (listing["total"], listing["offset"], listing["limit"]) == (2, 0, 100)

    position = await _append(client)
    lid = _ledger(position)
    r = await client.delete("/api/v1/streams/orders")
    assert r.status == 204 and await r.read() == b""
    await _error(await client.get("/api/v1/streams/orders"), 404, "stream_not_found")
    await _error(await client.delete("/api/v1/streams/orders"), 404, "stream_not_found")
    await _error(await client.get(f"/api/v1/ledgers/{lid}"), 404, "ledger_not_found")
    listing = await (await client.get("/api/v1/streams")).json()
    assert [s["name"] for s in listing["streams"]] == ["events"]
    # The name can be used again, for a new, empty stream.
    assert (await _stream(client))["entries"] == 0


async def test_the_list_of_streams_comes_a_page_at_a_time(client: Any) -> None:
    """As /api/v1/status/streams: offset and limit (default 100, at most 1,000), in name
    order, with the total; 2,000 streams made one reply of 1.3 MB."""
    names = [f"s{i:03d}" for i in range(105)]
    for name in reversed(names):
        assert (await client.put(f"/api/v1/streams/{name}")).status == 201
    first = await (await client.get("/api/v1/streams")).json()
    assert (first["total"], first["offset"], first["limit"]) == (105, 0, 100)
    assert [s["name"] for s in first["streams"]] == names[:100]
    listed: list[str] = []
    while True:
        r = await client.get(f"/api/v1/streams?offset={len(listed)}&limit=40")
        page = await r.json()
        assert r.status == 200 and page["total"] == 105 and page["limit"] == 40
        if not page["streams"]:
            break
        listed += [s["name"] for s in page["streams"]]
    assert listed == names
    # The streams of a page are whole: the same as the stream's own route.
    page = await (await client.get("/api/v1/streams?offset=7&limit=1")).json()
    assert page["streams"] == [await _details(client, names[7])]
    for query, code in (
        ("limit=0", "invalid_limit"),
        ("limit=1001", "invalid_limit"),
        ("offset=-1", "invalid_id"),
        ("limit=x", "invalid_id"),
    ):
        await _error(await client.get(f"/api/v1/streams?{query}"), 400, code)


async def test_replication_is_refused_without_a_metadata_store(client: Any) -> None:
    three = {"ensemble": 3, "writeQuorum": 3, "ackQuorum": 2}
    r = await client.put("/api/v1/streams/orders", json={"replication": three})
    await _error(r, 422, "replication_off")
    assert "metadata_url" in (await r.json())["message"]
    await _error(await client.get("/api/v1/streams/orders"), 404, "stream_not_found")
    for bad in ({"ensemble": 0, "writeQuorum": 1, "ackQuorum": 1}, {"ensemble": 1}, 3):
        r = await client.put("/api/v1/streams/orders", json={"replication": bad})
        await _error(r, 400, "invalid_policy")  # malformed
    upside_down = {"ensemble": 2, "writeQuorum": 3, "ackQuorum": 1}
    r = await client.put("/api/v1/streams/orders", json={"replication": upside_down})
    await _error(r, 422, "replication_off")  # well formed: this node has none at all
    one = {"ensemble": 1, "writeQuorum": 1, "ackQuorum": 1}
    r = await client.put("/api/v1/streams/orders", json={"replication": one})
    assert r.status == 201 and (await r.json())["replication"] == one


async def test_appends_return_positions_and_roll_over(client: Any) -> None:
    await _stream(client, **ROLLING)
    first = await _append(client, b"a")
    l0 = _ledger(first)
    assert first == f"{l0}:0"
    assert await _append_batch(client, [b"bb", b"ccc"]) == [f"{l0}:1", f"{l0}:2"]
    rolled = await _append(client, b"dddd")  # the ledger holds maxEntriesPerLedger: a new one
    l1 = _ledger(rolled)
    assert l1 > l0 and rolled == f"{l1}:0"
    # A batch never splits: past the room left it goes whole into a new ledger, even past
    # the limit when it alone passes it; the next append rolls over.
    batch = await _append_batch(client, [b"e", b"f", b"g", b"h"])
    l2 = _ledger(batch[0])
    assert l2 > l1 and batch == [f"{l2}:{i}" for i in range(4)]
    l3 = _ledger(await _append(client, b"i"))
    assert l3 > l2

    details = await _details(client)
    ledgers = details["ledgers"]
    assert [x["ledgerId"] for x in ledgers] == [l0, l1, l2, l3]
    for item in ledgers:
        assert set(item) == {"ledgerId", "entries", "bytes", "createdTime", "closedTime"}
    assert [x["entries"] for x in ledgers] == [3, 1, 4, 1]
    assert [x["bytes"] for x in ledgers] == [6, 4, 4, 1]
    assert all(type(x["closedTime"]) is int for x in ledgers[:3])
    assert ledgers[3]["closedTime"] is None
    assert details["entries"] == 9 and details["bytes"] == 6 + 4 + 4 + 1
    assert details["oldestDataTime"] == ledgers[0]["createdTime"]
    # A rollover closes the old ledger; the stream's ledgers carry its name.
    for lid, state in ((l0, "closed"), (l1, "closed"), (l2, "closed"), (l3, "open")):
        meta = await (await client.get(f"/api/v1/ledgers/{lid}")).json()
        assert meta["state"] == state and meta["properties"] == {"stream": "orders"}


async def test_batches_are_bounded_in_entries(client: Any, settings: Settings) -> None:
    """One entry past max_entries_per_batch is refused whole, on a stream as on a ledger."""
    await _stream(client)
    largest = settings.max_entries_per_batch
    assert len(await _append_batch(client, [b""] * largest)) == largest
    lid = (await (await client.post("/api/v1/ledgers")).json())["ledgerId"]
    for path in ("/api/v1/streams/orders/entries", f"/api/v1/ledgers/{lid}/entries"):
        r = await client.post(path, data=encode_batch([b""] * (largest + 1)), headers=BATCH)
        await _error(r, 413, "too_many_entries")
    assert (await _details(client))["entries"] == largest
    assert (await (await client.get(f"/api/v1/ledgers/{lid}")).json())["entries"] == 0


async def test_reads_from_a_position_with_a_limit_across_ledgers(client: Any) -> None:
    await _stream(client, **ROLLING)
    positions = [await _append(client, bytes([65 + i]) * (i + 1)) for i in range(7)]
    payloads = [bytes([65 + i]) * (i + 1) for i in range(7)]
    l0, l1, l2 = (_ledger(positions[i]) for i in (0, 3, 6))
    expected = [
        f"{lid}:{eid}" for lid, count in ((l0, 3), (l1, 3), (l2, 1)) for eid in range(count)
    ]
    assert positions == expected

    everything, following = await _read(client, "/api/v1/streams/orders/entries")
    assert everything == list(zip(positions, payloads, strict=True))
    assert following == f"{l2}:1"
    frames, following = await _read(client, f"/api/v1/streams/orders/entries?from={l0}:2&limit=3")
    assert [p for p, _ in frames] == [f"{l0}:2", f"{l1}:0", f"{l1}:1"]
    assert following == f"{l1}:2"
    # One past a closed ledger's last entry (a previous read's X-Next-Position) is the next
    # ledger's first entry.
    frames, _ = await _read(client, f"/api/v1/streams/orders/entries?from={l0}:3&limit=1")
    assert [p for p, _ in frames] == [f"{l1}:0"]
    # At the end: nothing, at once, and no next position.
    frames, following = await _read(client, f"/api/v1/streams/orders/entries?from={l2}:1")
    assert frames == [] and following is None
    frames, _ = await _read(client, "/api/v1/streams/orders/entries?limit=10000")
    assert len(frames) == 7


async def test_long_poll_read_is_answered_when_an_append_arrives(client: Any) -> None:
    await _stream(client, **ROLLING)
    # On an empty stream (no ledger yet), without a position.
    poll = asyncio.create_task(client.get("/api/v1/streams/orders/entries?waitMs=5000"))
    await asyncio.sleep(NOT_YET_S)
    assert not poll.done()
    first = await _append(client, b"first")
    r = await asyncio.wait_for(poll, POLL_S)
    assert _frames(await r.read()) == [(first, b"first")]
    following = r.headers["X-Next-Position"]

    # Tailing from the previous read's next position, also across a rollover: the ledger is
    # full but still open when the poll starts; the append that wakes it opens a new one.
    for payload in (b"second", b"third", b"fourth"):
        url = f"/api/v1/streams/orders/entries?from={following}&waitMs=5000"
        poll = asyncio.create_task(client.get(url))
        await asyncio.sleep(NOT_YET_S)
        assert not poll.done()
        position = await _append(client, payload)
        r = await asyncio.wait_for(poll, POLL_S)
        assert _frames(await r.read()) == [(position, payload)]
        following = r.headers["X-Next-Position"]
    assert _ledger(position) > _ledger(first)

    # Nothing arrives: answered empty after waitMs.
    started = asyncio.get_running_loop().time()
    frames, nothing = await _read(
        client, f"/api/v1/streams/orders/entries?from={following}&waitMs=100"
    )
    assert frames == [] and nothing is None
    assert asyncio.get_running_loop().time() - started >= 0.1


async def test_long_poll_ends_with_404_when_the_stream_is_deleted(client: Any) -> None:
    await _stream(client)
    poll = asyncio.create_task(client.get("/api/v1/streams/orders/entries?waitMs=5000"))
    await asyncio.sleep(NOT_YET_S)
    assert (await client.delete("/api/v1/streams/orders")).status == 204
    await _error(await asyncio.wait_for(poll, POLL_S), 404, "stream_not_found")


# --- cursors ---------------------------------------------------------------------------------


async def test_an_empty_streams_cursor_names_no_ledger_and_errors_name_the_asked_entry(
    client: Any,
) -> None:
    """Once, "0:-1" named an unrelated ledger 0; a reset to L:999 said "entry
    998 of ledger L does not exist yet"."""
    unrelated = (await (await client.post("/api/v1/ledgers")).json())["ledgerId"]
    await _stream(client)
    r = await client.put("/api/v1/streams/orders/cursors/c1", json={"start": "earliest"})
    created = await r.json()
    _check_cursor_shape(created)
    assert created["markDeletePosition"] is None  # nothing to acknowledge yet
    assert (await _details(client))["cursors"][0]["markDeletePosition"] is None
    summary = await (await client.get("/api/v1/status/summary")).json()
    assert summary["streams"][0]["cursors"][0]["markDeletePosition"] is None
    first = await _append(client)
    ledger = _ledger(first)
    assert ledger != unrelated
    assert (await _cursor(client))["markDeletePosition"] == f"{ledger}:-1"
    summary = await (await client.get("/api/v1/status/summary")).json()
    assert summary["streams"][0]["cursors"][0]["markDeletePosition"] == f"{ledger}:-1"

    for action, asked in (("reset", f"{ledger}:999"), ("ack", f"{ledger}:999")):
        r = await client.post(
            f"/api/v1/streams/orders/cursors/c1/{action}", json={"position": asked}
        )
        await _error(r, 422, "invalid_position")
        message = (await r.json())["message"]
        assert f"entry 999 of ledger {ledger} does not exist yet" in message, message
        assert "its last entry is 0" in message
    r = await client.put("/api/v1/streams/orders/cursors/c2", json={"start": f"{ledger}:7"})
    await _error(r, 422, "invalid_position")
    assert f"entry 7 of ledger {ledger} does not exist yet" in (await r.json())["message"]
    r = await client.post(
        "/api/v1/streams/orders/cursors/c1/reset", json={"position": f"{ledger}:-1"}
    )
    await _error(r, 422, "invalid_position")
    assert "entry ids start at 0" in (await r.json())["message"]


async def test_cursor_lifecycle_reads_acks_resets_and_backlog(client: Any) -> None:
    await _stream(client, **ROLLING)
    positions = [await _append(client) for _ in range(5)]
    l0, l1 = _ledger(positions[0]), _ledger(positions[3])
    assert positions[3] == f"{l1}:0"

    r = await client.put("/api/v1/streams/orders/cursors/c1", json={"start": "earliest"})
    assert r.status == 201
    c1 = await r.json()
    _check_cursor_shape(c1)
    assert c1["name"] == "c1" and c1["markDeletePosition"] == f"{l0}:-1"
    assert (c1["backlogEntries"], c1["backlogBytes"]) == (5, 5 * len(ENTRY))
    r = await client.put("/api/v1/streams/orders/cursors/c1", json={"start": "latest"})
    assert r.status == 200 and await r.json() == c1  # exists: unchanged
    r = await client.put("/api/v1/streams/orders/cursors/c2", json={"start": "latest"})
    assert r.status == 201
    c2 = await r.json()
    assert c2["markDeletePosition"] == f"{l1}:1" and c2["backlogEntries"] == 0
    r = await client.put("/api/v1/streams/orders/cursors/c3", json={"start": f"{l0}:2"})
    c3 = await r.json()
    assert c3["markDeletePosition"] == f"{l0}:1"
    assert (c3["backlogEntries"], c3["backlogBytes"]) == (3, 3 * len(ENTRY))
    r = await client.put("/api/v1/streams/orders/cursors/c4")  # no body: latest
    assert r.status == 201 and (await r.json())["backlogEntries"] == 0

    # Reading a cursor's entries does not acknowledge them.
    entries_url = "/api/v1/streams/orders/cursors/c1/entries"
    for _ in range(2):
        frames, following = await _read(client, f"{entries_url}?limit=2")
        assert frames == [(positions[0], ENTRY), (positions[1], ENTRY)]
        assert following == f"{l0}:2"
    assert (await _cursor(client))["backlogEntries"] == 5

    acked = await _post_cursor(client, "ack", positions[1])
    _check_cursor_shape(acked)
    assert acked["markDeletePosition"] == positions[1]
    assert (acked["backlogEntries"], acked["backlogBytes"]) == (3, 3 * len(ENTRY))
    frames, _ = await _read(client, entries_url)
    assert [p for p, _ in frames] == positions[2:]  # across the ledger boundary
    acked = await _post_cursor(client, "ack", positions[2])  # a ledger's last entry
    assert acked["backlogEntries"] == 2
    frames, _ = await _read(client, entries_url)
    assert [p for p, _ in frames] == positions[3:]
    acked = await _post_cursor(client, "ack", positions[4])
    assert (acked["backlogEntries"], acked["backlogBytes"]) == (0, 0)
    # An acknowledgment never moves the mark-delete position back.
    assert (await _post_cursor(client, "ack", positions[0]))["markDeletePosition"] == positions[4]
    frames, following = await _read(client, f"{entries_url}?waitMs=50")
    assert frames == [] and following is None

    # A cursor's long poll is answered by the next append.
    poll = asyncio.create_task(client.get(f"{entries_url}?waitMs=5000"))
    await asyncio.sleep(NOT_YET_S)
    assert not poll.done()
    sixth = await _append(client)
    r = await asyncio.wait_for(poll, POLL_S)
    assert _frames(await r.read()) == [(sixth, ENTRY)]
    assert (await _cursor(client))["backlogEntries"] == 1

    # Reset: back to the first entry (everything is backlog again), then forward.
    reset = await _post_cursor(client, "reset", positions[0])
    _check_cursor_shape(reset)
    assert reset["markDeletePosition"] == f"{l0}:-1"
    assert (reset["backlogEntries"], reset["backlogBytes"]) == (6, 6 * len(ENTRY))
    assert sixth == f"{l1}:2"
    reset = await _post_cursor(client, "reset", sixth)
    assert reset["markDeletePosition"] == f"{l1}:1"
    assert reset["backlogEntries"] == 1
    frames, _ = await _read(client, entries_url)
    assert frames == [(sixth, ENTRY)]

    cursors = (await _details(client))["cursors"]
    assert [c["name"] for c in cursors] == ["c1", "c2", "c3", "c4"]
    assert [c["backlogEntries"] for c in cursors] == [1, 1, 4, 1]
    for cursor in cursors:
        _check_cursor_shape(cursor)

    r = await client.delete("/api/v1/streams/orders/cursors/c2")
    assert r.status == 204
    await _error(await client.get("/api/v1/streams/orders/cursors/c2"), 404, "cursor_not_found")
    await _error(await client.delete("/api/v1/streams/orders/cursors/c2"), 404, "cursor_not_found")
    assert [c["name"] for c in (await _details(client))["cursors"]] == ["c1", "c3", "c4"]


async def test_a_cursor_at_a_position_of_an_empty_stream_is_refused(client: Any) -> None:
    await _stream(client)
    r = await client.put("/api/v1/streams/orders/cursors/c", json={"start": "0:0"})
    await _error(r, 422, "invalid_position")
    await _error(await client.get("/api/v1/streams/orders/cursors/c"), 404, "cursor_not_found")
    for start in ("earliest", "latest"):  # what an empty stream can start from
        r = await client.put(f"/api/v1/streams/orders/cursors/{start}", json={"start": start})
        assert r.status == 201, await r.text()
    position = await _append(client)
    for start in ("earliest", "latest"):  # both read what comes next
        frames, _ = await _read(client, f"/api/v1/streams/orders/cursors/{start}/entries")
        assert frames == [(position, ENTRY)]


async def test_streams_and_cursors_survive_a_restart(tmp_path: Path, aiohttp_client: Any) -> None:
    settings = make_settings(tmp_path / "data")
    client = await aiohttp_client(build_app(settings))
    await _stream(client, **ROLLING)
    positions = [await _append(client, bytes([i])) for i in range(5)]
    await client.put("/api/v1/streams/orders/cursors/c1", json={"start": "earliest"})
    await _post_cursor(client, "ack", positions[3])
    before = await _details(client)
    await client.close()

    client = await aiohttp_client(build_app(settings))
    after = await _details(client)
    assert after["ledgers"][:-1] == before["ledgers"][:-1]
    assert after["ledgers"][-1]["entries"] == before["ledgers"][-1]["entries"]
    assert after["cursors"] == before["cursors"]
    frames, _ = await _read(client, "/api/v1/streams/orders/cursors/c1/entries")
    assert frames == [(positions[4], bytes([4]))]
    assert _ledger(await _append(client)) == _ledger(positions[4])  # same ledger, reopened


# --- retention -------------------------------------------------------------------------------


async def test_retention_run_deletes_acknowledged_closed_ledgers_oldest_first(
    client: Any,
) -> None:
    # Retention by size 0 and unlimited time: every acknowledged closed ledger may go.
    await _stream(client, **ROLLING, retentionTimeInMinutes=-1, retentionSizeInMB=0)
    positions = [await _append(client) for _ in range(7)]
    l0, l1, l2 = (_ledger(positions[i]) for i in (0, 3, 6))
    await client.put("/api/v1/streams/orders/cursors/c1", json={"start": "earliest"})
    await _stream(client, "kept")  # the node's defaults: 72 h, unlimited size
    await _append(client, name="kept")

    # Everything is backlog: nothing to delete.
    r = await client.post("/api/v1/retention/run?dryRun=true")
    assert r.status == 200 and await r.json() == {"dryRun": True, "streams": {}}

    await _post_cursor(client, "ack", positions[4])  # into the middle of the second ledger
    expected = {"orders": [{"ledgerId": l0, "reason": "size", "bytes": 3 * len(ENTRY)}]}
    r = await client.post("/api/v1/retention/run?dryRun=true")
    assert await r.json() == {"dryRun": True, "streams": expected}
    assert len((await _details(client))["ledgers"]) == 3  # a dry run deletes nothing
    r = await client.post("/api/v1/retention/run")
    assert r.status == 200 and await r.json() == {"dryRun": False, "streams": expected}
    details = await _details(client)
    assert [x["ledgerId"] for x in details["ledgers"]] == [l1, l2]
    assert details["entries"] == 4 and details["bytes"] == 4 * len(ENTRY)
    await _error(await client.get(f"/api/v1/ledgers/{l0}"), 404, "ledger_not_found")
    frames, _ = await _read(client, "/api/v1/streams/orders/entries")  # the first is l1's
    assert [p for p, _ in frames] == positions[3:]
    # A position in the deleted ledger reads on from the first kept (its entries are gone).
    assert await _read(client, f"/api/v1/streams/orders/entries?from={l0}:0") == (frames, _)
    cursor = await _cursor(client)
    assert (cursor["backlogEntries"], cursor["backlogBytes"]) == (2, 2 * len(ENTRY))
    r = await client.post("/api/v1/retention/run")
    assert await r.json() == {"dryRun": False, "streams": {}}

    # All acknowledged: the closed ledger goes, never the one taking appends.
    await _post_cursor(client, "ack", positions[6])
    r = await client.post("/api/v1/retention/run")
    assert (await r.json())["streams"] == {
        "orders": [{"ledgerId": l1, "reason": "size", "bytes": 3 * len(ENTRY)}]
    }
    assert [x["ledgerId"] for x in (await _details(client))["ledgers"]] == [l2]
    assert (await _cursor(client))["backlogEntries"] == 0


async def test_retention_by_time_and_message_ttl(client: Any) -> None:
    # No cursor: every closed ledger is past a retention time of 0 once a millisecond passed.
    await _stream(client, "events", **ROLLING, retentionTimeInMinutes=0)
    positions = [await _append(client, name="events") for _ in range(4)]
    await asyncio.sleep(0.01)
    r = await client.post("/api/v1/retention/run")
    deleted = (await r.json())["streams"]
    assert deleted == {
        "events": [{"ledgerId": _ledger(positions[0]), "reason": "time", "bytes": 30}]
    }

    # A message TTL moves cursors past closed ledgers older than it (nothing is deleted:
    # retention is unlimited).
    ttl_s = 1
    await _stream(client, **ROLLING, messageTtlInSeconds=ttl_s, retentionTimeInMinutes=-1)
    positions = [await _append(client) for _ in range(4)]
    await client.put("/api/v1/streams/orders/cursors/c1", json={"start": "earliest"})
    assert (await _cursor(client))["backlogEntries"] == 4
    r = await client.post("/api/v1/retention/run?dryRun=true")
    assert (await _cursor(client))["backlogEntries"] == 4  # a dry run moves no cursor
    await asyncio.sleep(ttl_s + 0.1)
    r = await client.post("/api/v1/retention/run")
    assert "orders" not in (await r.json())["streams"]
    cursor = await _cursor(client)
    assert cursor["markDeletePosition"] == positions[2]
    assert cursor["backlogEntries"] == 1


# --- bad input -------------------------------------------------------------------------------


BAD_REQUESTS: list[tuple[str, str, Any, int, str]] = [
    # method, path ({l0}/{l1}: the stream's ledgers), JSON body, status, code
    ("get", "/api/v1/streams/nope", None, 404, "stream_not_found"),
    ("delete", "/api/v1/streams/nope", None, 404, "stream_not_found"),
    ("get", "/api/v1/streams/nope/entries", None, 404, "stream_not_found"),
    ("get", "/api/v1/streams/nope/entries?waitMs=1000", None, 404, "stream_not_found"),
    ("put", "/api/v1/streams/nope/cursors/c1", None, 404, "stream_not_found"),
    ("get", "/api/v1/streams/nope/cursors/c1", None, 404, "stream_not_found"),
    ("post", "/api/v1/streams/nope/cursors/c1/ack", {"position": "0:0"}, 404, "stream_not_found"),
    ("get", "/api/v1/streams/orders/cursors/nope", None, 404, "cursor_not_found"),
    ("delete", "/api/v1/streams/orders/cursors/nope", None, 404, "cursor_not_found"),
    ("get", "/api/v1/streams/orders/cursors/nope/entries", None, 404, "cursor_not_found"),
    ("post", "/api/v1/streams/orders/cursors/nope/ack", {"position": "{l0}:0"}, 404,
     "cursor_not_found"),
    ("post", "/api/v1/streams/orders/cursors/nope/reset", {"position": "{l0}:0"}, 404,
     "cursor_not_found"),
    # malformed positions
    ("get", "/api/v1/streams/orders/entries?from=abc", None, 400, "invalid_position"),
    ("get", "/api/v1/streams/orders/entries?from=5", None, 400, "invalid_position"),
    ("get", "/api/v1/streams/orders/entries?from=1:x", None, 400, "invalid_position"),
    # Arabic-Indic digits: str.isdigit() takes them and int() reads them as 1:0
    ("get", "/api/v1/streams/orders/entries?from=%D9%A1:%D9%A0", None, 400, "invalid_position"),
    ("post", "/api/v1/streams/orders/cursors/c1/ack", {"position": "\u0661:\u0660"}, 400,
     "invalid_position"),
    ("get", "/api/v1/streams/orders/entries?from=-1:0", None, 400, "invalid_position"),
    ("get", "/api/v1/streams/orders/entries?from={l0}:-2", None, 400, "invalid_position"),
    ("get", "/api/v1/streams/orders/entries?from={l0}:", None, 400, "invalid_position"),
    ("get", "/api/v1/streams/orders/entries?from=9223372036854775808:0", None, 422,
     "invalid_position"),  # well formed, but no stream has such a ledger
    ("get", "/api/v1/streams/orders/entries?from=" + "9" * 5000 + ":0", None, 400,
     "invalid_position"),
    ("post", "/api/v1/streams/orders/cursors/c1/ack", {"position": "x"}, 400, "invalid_position"),
    ("post", "/api/v1/streams/orders/cursors/c1/reset", {"position": "1:2:3"}, 400,
     "invalid_position"),
    ("put", "/api/v1/streams/orders/cursors/c9", {"start": "first"}, 400, "invalid_position"),
    # positions out of range
    ("get", "/api/v1/streams/orders/entries?from=999:0", None, 422, "invalid_position"),
    ("get", "/api/v1/streams/orders/entries?from={l1}:5", None, 422, "invalid_position"),
    ("get", "/api/v1/streams/orders/entries?from={l0}:4", None, 422, "invalid_position"),
    ("post", "/api/v1/streams/orders/cursors/c1/ack", {"position": "{l1}:1"}, 422,
     "invalid_position"),
    ("post", "/api/v1/streams/orders/cursors/c1/ack", {"position": "{l0}:3"}, 422,
     "invalid_position"),
    ("post", "/api/v1/streams/orders/cursors/c1/ack", {"position": "999:0"}, 422,
     "invalid_position"),
    ("post", "/api/v1/streams/orders/cursors/c1/reset", {"position": "{l1}:2"}, 422,
     "invalid_position"),
    ("post", "/api/v1/streams/orders/cursors/c1/reset", {"position": "999:0"}, 422,
     "invalid_position"),
    ("put", "/api/v1/streams/orders/cursors/c9", {"start": "{l1}:2"}, 422, "invalid_position"),
    ("put", "/api/v1/streams/orders/cursors/c9", {"start": "999:0"}, 422, "invalid_position"),
    # invalid policies
    ("put", "/api/v1/streams/orders", {"maxEntriesPerLedger": 0}, 400, "invalid_policy"),
    ("put", "/api/v1/streams/orders", {"maxSizePerLedgerMbytes": -1}, 400, "invalid_policy"),
    ("put", "/api/v1/streams/orders", {"retentionTimeInMinutes": -2}, 400, "invalid_policy"),
    ("put", "/api/v1/streams/orders", {"retentionSizeInMB": -5}, 400, "invalid_policy"),
    ("put", "/api/v1/streams/orders", {"messageTtlInSeconds": -1}, 400, "invalid_policy"),
    ("put", "/api/v1/streams/orders", {"minLedgerRolloverTimeMinutes": -1}, 400,
     "invalid_policy"),
    ("put", "/api/v1/streams/orders", {"maxEntriesPerLedger": "5"}, 400, "invalid_policy"),
    ("put", "/api/v1/streams/orders", {"maxEntriesPerLedger": 1.5}, 400, "invalid_policy"),
    ("put", "/api/v1/streams/orders", {"maxEntriesPerLedger": True}, 400, "invalid_policy"),
    ("put", "/api/v1/streams/orders", {"maxEntriesPerLedger": None}, 400, "invalid_policy"),
    ("put", "/api/v1/streams/orders", {"maxEntriesPerLedger": [5]}, 400, "invalid_policy"),
    ("put", "/api/v1/streams/orders", {"retentionTime": 5}, 400, "invalid_policy"),
    ("put", "/api/v1/streams/orders", {"maxEntriesPerLedger": 10**30}, 400, "invalid_policy"),
    ("put", "/api/v1/streams/orders", {"retentionSizeInMB": 1 << 63}, 400, "invalid_policy"),
    # each value allowed, but not together: 422
    ("put", "/api/v1/streams/orders",
     {"minLedgerRolloverTimeMinutes": 20, "maxLedgerRolloverTimeMinutes": 10}, 422,
     "invalid_policy"),
    ("put", "/api/v1/streams/orders", {"minLedgerRolloverTimeMinutes": 300}, 422,
     "invalid_policy"),  # above the default maximum of 240
    ("put", "/api/v1/streams/orders", ["maxEntriesPerLedger"], 400, "invalid_body"),
    # invalid names
    ("put", "/api/v1/streams/-orders", None, 400, "invalid_name"),
    ("put", "/api/v1/streams/.orders", None, 400, "invalid_name"),
    ("put", "/api/v1/streams/or%20ders", None, 400, "invalid_name"),
    ("put", "/api/v1/streams/or%00ders", None, 400, "invalid_name"),
    ("put", "/api/v1/streams/" + "o" * 256, None, 400, "invalid_name"),
    ("put", "/api/v1/streams/orders/cursors/-c", None, 400, "invalid_name"),
    ("put", "/api/v1/streams/orders/cursors/" + "c" * 256, None, 400, "invalid_name"),
    # bodies
    ("put", "/api/v1/streams/orders/cursors/c9", {"start": 5}, 400, "invalid_body"),
    ("put", "/api/v1/streams/orders/cursors/c9", {"start": "earliest", "x": 1}, 400,
     "invalid_body"),
    ("put", "/api/v1/streams/orders/cursors/c9", "earliest", 400, "invalid_body"),
    ("post", "/api/v1/streams/orders/cursors/c1/ack", {"position": 5}, 400, "invalid_body"),
    ("post", "/api/v1/streams/orders/cursors/c1/ack", {}, 400, "invalid_body"),
    ("post", "/api/v1/streams/orders/cursors/c1/ack", {"position": "{l0}:0", "x": 1}, 400,
     "invalid_body"),
    ("post", "/api/v1/streams/orders/cursors/c1/reset", None, 400, "invalid_body"),
    # limits
    ("get", "/api/v1/streams/orders/entries?limit=0", None, 400, "invalid_limit"),
    ("get", "/api/v1/streams/orders/entries?limit=10001", None, 400, "invalid_limit"),
    ("get", "/api/v1/streams/orders/entries?limit=-1", None, 400, "invalid_id"),
    ("get", "/api/v1/streams/orders/entries?limit=ten", None, 400, "invalid_id"),
    ("get", "/api/v1/streams/orders/entries?waitMs=60001", None, 400, "invalid_timeout"),
    ("get", "/api/v1/streams/orders/entries?waitMs=-1", None, 400, "invalid_id"),
    ("get", "/api/v1/streams/orders/cursors/c1/entries?limit=0", None, 400, "invalid_limit"),
    ("get", "/api/v1/streams/orders/cursors/c1/entries?waitMs=1e3", None, 400, "invalid_id"),
    ("post", "/api/v1/retention/run?dryRun=yes", None, 400, "invalid_query"),
    ("patch", "/api/v1/streams/orders", None, 405, "method_not_allowed"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "body", "status", "code"), BAD_REQUESTS)
async def test_bad_requests_get_json_errors(
    client: Any, method: str, path: str, body: Any, status: int, code: str
) -> None:
    await _stream(client, **ROLLING)
    positions = [await _append(client) for _ in range(4)]  # l0: 0..2, l1: 0
    await client.put("/api/v1/streams/orders/cursors/c1", json={"start": "earliest"})
    before = await _details(client)
    l0, l1 = _ledger(positions[0]), _ledger(positions[3])
    path = path.replace("{l0}", str(l0)).replace("{l1}", str(l1))
    if isinstance(body, dict):
        body = {k: v.replace("{l0}", str(l0)).replace("{l1}", str(l1)) if isinstance(v, str)
                else v for k, v in body.items()}  # fmt: skip
    r = await getattr(client, method)(path, **({} if body is None else {"json": body}))
    await _error(r, status, code)
    # Nothing changed, and the node keeps serving.
    assert await _details(client) == before
    assert (await client.get("/api/v1/streams")).status == 200
    assert await _append(client) == f"{l1}:1"


async def test_bad_appends_get_json_errors(client: Any) -> None:
    await _stream(client)
    url = "/api/v1/streams/orders/entries"
    for content_type in ("text/plain", "application/json", "application/x-entry-range"):
        r = await client.post(url, data=b"x", headers={"Content-Type": content_type})
        await _error(r, 415, "unsupported_media_type")
    torn = encode_batch([b"abc"]) + struct.pack(">I", 100) + b"short"
    await _error(await client.post(url, data=torn, headers=BATCH), 400, "invalid_frame")
    await _error(await client.post(url, data=b"\x00\x00", headers=BATCH), 400, "invalid_frame")
    await _error(await client.post(url, data=b"", headers=BATCH), 400, "empty_batch")
    big = bytes((1 << 20) + 1)  # max_entry_size in tests is 1 MiB
    r = await client.post(url, data=io.BytesIO(big), headers=OCTET)
    await _error(r, 413, "entry_too_large")
    r = await client.post(url, data=io.BytesIO(encode_batch([b"ok", big])), headers=BATCH)
    await _error(r, 413, "entry_too_large")
    await _error(
        await client.post("/api/v1/streams/nope/entries", data=b"x", headers=OCTET),
        404,
        "stream_not_found",
    )
    r = await client.put("/api/v1/streams/orders", data=b"{nope", headers=JSON)
    await _error(r, 400, "invalid_json")
    details = await _details(client)
    assert details["entries"] == 0 and details["ledgers"] == []  # nothing was half-appended
    assert await _append(client, b"") != ""  # an empty entry is an entry
    assert (await _details(client))["entries"] == 1


async def test_invalid_policy_update_keeps_the_policies(client: Any) -> None:
    await _stream(client, maxEntriesPerLedger=9)
    r = await client.put("/api/v1/streams/orders", json={"maxEntriesPerLedger": -9})
    await _error(r, 400, "invalid_policy")
    assert (await _details(client))["policies"]["maxEntriesPerLedger"] == 9


# --- races -----------------------------------------------------------------------------------

RACING_PUTS = 10
APPENDERS = 10
APPENDS_EACH = 3


async def test_creates_racing_appends_answer_one_201_and_lose_no_acknowledged_entry(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    """PUTs of a new stream racing appends to it. Exactly one PUT creates it; every
    append answered 201 lands on a ledger the stream names durably, so that it reads back
    after a restart (start() deletes ledgers no stream names)."""
    settings = make_settings(tmp_path / "data")
    client = await aiohttp_client(build_app(settings))
    path = "/api/v1/streams/x"

    async def put() -> int:
        r = await client.put(path, json=ROLLING)
        assert r.status in (200, 201), await r.text()
        return int(r.status)

    async def appender(k: int) -> list[tuple[str, bytes]]:
        """Appends until APPENDS_EACH are acknowledged, again at once after a 404 (the
        stream does not exist yet), so that appends arrive while the PUTs still land."""
        acked: list[tuple[str, bytes]] = []
        while len(acked) < APPENDS_EACH:
            payload = f"appender {k} entry {len(acked)}".encode()
            r = await client.post(f"{path}/entries", data=payload, headers=OCTET)
            if r.status == 404:  # not acknowledged
                await _error(r, 404, "stream_not_found")
                continue
            assert r.status == 201, await r.text()
            acked.append((str((await r.json())["position"]), payload))
        return acked

    answers = await asyncio.gather(
        *(put() for _ in range(RACING_PUTS)), *(appender(k) for k in range(APPENDERS))
    )
    statuses = [a for a in answers if isinstance(a, int)]
    assert sorted(statuses) == [200] * (RACING_PUTS - 1) + [201], statuses
    acked = dict(pair for a in answers if isinstance(a, list) for pair in a)
    assert len(acked) == APPENDERS * APPENDS_EACH
    acked[await _append(client, b"after the race", "x")] = b"after the race"
    await client.close()

    client = await aiohttp_client(build_app(settings))
    frames, _ = await _read(client, f"{path}/entries?limit=1000")
    stored = dict(frames)
    missing = sorted(set(acked) - set(stored))
    assert not missing, f"acknowledged entries lost at the restart: {missing}"
    assert {p: stored[p] for p in acked} == acked
