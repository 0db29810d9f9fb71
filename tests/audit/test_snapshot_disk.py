"""Audit snapshots on a real small disk (a loop-mounted 64 MiB ext4, root): the node keeps
the newest audit_snapshots_kept, so that snapshot after snapshot neither fills the disk nor
turns the node read-only, and a snapshot that finds no space is 507 disk_full."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from node.audit import kept
from node.settings import Settings
from tests.harness.node import NodeProcess
from tests.lifecycle.test_full_disk import (
    ENOSPC_ONLY,
    WATERMARKS,
    SmallDisk,
    append_batch,
    call,
    create_ledger,
    read_only,
    small_disk,
    wait_until,
)

pytestmark = pytest.mark.timeout(900)

FS_SIZE = 64 * 1024 * 1024
LEDGERS = 4
BATCHES = 5
BATCH_ENTRIES = 1000  # 20,000 locations: each snapshot's tables take a few hundred KiB
PAYLOAD = b"x" * 64
POSTERS = 8  # concurrent clients, as a retrying DAG or a hostile one would
JSON = "application/json"


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with small_disk(tmp_path, FS_SIZE) as mounted:
        yield mounted


def _snapshot_root(disk: SmallDisk) -> Path:
    return disk.root / "data" / "audit" / "snapshots"


def _filled(node: NodeProcess, ledgers: int, batches: int) -> NodeProcess:
    """``node`` once it holds that many ledgers of batches, checkpointed (what a snapshot
    sees)."""
    for _ in range(ledgers):
        ledger = create_ledger(node)
        for _batch in range(batches):
            status, body = append_batch(node, ledger, [PAYLOAD] * BATCH_ENTRIES)
            assert status == 201, body
    status, body = call(node, "PUT", "/api/v1/bookie/gc", b"", JSON)  # a checkpoint
    assert status == 200, body
    return node


def test_many_snapshots_neither_fill_the_disk_nor_turn_the_node_read_only(
    disk: SmallDisk,
) -> None:
    node = _filled(disk.node({}, defaults=True), LEDGERS, BATCHES)
    status, body = call(node, "POST", "/api/v1/audit/snapshot", b"", JSON)
    assert status == 201, body
    assert body["rows"]["locations"] == LEDGERS * BATCHES * BATCH_ENTRIES
    # Its own files: its links cost nothing while the logs are still there.
    one = kept.kept_bytes(_snapshot_root(disk), disk.root / "data" / "ledgers")
    stat = os.statvfs(disk.root)
    # Enough snapshots to fill the free space half again over, were they all kept.
    posts = 3 * stat.f_bavail * stat.f_frsize // (2 * one)
    started = time.monotonic()
    with ThreadPoolExecutor(POSTERS) as pool:
        snap = "/api/v1/audit/snapshot"
        answers = list(pool.map(lambda _: call(node, "POST", snap, b"", JSON), range(posts)))
    elapsed = time.monotonic() - started
    refused = [(s, b) for s, b in answers if s != 201]
    assert not refused, f"{len(refused)} of {posts} refused, first {refused[0]}"
    assert not read_only(node)
    left = kept.list_kept(_snapshot_root(disk))
    assert len(left) == Settings.model_fields["audit_snapshots_kept"].default
    assert disk.usage() < 0.5, f"{posts} snapshots in {elapsed:.1f} s left {disk.usage():.3f}"
    print(f"{posts} snapshots of {one} bytes in {elapsed:.1f} s; usage {disk.usage():.3f}")


def test_a_snapshot_that_finds_no_space_is_507_and_leaves_nothing(disk: SmallDisk) -> None:
    # The monitor never turns this node read-only: the snapshot itself meets ENOSPC.
    node = _filled(disk.node(ENOSPC_ONLY), 1, 1)
    ballast = disk.fill()

    status, body = call(node, "POST", "/api/v1/audit/snapshot", b"", JSON)
    assert (status, body["code"]) == (507, "disk_full"), body
    assert kept.list_kept(_snapshot_root(disk)) == []

    ballast.unlink()
    # A write of the node's own may have met ENOSPC too: the monitor lifts that shortly.
    wait_until(node, lambda: not read_only(node), "the node turning writable again")
    status, body = call(node, "POST", "/api/v1/audit/snapshot", b"", JSON)
    assert status == 201, body
    assert len(kept.list_kept(_snapshot_root(disk))) == 1
    shutil.rmtree(_snapshot_root(disk))


def test_a_full_disk_deletes_the_snapshots_and_refuses_new_ones(disk: SmallDisk) -> None:
    """Their hold on logs GC deleted would keep the blocks GC frees: read-only for want of
    space, the monitor deletes them."""
    node = _filled(disk.node(WATERMARKS), 1, 1)
    status, body = call(node, "POST", "/api/v1/audit/snapshot", b"", JSON)
    assert status == 201, body
    ballast = disk.fill()
    wait_until(node, lambda: read_only(node), "the node turning read-only")
    wait_until(node, lambda: not kept.list_kept(_snapshot_root(disk)), "the snapshots going")
    status, body = call(node, "POST", "/api/v1/audit/snapshot", b"", JSON)
    assert (status, body["code"]) == (507, "disk_full"), body
    ballast.unlink()
    wait_until(node, lambda: not read_only(node), "the node turning writable again")
