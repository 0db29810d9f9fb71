"""Issue 27's read items over the real HTTP server on loopback: stream, cursor and ledger
range replies bounded in bytes under a node-wide read budget, tailing reads that span a
retention trim, and DELETEs of streams that never existed costing no memory."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

from tests.http.test_streams_api import _error

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
