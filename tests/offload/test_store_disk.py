"""The local store on the data disk (a small loop-mounted ext4, root): above the warning
watermark offload refuses to write to it, saying why, since it would fill the disk rather
than free it (the local copies stay for the deletion lag); under it, offload goes on."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.lifecycle.test_full_disk import SmallDisk, small_disk
from tests.offload.test_offload import closed_ledger, ledger_offload, new_client, objects, run

MiB = 1024 * 1024
# The watermarks at their defaults (the tests' host-neutral ones put them all at 1.0).
WATERMARKS = {
    "gc_disk_usage_threshold": 0.85,
    "disk_usage_warn_threshold": 0.90,
    "disk_usage_threshold": 0.95,
    "disk_usage_lwm_threshold": 0.90,
}


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with small_disk(tmp_path, 64 * MiB) as mounted:
        yield mounted


def ballast_to(disk: SmallDisk, target: float) -> Path:
    """A file that takes the disk's usage to ``target``."""
    stat = os.statvfs(disk.root)
    total = stat.f_blocks * stat.f_frsize
    size = int((target - disk.usage()) * total)
    ballast = disk.root / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
        os.fsync(fd)
    finally:
        os.close(fd)
    return ballast


async def test_offload_to_a_local_store_on_the_data_disk_is_refused_above_the_warning(
    disk: SmallDisk,  # first: unmounted after the node has stopped
    aiohttp_client: Any,
) -> None:
    data = disk.root / "data"
    client = await new_client(aiohttp_client, data, {"offload_store": "local"}, **WATERMARKS)
    lid = await closed_ledger(client, [os.urandom(64 * 1024) for _ in range(64)])
    ballast = await asyncio.to_thread(ballast_to, disk, 0.92)
    before = await asyncio.to_thread(disk.usage)
    assert 0.90 < before < 0.95

    for dry in (True, False):
        result = await run(client, {"ledgers": [lid]}, dry=dry)
        assert result["offloaded"] == [], result
        assert result["skipped"] == [{"ledgerId": lid, "reason": "store_disk_full"}]
        assert "shares the disk of" in result["refused"]
        assert "would fill that disk" in result["refused"]
    assert await objects(client) == []
    assert (await ledger_offload(client, lid))["state"] == "none"
    assert await asyncio.to_thread(disk.usage) <= before + 0.005
    status = await (await client.get("/api/v1/offload/status")).json()
    assert status["lastError"] == result["refused"]

    await asyncio.to_thread(ballast.unlink)  # under the warning: offload goes on
    result = await run(client, {"ledgers": [lid]})
    assert result["offloaded"] == [lid] and result["refused"] is None, result
    status = await (await client.get("/api/v1/offload/status")).json()
    assert status["lastError"] is None
    await client.close()


async def read_only(client: Any) -> bool:
    state = await (await client.get("/api/v1/bookie/state")).json()
    return bool(state["readOnly"])


async def test_the_read_only_runbook_frees_space_by_dropping_offloaded_local_copies(
    disk: SmallDisk,  # first: unmounted after the node has stopped
    aiohttp_client: Any,
) -> None:
    """Runbook StorageNodeReadOnly: offload frees space once the local copies go (the lag
    lowered, a run, GC), and not before."""
    data = disk.root / "data"
    store = {"offload_store": "local"}
    small = {**WATERMARKS, "log_size_limit": 2 * MiB, "disk_check_interval_ms": 100}
    client = await new_client(aiohttp_client, data, store, **small)  # the default 4 h lag
    lid = await closed_ledger(client, [os.urandom(63 * 1024) for _ in range(128)])
    assert (await run(client, {"ledgers": [lid]}))["offloaded"] == [lid]
    await client.close()

    await asyncio.to_thread(ballast_to, disk, 0.96)
    client = await new_client(
        aiohttp_client, data, store, **small, managed_ledger_offload_deletion_lag_ms=0
    )
    for _ in range(100):
        if await read_only(client):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the node never turned read-only")
    full = await asyncio.to_thread(disk.usage)

    assert (await run(client, {}))["localDeleted"] == [lid]
    r = await client.put("/api/v1/bookie/gc", json={})
    assert r.status == 200, await r.text()
    for _ in range(300):
        if not await read_only(client):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError(f"still read-only at {await asyncio.to_thread(disk.usage):.1%}")
    assert await asyncio.to_thread(disk.usage) < full - 0.07  # the ~8 MiB local copy, of 64
    r = await client.get(f"/api/v1/ledgers/{lid}/entries/5")
    assert r.status == 200
    await client.close()
