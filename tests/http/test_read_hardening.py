"""Reads over the real HTTP server on loopback: stream, cursor and ledger
range replies bounded in bytes under a node-wide read budget, tailing reads that span a
retention trim, and DELETEs of streams that never existed costing no memory."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from pathlib import Path
from typing import Any

from node.http.app import build_app
from node.http.state import METRICS, READ_BUDGET, STREAMS
from node.settings import KiB, MiB, Settings
from node.wire import decode_range
from tests.harness.settings import make_settings
from tests.http.read_rss import _call, concurrent_reads, fill, rss
from tests.http.test_hostile_clients import NodeFactory, _metric, start_node
from tests.http.test_streams_api import (
    NOT_YET_S,
    OCTET,
    POLL_S,
    ROLLING,
    _append,
    _append_batch,
    _error,
    _frames,
    _ledger,
    _post_cursor,
    _read,
    _stream,
)

__all__ = ["start_node"]  # a fixture

MB = 1_000_000

MISSING_DELETES = 5_000  # DELETEs of distinct names that never existed
MISSING_WARMUP = 1_000  # first: what the first requests allocate for good (caches fill)
MISSING_GROWTH_BOUND = 600_000  # bytes they may leave (~220 KB of caches; ~500 each before)


async def test_deleting_streams_that_never_existed_keeps_no_memory(client: Any) -> None:
    """A DELETE of a missing stream took a per-name lock for good."""

    async def delete(n: int) -> None:
        name = f"{n:010d}".ljust(255, "x")  # the longest name allowed
        # Through the session: the test client keeps every response it returns.
        url = client.make_url(f"/api/v1/streams/{name}")
        async with client.session.delete(url) as r:
            await _error(r, 404, "stream_not_found")

    for n in range(MISSING_WARMUP):
        await delete(n)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(MISSING_WARMUP, MISSING_WARMUP + MISSING_DELETES):
            await delete(n)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    print(f"{MISSING_DELETES} DELETEs of missing streams left {grown} bytes")
    assert grown < MISSING_GROWTH_BOUND, grown


# --- item 10: tailing reads that span a retention trim ---------------------------------------

# Every acknowledged closed ledger may go at once.
TRIMMING = {**ROLLING, "retentionTimeInMinutes": -1, "retentionSizeInMB": 0}


async def _roll_and_trim(client: Any, ledger: int) -> None:
    """A retention run: it rolls the full ledger over (no append came to it) and deletes it,
    without waking a read that waits at its end."""
    r = await client.post("/api/v1/retention/run")
    assert r.status == 200, await r.text()
    assert [d["ledgerId"] for d in (await r.json())["streams"]["orders"]] == [ledger]


async def test_a_tailing_cursor_read_spans_a_retention_trim(client: Any) -> None:
    """The read once waited at the end of a ledger that retention then
    deleted; the append that woke it answered 422 (a retry returned the entry)."""
    await _stream(client, **TRIMMING)
    positions = [await _append(client) for _ in range(3)]  # the first ledger is full
    await client.put("/api/v1/streams/orders/cursors/c1", json={"start": "earliest"})
    await _post_cursor(client, "ack", positions[-1])
    poll = asyncio.create_task(client.get("/api/v1/streams/orders/cursors/c1/entries?waitMs=5000"))
    await asyncio.sleep(NOT_YET_S)
    await _roll_and_trim(client, _ledger(positions[0]))
    assert not poll.done()
    position = await _append(client, b"after the trim")
    assert _ledger(position) > _ledger(positions[0])
    r = await asyncio.wait_for(poll, POLL_S)
    assert r.status == 200, await r.text()
    assert _frames(await r.read()) == [(position, b"after the trim")]


async def test_a_read_from_the_last_next_position_spans_a_retention_trim(client: Any) -> None:
    """``from`` set to the X-Next-Position of a read that ended in a ledger
    retention deleted since, waiting or not."""
    await _stream(client, **TRIMMING)
    positions = [await _append(client) for _ in range(3)]
    await client.put("/api/v1/streams/orders/cursors/c1", json={"start": "earliest"})
    await _post_cursor(client, "ack", positions[-1])
    frames, following = await _read(client, "/api/v1/streams/orders/entries")
    assert [p for p, _ in frames] == positions
    url = f"/api/v1/streams/orders/entries?from={following}&waitMs=5000"
    poll = asyncio.create_task(client.get(url))
    await asyncio.sleep(NOT_YET_S)
    await _roll_and_trim(client, _ledger(positions[0]))
    position = await _append(client, b"after the trim")
    r = await asyncio.wait_for(poll, POLL_S)
    assert r.status == 200, await r.text()
    assert _frames(await r.read()) == [(position, b"after the trim")]
    # The same position again, now that its ledger is gone.
    frames, following = await _read(client, f"/api/v1/streams/orders/entries?from={following}")
    assert frames == [(position, b"after the trim")]
    assert following == f"{_ledger(position)}:1"


async def test_a_position_in_an_older_ledger_that_is_not_the_streams_is_refused(
    client: Any,
) -> None:
    """Only a ledger retention deleted from the stream reads on from its first entry."""
    r = await client.post("/api/v1/ledgers")
    plain = (await r.json())["ledgerId"]
    await _stream(client, **TRIMMING)
    position = await _append(client)
    assert _ledger(position) > plain
    r = await client.get(f"/api/v1/streams/orders/entries?from={plain}:0")
    await _error(r, 422, "invalid_position")


# --- item 2: read replies bounded in bytes, under a node-wide budget -------------------------

LARGE_ENTRIES = 2_500  # of LARGE_ENTRY bytes: a stream of 250 MiB
LARGE_ENTRY = 100 * KiB
# Four readers of it at once, with the defaults: replies of 16 MiB, the read cache, slack.
# Replies built whole grew it by 2.4 GB (a peak of 2,674 MB from 248 MB); bounded, by ~100 MB.
LARGE_RSS_GROWTH_BOUND = 300 * MB
LARGE_RSS_CAP = 3_000 * MB  # past this (over the start) the node is killed: a failure


def test_large_concurrent_reads_are_cut_and_keep_memory_bounded(start_node: NodeFactory) -> None:
    """With the defaults: four readers (two of a stream, two of cursors)
    each ask for 10,000 entries of 100 KiB. Each reply stops at max_read_reply_bytes with
    X-Truncated and X-Next-Position; following them, every reader gets every entry once,
    and the node's RSS stays bounded (tests/http/read_rss.py, the figure of docs/api.md, reads a
    1 GiB stream the same way). A ledger range read of the same data is cut the same way
    and names the entry to go on from."""
    node = start_node()
    assert node.proc is not None
    fill(node, LARGE_ENTRIES, LARGE_ENTRY)
    figure = concurrent_reads(node, LARGE_ENTRIES, cap=rss(node.proc.pid) + LARGE_RSS_CAP)
    growth = figure.peak - figure.at_start
    print(f"RSS {figure.at_start / MB:.0f} MB at the start, peak {figure.peak / MB:.0f} MB")
    assert not figure.capped, "the node passed the cap: replies are built whole"
    assert growth < LARGE_RSS_GROWTH_BOUND, f"RSS grew by {growth / MB:.0f} MB"
    bound = Settings.model_fields["max_read_reply_bytes"].default
    ledger = node.get_json("/api/v1/streams/big")["ledgers"][0]["ledgerId"]
    for reader in figure.readers:
        assert reader.error is None, reader.error
        assert reader.got == LARGE_ENTRIES
        assert reader.largest_reply <= bound
        # Cut short but the last, which held what was left: fewer than limit either way.
        assert reader.truncated == [True] * (reader.replies - 1) + [False]
        assert reader.positions[-1] == f"{ledger}:{LARGE_ENTRIES}"
    assert _metric(node, "storage_node_http_read_reply_bytes_in_flight") == 0

    ids: list[int] = []
    following: str | None = "0"
    while following is not None:
        path = f"/api/v1/ledgers/{ledger}/entries?from={following}"
        status, headers, body = _call(node, "GET", path)
        assert status == 200 and len(body) <= bound
        frames = list(decode_range(body))
        assert all(len(payload) == LARGE_ENTRY for _, payload in frames)
        ids += [entry_id for entry_id, _ in frames]
        following = headers.get("X-Next-Entry-Id")
        assert (headers.get("X-Truncated") == "true") == (following is not None)
        assert following is None or int(following) == ids[-1] + 1
    assert ids == list(range(LARGE_ENTRIES))


async def test_an_entry_larger_than_the_reply_bound_goes_alone(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    settings = make_settings(tmp_path / "data", max_read_reply_bytes=100 * KiB)
    client = await aiohttp_client(build_app(settings))
    await _stream(client)
    payloads = [b"a" * 300 * KiB, b"b" * 10, b"c" * 20, b"d" * 300 * KiB]
    positions = await _append_batch(client, payloads)
    following: str | None = positions[0]
    replies = []
    while following is not None:
        r = await client.get(f"/api/v1/streams/orders/entries?from={following}&limit=10000")
        frames = _frames(await r.read())
        if not frames:
            break
        replies.append((frames, r.headers.get("X-Truncated")))
        following = r.headers["X-Next-Position"]
    assert replies == [
        ([(positions[0], payloads[0])], "true"),
        ([(positions[1], payloads[1]), (positions[2], payloads[2])], "true"),
        ([(positions[3], payloads[3])], None),
    ]
    lid = _ledger(positions[0])
    r = await client.get(f"/api/v1/ledgers/{lid}/entries?from=1&to=3")
    assert list(decode_range(await r.read())) == [(1, payloads[1]), (2, payloads[2])]
    assert r.headers["X-Truncated"] == "true" and r.headers["X-Next-Entry-Id"] == "3"
    r = await client.get(f"/api/v1/ledgers/{lid}/entries?from=3&to=3")
    assert list(decode_range(await r.read())) == [(3, payloads[3])]
    assert "X-Truncated" not in r.headers and "X-Next-Entry-Id" not in r.headers


FRAME_OF_A_MIB = MiB + 20  # a stream frame of a 1 MiB entry (the tests' max_entry_size)
HELD_FRAMES = 31  # what the stalled reply holds: its bound is just above them
STALL_S = 2.0  # reply_write_timeout_s of the test's node


async def test_a_stalled_reply_holds_the_read_budget_only_until_its_timeout(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    """A client that asks for a large read and takes none of it holds its reply's bytes of
    the read budget: another read is cut short where the budget ends, one with no room for
    its first entry is refused with 503 overloaded; after
    reply_write_timeout_s the stalled connection is closed and its bytes come back."""
    bound = HELD_FRAMES * FRAME_OF_A_MIB + 10  # the budget then has a MiB + 10 bytes free
    settings = make_settings(
        tmp_path / "data",
        max_read_reply_bytes=bound,
        max_read_bytes_in_flight=bound + MiB,
        reply_write_timeout_s=STALL_S,
        request_budget_wait_s=0.2,
    )
    client = await aiohttp_client(build_app(settings))
    await _stream(client)
    for _ in range(5):
        await _append_batch(client, [bytes(MiB)] * 7)
    await _stream(client, "small")
    small = await _append_batch(client, [b"s" * 600 * KiB] * 2, name="small")

    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(
        b"GET /api/v1/streams/orders/entries?limit=10000 HTTP/1.1\r\nHost: localhost\r\n\r\n"
    )
    await writer.drain()
    await asyncio.sleep(0.5)  # gathered, and written as far as the socket takes it
    held = HELD_FRAMES * FRAME_OF_A_MIB
    gauge = "storage_node_http_read_reply_bytes_in_flight"
    assert client.app[METRICS].registry.get_sample_value(gauge) == held
    r = await client.get("/api/v1/streams/orders/entries?limit=10000")
    await _error(r, 503, "overloaded")
    assert r.headers["Retry-After"].isdigit()
    frames, _ = await _read(client, "/api/v1/streams/small/entries?limit=10")
    assert frames == [(small[0], b"s" * 600 * KiB)]  # the second did not fit the budget
    await asyncio.sleep(STALL_S + 0.5)
    r = await client.get("/api/v1/streams/orders/entries?limit=10000")
    assert r.status == 200 and r.headers["X-Truncated"] == "true"
    assert len(_frames(await r.read())) == HELD_FRAMES
    received = 0
    while chunk := await asyncio.wait_for(reader.read(1 << 20), 5):
        received += len(chunk)
    assert received < held, "the stalled reply was sent whole"
    writer.close()
    assert client.app[METRICS].registry.get_sample_value(gauge) == 0


async def test_a_single_entry_read_takes_its_bytes_from_the_read_budget(client: Any) -> None:
    """With the budget full (held here as replies in flight would), a single entry's read
    waits request_budget_wait_s, then 503; once bytes come back it is served."""
    r = await client.post("/api/v1/ledgers")
    lid = (await r.json())["ledgerId"]
    r = await client.post(f"/api/v1/ledgers/{lid}/entries", data=b"payload", headers=OCTET)
    assert r.status == 201
    budget = client.app[READ_BUDGET]
    held = budget.capacity - budget.in_use - len(b"payload") + 1
    assert budget.try_take(held)
    try:
        await _error(await client.get(f"/api/v1/ledgers/{lid}/entries/0"), 503, "overloaded")
    finally:
        budget.give_back(held)
    r = await client.get(f"/api/v1/ledgers/{lid}/entries/0")
    assert r.status == 200 and await r.read() == b"payload"


async def test_a_read_goes_on_past_a_ledger_trimmed_while_it_reads(client: Any) -> None:
    """A trim that deletes the ledger a read is in, between two of its entries: the read
    goes on with the next ledger (the rest of that one is gone), as a read that starts in
    a trimmed ledger does, instead of answering 404 ledger_not_found."""
    await _stream(client, **TRIMMING)
    positions = [await _append(client, bytes([65 + n])) for n in range(4)]  # 3, then 1
    l0 = _ledger(positions[0])
    streams = client.app[STREAMS]
    trimmed: list[int] = []

    async def trim_after_the_first(size: int) -> bool:
        if not trimmed:
            trimmed.extend(await streams.trim("orders", [l0], 0))
        return True

    found = await streams.read("orders", None, 10, 0, trim_after_the_first)
    assert trimmed == [l0]
    assert [str(p) for p, _ in found] == [positions[0], positions[3]]
