"""bookkeeper-first reads against the local copy going (deletion lag 0): a read that chose
the local copy and finds it dropped meanwhile reads the object store instead of answering
404 for an acknowledged entry."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from node.http.state import STORAGE
from node.storage.reads import READER_THREADS
from tests.offload.test_offload import (
    closed_ledger,
    ledger_offload,
    new_client,
    payloads,
    range_entries,
    run,
)


async def test_a_read_that_loses_the_race_with_the_local_copy_going_reads_the_store(
    aiohttp_client: Any, tmp_path: Path, store_settings: dict[str, Any]
) -> None:
    data, entries = tmp_path / "data", payloads(120, seed=21)
    first = await new_client(aiohttp_client, data, store_settings)  # the default 4 h lag
    lid = await closed_ledger(first, entries)
    assert (await run(first, {"ledgers": [lid]}))["offloaded"] == [lid]
    await first.close()

    # A fresh node (empty caches): reads go to the entry logs, through the reader threads.
    client = await new_client(
        aiohttp_client,
        data,
        store_settings,
        managed_ledger_data_read_priority="bookkeeper-first",
        managed_ledger_offload_deletion_lag_ms=0,
    )
    storage = client.app[STORAGE]
    executor = storage._read_executor
    held, release = threading.Barrier(READER_THREADS + 1), threading.Event()

    def hold() -> None:
        held.wait()
        release.wait()

    # Every reader thread busy: the reads below have chosen the local copy and wait for a
    # thread while the run drops that copy.
    busy = [executor.submit(hold) for _ in range(READER_THREADS)]
    await asyncio.to_thread(held.wait)
    last = len(entries) - 1
    single = asyncio.ensure_future(client.get(f"/api/v1/ledgers/{lid}/entries/{last}"))
    ranged = asyncio.ensure_future(client.get(f"/api/v1/ledgers/{lid}/entries?from=0&to={last}"))
    for _ in range(1000):
        if executor._work_queue.qsize() == 2:
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the reads never reached the reader threads")
    try:
        assert (await run(client, {}))["localDeleted"] == [lid]
    finally:
        release.set()
    for future in busy:
        await asyncio.wrap_future(future)

    r = await single
    assert r.status == 200, await r.text()
    assert await r.read() == entries[last]
    r = await ranged
    assert r.status == 200, await r.text()
    assert range_entries(await r.read()) == list(enumerate(entries))
    assert (await ledger_offload(client, lid))["localDeleted"]
