"""Issue 27's read items over the real HTTP server on loopback: stream, cursor and ledger
range replies bounded in bytes under a node-wide read budget, tailing reads that span a
retention trim, and DELETEs of streams that never existed costing no memory."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from typing import Any

from tests.http.test_streams_api import (
    NOT_YET_S,
    POLL_S,
    ROLLING,
    _append,
    _error,
    _frames,
    _ledger,
    _post_cursor,
    _read,
    _stream,
)

MISSING_DELETES = 5_000  # DELETEs of distinct names that never existed
MISSING_WARMUP = 1_000  # first: what the first requests allocate for good (caches fill)
MISSING_GROWTH_BOUND = 600_000  # bytes they may leave (~220 KB of caches; ~500 each before)


async def test_deleting_streams_that_never_existed_keeps_no_memory(client: Any) -> None:
    """Issue 27 item 13: a DELETE of a missing stream took a per-name lock for good."""

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
    """Issue 27 item 10: the read waited at the end of a ledger that retention then
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
    """Issue 27 item 10: ``from`` set to the X-Next-Position of a read that ended in a ledger
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
