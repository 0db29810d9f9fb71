"""A real full disk: the node's data dir on a small ext4 file system, loop-mounted (root).

The watermark path (the disk monitor turns the node read-only, deleting ledgers and GC
make it writable again) and the ENOSPC paths (the journal, a checkpoint, the RocksDB
index) each run against the real file system, filled by the node's own writes or by a
ballast file. A test that cannot get its file system fails with the reason: it never
skips, since a full disk is what it exists to prove.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import random
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from node.lifecycle.gc import GarbageCollector
from node.storage.clock import SystemClock
from node.storage.errors import LedgerNotFound
from node.storage.index import Index, LedgerMeta
from node.storage.ledgers import LedgerStorage
from node.wire import BATCH_CONTENT_TYPE, batch_entry_ids, encode_batch
from tests.harness.clients import read_ledger
from tests.harness.node import NodeProcess
from tests.harness.settings import make_settings
from tests.lifecycle.gc_world import gc_settings, interleave
from tests.lifecycle.gc_world import payload as gc_payload

KiB = 1024
MiB = 1024 * KiB
FS_SIZE = 64 * MiB  # fills in seconds, yet holds a few entry logs and a journal
MOUNT_TIMEOUT_S = 30
POLL_S = 0.1
WAIT_S = 60.0  # bound of every wait for the node to change state
OCTET = "application/octet-stream"
BALLAST_CHUNKS = (MiB, 4 * KiB)  # big writes first, then the last blocks
UNFLUSHED_ENTRIES = 40  # cached entries: more than the slack of the current log's last block

# Small enough that the disk fills in seconds and GC keeps up; the monitor checks often.
COMMON = {
    "NODE_MAX_ENTRY_SIZE": str(256 * KiB),
    "NODE_LOG_SIZE_LIMIT": str(2 * MiB),
    "NODE_DB_STORAGE_READ_AHEAD_CACHE_MAX_SIZE": str(4 * MiB),
    "NODE_JOURNAL_MAX_BACKUPS": "0",
    "NODE_DISK_CHECK_INTERVAL_MS": "100",
    "NODE_GC_WAIT_TIME_MS": "1000",
    "NODE_MINOR_COMPACTION_INTERVAL_S": "1",
    "NODE_MAJOR_COMPACTION_INTERVAL_S": "2",
    "NODE_COMPACTION_RATE_BY_ENTRIES": "100000",
    "NODE_DISK_EMERGENCY_RESERVE_BYTES": "0",  # its own test turns it on
}
# The monitor acts well before the file system is out of blocks.
WATERMARKS = {
    **COMMON,
    "NODE_FLUSH_INTERVAL_MS": "200",
    "NODE_JOURNAL_PRE_ALLOC_SIZE": str(MiB),
    "NODE_JOURNAL_MAX_SIZE": str(4 * MiB),
    "NODE_DB_STORAGE_WRITE_CACHE_MAX_SIZE": str(4 * MiB),
    "NODE_GC_DISK_USAGE_THRESHOLD": "0.7",
    "NODE_DISK_USAGE_WARN_THRESHOLD": "0.8",
    "NODE_DISK_USAGE_THRESHOLD": "0.85",
    "NODE_DISK_USAGE_LWM_THRESHOLD": "0.75",
}
# The monitor never turns the node read-only (usage cannot exceed 1.0): only ENOSPC can.
# It still lifts read-only mode once usage is back under the low watermark.
ENOSPC_ONLY = {
    **COMMON,
    "NODE_GC_DISK_USAGE_THRESHOLD": "1.0",
    "NODE_DISK_USAGE_WARN_THRESHOLD": "1.0",
    "NODE_DISK_USAGE_THRESHOLD": "1.0",
    "NODE_DISK_USAGE_LWM_THRESHOLD": "0.9",
}


def _run(command: list[str], what: str) -> None:
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=MOUNT_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        pytest.fail(f"{command[0]} is not installed: the full-disk tests need it to {what}")
    if done.returncode != 0:
        pytest.fail(
            f"cannot {what}: {' '.join(command)} -> {done.stderr.strip() or done.returncode} "
            "(the full-disk tests need root and loop devices)"
        )


class SmallDisk:
    """A small ext4 file system mounted at ``root``; nodes started on it die with it."""

    def __init__(self, root: Path, logs: Path) -> None:
        self.root = root
        self.logs = logs
        self.nodes: list[NodeProcess] = []

    def node(self, env: dict[str, str], defaults: bool = False) -> NodeProcess:
        """A node on this disk with ``env``; with ``defaults``, with nothing else either:
        every setting but the data dir and port at its default."""
        node = NodeProcess(self.root / "data", env)
        if defaults:
            node.env = {k: v for k, v in os.environ.items() if not k.startswith("NODE_")}
            node.env.update(env)
        node.log_path = self.logs / f"node-{len(self.nodes)}.log"  # not on the full disk
        self.nodes.append(node)
        node.start()
        return node

    def fill(self) -> Path:
        """Write a ballast file until the file system has no block left."""
        ballast = self.root / "ballast"
        fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for size in BALLAST_CHUNKS:
                chunk = b"\xa5" * size
                while True:
                    try:
                        os.write(fd, chunk)
                    except OSError as e:
                        if e.errno != errno.ENOSPC:
                            raise
                        break
            os.fsync(fd)
        finally:
            os.close(fd)
        return ballast

    def usage(self) -> float:
        stat = os.statvfs(self.root)
        return 1.0 - stat.f_bavail / stat.f_blocks


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with small_disk(tmp_path, FS_SIZE) as mounted:
        yield mounted


@contextmanager
def small_disk(tmp_path: Path, size: int) -> Iterator[SmallDisk]:
    image = tmp_path / "disk.img"
    root = tmp_path / "mnt"
    root.mkdir()
    with open(image, "wb") as f:
        f.truncate(size)
    # -m 0: no blocks reserved for root, so the node (root here) sees ENOSPC exactly when
    # statvfs says the disk is full.
    _run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], "make an ext4 file system")
    _run(["mount", "-o", "loop", str(image), str(root)], "loop-mount the file system")
    small = SmallDisk(root, tmp_path)
    try:
        yield small
    finally:
        for node in small.nodes:
            if node.proc is not None:
                node.kill()
            if node in NodeProcess.started:
                NodeProcess.started.remove(node)
        unmounted = subprocess.run(
            ["umount", str(root)], capture_output=True, timeout=MOUNT_TIMEOUT_S, check=False
        )
        if unmounted.returncode != 0:  # never leave a mount behind
            subprocess.run(["umount", "-l", str(root)], timeout=MOUNT_TIMEOUT_S, check=False)
        image.unlink(missing_ok=True)


# --- HTTP --------------------------------------------------------------------------------


def call(
    node: NodeProcess, method: str, path: str, body: bytes | None = None, kind: str = OCTET
) -> tuple[int, Any]:
    """(status, decoded JSON body or None) of one request; errors are answers too."""
    request = urllib.request.Request(
        f"{node.url}{path}", data=body, method=method, headers={"Content-Type": kind}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    return status, json.loads(raw) if raw else None


def create_ledger(node: NodeProcess) -> int:
    status, body = call(node, "POST", "/api/v1/ledgers", b"", "application/json")
    assert status == 201, body
    return int(body["ledgerId"])


def put_entry(node: NodeProcess, ledger: int, entry: int, payload: bytes) -> tuple[int, Any]:
    return call(node, "PUT", f"/api/v1/ledgers/{ledger}/entries/{entry}", payload)


def append_batch(node: NodeProcess, ledger: int, payloads: list[bytes]) -> tuple[int, Any]:
    body = encode_batch(payloads)
    return call(node, "POST", f"/api/v1/ledgers/{ledger}/entries", body, BATCH_CONTENT_TYPE)


def check_reads(node: NodeProcess, acked: dict[int, dict[int, bytes]]) -> None:
    """Every acknowledged entry reads back byte for byte, and nothing else is there."""
    for ledger, entries in acked.items():
        found = read_ledger(node, ledger)
        assert found.keys() == entries.keys(), f"ledger {ledger}: ids differ"
        for entry_id, payload in entries.items():
            assert found[entry_id] == payload, f"({ledger}, {entry_id}) differs"


def read_only(node: NodeProcess) -> bool:
    return bool(node.get_json("/api/v1/bookie/state")["readOnly"])


def metric(node: NodeProcess, name: str) -> float:
    text = node.get_bytes("/metrics").decode()
    found = re.search(rf"^storage_node_{name} ([0-9.e+]+)$", text, re.MULTILINE)
    assert found, f"no {name} in /metrics"
    return float(found.group(1))


def checkpoints(node: NodeProcess) -> float:
    return metric(node, "checkpoints_total")


def wait_until(node: NodeProcess, condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(POLL_S)
    pytest.fail(f"{what} did not happen within {WAIT_S} s; node log:\n{node.log()}")


def delete_and_collect(
    node: NodeProcess, ledgers: list[int], acked: dict[int, dict[int, bytes]]
) -> None:
    """Delete ``ledgers``, run GC, and wait for the space to make the node writable."""
    for ledger in ledgers:
        status, body = call(node, "DELETE", f"/api/v1/ledgers/{ledger}")
        assert status == 204, body
        del acked[ledger]
    status, body = call(node, "PUT", "/api/v1/bookie/gc", b"", "application/json")
    assert status == 200, body
    wait_until(node, lambda: not read_only(node), "the node turning writable again")


# --- the tests ---------------------------------------------------------------------------

LEDGERS = 8
KEPT = 2  # ledgers that survive the deletion
BATCH = 16
ENTRY = 16 * KiB
PACE_S = 0.01  # between batches: the monitor (every 100 ms) sees the disk fill
FILL_TIMEOUT_S = 120.0


def test_full_disk_turns_read_only_and_gc_makes_it_writable(disk: SmallDisk) -> None:
    node = disk.node(WATERMARKS)
    rng = random.Random(5)
    ledgers = [create_ledger(node) for _ in range(LEDGERS)]
    acked: dict[int, dict[int, bytes]] = {lid: {} for lid in ledgers}
    deadline = time.monotonic() + FILL_TIMEOUT_S
    refused = None
    n = 0
    while refused is None:
        assert time.monotonic() < deadline, f"the disk never filled; node log:\n{node.log()}"
        ledger = ledgers[n % LEDGERS]
        n += 1
        payloads = [rng.randbytes(ENTRY) for _ in range(BATCH)]
        status, body = append_batch(node, ledger, payloads)
        if status == 201:
            acked[ledger].update(zip(batch_entry_ids(body), payloads, strict=True))
        elif status == 507:
            refused = body
        else:
            assert status == 503, body  # backpressure while a checkpoint runs: retry
        time.sleep(PACE_S)
    assert refused["code"] == "disk_full", refused
    assert read_only(node)
    status, body = put_entry(node, ledgers[0], len(acked[ledgers[0]]), b"more")
    assert (status, body["code"]) == (507, "disk_full"), body  # at once, without a write
    check_reads(node, acked)

    # Deleting ledgers and GC give the space back, without a restart.
    delete_and_collect(node, ledgers[KEPT:], acked)
    low = float(WATERMARKS["NODE_DISK_USAGE_LWM_THRESHOLD"])  # a compaction may be copying
    wait_until(node, lambda: disk.usage() < low, "disk usage under the low watermark")
    check_reads(node, acked)
    for ledger in ledgers[KEPT:]:
        assert call(node, "GET", f"/api/v1/ledgers/{ledger}")[0] == 404

    # Writable again: more entries, to the survivors and to a new ledger.
    acked[create_ledger(node)] = {}
    for ledger in acked:
        payloads = [rng.randbytes(ENTRY) for _ in range(BATCH)]
        status, body = append_batch(node, ledger, payloads)
        assert status == 201, body
        acked[ledger].update(zip(batch_entry_ids(body), payloads, strict=True))
    check_reads(node, acked)

    assert node.terminate() == 0, node.log()
    node.start()
    check_reads(node, acked)


SMALL_ENTRY = 8 * KiB
JOURNAL_STEP = 64 * KiB  # the journal's preallocation step: it extends the file often
BEFORE_FULL = 8  # entries acknowledged before the disk fills


def test_journal_enospc_fails_the_add_and_keeps_everything_acknowledged(
    disk: SmallDisk,
) -> None:
    node = disk.node(
        {
            **ENOSPC_ONLY,
            # No checkpoint runs during the test: the journal meets the full disk first.
            "NODE_FLUSH_INTERVAL_MS": "600000",
            "NODE_DB_STORAGE_WRITE_CACHE_MAX_SIZE": str(32 * MiB),
            "NODE_JOURNAL_PRE_ALLOC_SIZE": str(JOURNAL_STEP),
            "NODE_JOURNAL_MAX_SIZE": str(16 * MiB),
        }
    )
    rng = random.Random(7)
    ledger = create_ledger(node)
    entries: dict[int, bytes] = {}
    for entry_id in range(BEFORE_FULL):
        payload = rng.randbytes(SMALL_ENTRY)
        status, body = put_entry(node, ledger, entry_id, payload)
        assert status == 201, body
        entries[entry_id] = payload

    ballast = disk.fill()
    # What is left of the journal's preallocated step takes a few more adds; then the
    # journal must extend its file, and cannot.
    refused_at = None
    for entry_id in range(BEFORE_FULL, BEFORE_FULL + JOURNAL_STEP // SMALL_ENTRY + 2):
        payload = rng.randbytes(SMALL_ENTRY)
        status, body = put_entry(node, ledger, entry_id, payload)
        if status == 507:
            refused_at = entry_id
            break
        assert status == 201, body
        entries[entry_id] = payload
    assert refused_at is not None, f"no add failed on a full disk; node log:\n{node.log()}"
    assert body["code"] == "disk_full", body
    assert "no space left for the journal" in body["message"], body
    assert read_only(node)
    status, body = put_entry(node, ledger, refused_at, b"again")
    assert (status, body["code"]) == (507, "disk_full"), body

    # Reads go on, and the refused entry is nowhere.
    check_reads(node, {ledger: entries})
    assert call(node, "GET", f"/api/v1/ledgers/{ledger}/entries/{refused_at}")[0] == 404

    # Space back: writable again without a restart; the refused id takes other bytes.
    ballast.unlink()
    wait_until(node, lambda: not read_only(node), "the node turning writable again")
    for entry_id in range(refused_at, refused_at + BEFORE_FULL):
        payload = rng.randbytes(SMALL_ENTRY)
        status, body = put_entry(node, ledger, entry_id, payload)
        assert status == 201, body
        assert body["lac"] == entry_id, body  # no hole where the refused add was
        entries[entry_id] = payload
    check_reads(node, {ledger: entries})

    assert node.terminate() == 0, node.log()
    node.start()
    check_reads(node, {ledger: entries})  # the journal never held the refused bytes


def test_checkpoint_enospc_turns_read_only_and_retries(disk: SmallDisk) -> None:
    node = disk.node(
        {
            **ENOSPC_ONLY,
            "NODE_FLUSH_INTERVAL_MS": "200",
            "NODE_DB_STORAGE_WRITE_CACHE_MAX_SIZE": str(16 * MiB),
            # Preallocated once: the journal takes every add of the test without growing,
            # so only the checkpoint (entry log, index) meets the full disk.
            "NODE_JOURNAL_PRE_ALLOC_SIZE": str(8 * MiB),
            "NODE_JOURNAL_MAX_SIZE": str(16 * MiB),
        }
    )
    rng = random.Random(11)
    ledger = create_ledger(node)
    entries: dict[int, bytes] = {}

    def add_batch() -> tuple[int, Any]:
        payloads = [rng.randbytes(ENTRY) for _ in range(BATCH)]
        status, body = append_batch(node, ledger, payloads)
        if status == 201:
            entries.update(zip(batch_entry_ids(body), payloads, strict=True))
        return status, body

    assert add_batch()[0] == 201
    done = checkpoints(node)
    wait_until(node, lambda: checkpoints(node) > done, "a checkpoint")

    ballast = disk.fill()
    status, body = add_batch()  # the journal has room: acknowledged
    assert status == 201, body
    wait_until(node, lambda: read_only(node), "the failed checkpoint turning the node read-only")
    status, body = add_batch()
    assert (status, body["code"]) == (507, "disk_full"), body
    assert "no space left for a checkpoint" in body["message"], body
    assert "checkpoint failed for want of space" in node.log()
    check_reads(node, {ledger: entries})  # from the write cache and the entry logs

    ballast.unlink()
    done = checkpoints(node)
    wait_until(node, lambda: checkpoints(node) > done, "a checkpoint once there is space")
    wait_until(node, lambda: not read_only(node), "the node turning writable again")
    status, body = add_batch()
    assert status == 201, body
    check_reads(node, {ledger: entries})

    node.kill()  # no final checkpoint: the entry logs and the journal hold it all
    node.start()
    check_reads(node, {ledger: entries})


def test_a_replay_that_finds_the_disk_full_starts_read_only_with_everything(
    disk: SmallDisk,
) -> None:
    """A crash leaves megabytes in the journal; the disk fills before the restart. Replay's
    flushes (in chunks, on a thread of their own) find no space: the node starts all the
    same, read-only, serving every acknowledged entry from memory; once there is space it
    checkpoints, turns writable, and a crash after that loses nothing either."""
    env = {
        **ENOSPC_ONLY,
        "NODE_FLUSH_INTERVAL_MS": "3600000",  # nothing leaves the journal before the crash
        "NODE_DB_STORAGE_WRITE_CACHE_MAX_SIZE": str(8 * MiB),  # replay flushes every 1 MiB
        "NODE_JOURNAL_PRE_ALLOC_SIZE": str(8 * MiB),
        "NODE_JOURNAL_MAX_SIZE": str(16 * MiB),
    }
    node = disk.node(env)
    rng = random.Random(5)
    acked: dict[int, dict[int, bytes]] = {create_ledger(node): {} for _ in range(2)}
    for _ in range(6):
        for ledger, entries in acked.items():
            payloads = [rng.randbytes(ENTRY) for _ in range(BATCH)]
            status, body = append_batch(node, ledger, payloads)
            assert status == 201, body
            entries.update(zip(batch_entry_ids(body), payloads, strict=True))
    node.kill()

    ballast = disk.fill()
    os.truncate(ballast, ballast.stat().st_size - INDEX_ROOM)  # RocksDB opens, no more
    node.start()
    assert "replay cannot flush for want of space" in node.log()
    assert read_only(node)
    check_reads(node, acked)

    ballast.unlink()
    wait_until(node, lambda: not read_only(node), "the node turning writable again")
    ledger = next(iter(acked))
    payloads = [rng.randbytes(ENTRY) for _ in range(BATCH)]
    status, body = append_batch(node, ledger, payloads)
    assert status == 201, body
    acked[ledger].update(zip(batch_entry_ids(body), payloads, strict=True))
    node.kill()
    node.start()
    check_reads(node, acked)


INDEX_ROOM = 512 * KiB  # what opening RocksDB writes; a replay chunk is twice as much
RESERVE = 4 * MiB
RESERVE_ROUNDS = 12  # of a batch per ledger: each entry log holds a share of every ledger


def test_the_emergency_reserve_lets_gc_free_a_disk_someone_else_filled(disk: SmallDisk) -> None:
    """Another tenant takes the last block: the node turns read-only on ENOSPC, gives back
    its reserve, and deleting ledgers is then enough for GC (compaction included: every
    log is partly live) to make it writable again, without anyone freeing the ballast."""
    node = disk.node(
        {
            **ENOSPC_ONLY,
            "NODE_DISK_EMERGENCY_RESERVE_BYTES": str(RESERVE),
            "NODE_FLUSH_INTERVAL_MS": "200",
            "NODE_DB_STORAGE_WRITE_CACHE_MAX_SIZE": str(4 * MiB),
            "NODE_JOURNAL_PRE_ALLOC_SIZE": str(MiB),
            "NODE_JOURNAL_MAX_SIZE": str(4 * MiB),
        }
    )
    reserve = disk.root / "data" / "emergency-reserve"
    wait_until(node, reserve.exists, "the reserve being made")
    assert reserve.stat().st_blocks * 512 >= RESERVE  # allocated, not sparse
    assert metric(node, "disk_emergency_reserve_bytes") == RESERVE
    rng = random.Random(17)
    ledgers = [create_ledger(node) for _ in range(LEDGERS)]
    acked: dict[int, dict[int, bytes]] = {lid: {} for lid in ledgers}
    for _ in range(RESERVE_ROUNDS):
        for ledger in ledgers:
            payloads = [rng.randbytes(ENTRY) for _ in range(BATCH)]
            status, body = append_batch(node, ledger, payloads)
            assert status == 201, body
            acked[ledger].update(zip(batch_entry_ids(body), payloads, strict=True))
    done = checkpoints(node)
    wait_until(node, lambda: checkpoints(node) > done, "a checkpoint")

    disk.fill()  # never unlinked: the node must recover on its own
    n = 0
    while not read_only(node):
        ledger = ledgers[n % LEDGERS]
        n += 1
        payloads = [rng.randbytes(ENTRY) for _ in range(BATCH)]
        status, body = append_batch(node, ledger, payloads)
        if status == 201:
            acked[ledger].update(zip(batch_entry_ids(body), payloads, strict=True))
        else:
            assert (status, body["code"]) == (507, "disk_full"), body
        assert n < LEDGERS * RESERVE_ROUNDS, "the full disk never refused an add"
    wait_until(node, lambda: not reserve.exists(), "the reserve being released")
    # The node counts the reserve gone once the directory's fsync is done, after the unlink.
    wait_until(node, lambda: metric(node, "disk_emergency_reserve_bytes") == 0, "the metric at 0")

    delete_and_collect(node, ledgers[KEPT:], acked)
    check_reads(node, acked)
    _, details = call(node, "GET", "/api/v1/bookie/gc_details")
    assert details[0]["majorCompactionCounter"] > 0, details  # the shared logs were compacted
    wait_until(node, reserve.exists, "the reserve being made again")
    status, body = append_batch(node, ledgers[0], [b"after"])
    assert status == 201, body
    acked[ledgers[0]][body["firstEntryId"]] = b"after"
    check_reads(node, acked)


LOCATIONS = 1000
MANY_LOCATIONS = 200_000  # a batch larger than any block left on the full disk


def errno_of(work: Callable[[], object]) -> int | None:
    """The errno of the OSError ``work`` raises, None if it raises none. The exception is
    not kept: its traceback would hold the failed RocksDB instance (and its LOCK)."""
    try:
        work()
    except OSError as e:
        return e.errno
    return None


def test_index_reopens_after_a_write_failed_for_want_of_space(disk: SmallDisk) -> None:
    """RocksDB refuses every write after one failed; the index reopens itself once there
    is space again, and serves reads all along."""
    path = disk.root / "index"
    index = Index(path)
    try:
        index.write([(1, range(LOCATIONS), range(LOCATIONS))], [LedgerMeta(1)])
        ballast = disk.fill()
        many = [(2, range(MANY_LOCATIONS), range(MANY_LOCATIONS))]
        assert errno_of(lambda: index.write(many, [LedgerMeta(2)])) == errno.ENOSPC
        assert index.get_location(1, LOCATIONS - 1) == LOCATIONS - 1
        # Still full: a reopen must replay RocksDB's WAL into a table file, and cannot.
        assert errno_of(index.ensure_writable) == errno.ENOSPC
        assert index.get_location(1, LOCATIONS - 1) == LOCATIONS - 1  # read-only instance

        ballast.unlink()
        index.write([(3, range(LOCATIONS), range(LOCATIONS))], [LedgerMeta(3)])
        assert index.get_location(1, 0) == 0
        assert index.get_location(3, LOCATIONS - 1) == LOCATIONS - 1
    finally:
        index.close()
    index = Index(path)
    try:
        assert index.get_location(1, LOCATIONS - 1) == LOCATIONS - 1
        assert index.get_location(3, LOCATIONS - 1) == LOCATIONS - 1
        assert set(index.load_ledgers()) >= {1, 3}
    finally:
        index.close()


# --- the defaults on small disks ----------------------------------------------------------

DEFAULTS_LEDGERS = 8
DEFAULTS_DELETED = 6  # ledgers 1-6 go; 7 and 8 keep their entries
DEFAULTS_ENTRY = 64 * KiB
DEFAULTS_AFTER = 16  # entries per survivor once writable again
# The monitor checks every disk_check_interval_ms (10 s by default): a few of its rounds.
DEFAULTS_WAIT_S = 120.0


@pytest.mark.parametrize("size_mib", [64, 256])
def test_full_disk_with_default_settings(tmp_path: Path, size_mib: int) -> None:
    """Only the data dir is set. Adds in turn to 8 ledgers until the disk refuses (507),
    every acknowledged entry readable all along; deleting 6 ledgers and a forced major GC
    make the node writable again without a restart; a clean stop and start keep it all."""
    with small_disk(tmp_path, size_mib * MiB) as disk:
        node = disk.node({}, defaults=True)
        rng = random.Random(size_mib)
        ledgers = [create_ledger(node) for _ in range(DEFAULTS_LEDGERS)]
        acked: dict[int, dict[int, bytes]] = {lid: {} for lid in ledgers}
        deadline = time.monotonic() + FILL_TIMEOUT_S
        n = 0
        while True:
            assert time.monotonic() < deadline, f"the disk never filled; log:\n{node.log()}"
            ledger = ledgers[n % DEFAULTS_LEDGERS]
            n += 1
            payload = rng.randbytes(DEFAULTS_ENTRY)
            status, body = put_entry(node, ledger, len(acked[ledger]), payload)
            if status == 507:
                break
            assert status == 201, body
            acked[ledger][len(acked[ledger])] = payload
        assert body["code"] == "disk_full", body
        assert read_only(node)
        check_reads(node, acked)

        for ledger in ledgers[:DEFAULTS_DELETED]:
            status, body = call(node, "DELETE", f"/api/v1/ledgers/{ledger}")
            assert status == 204, body
            del acked[ledger]
        check_reads(node, acked)
        gc = json.dumps({"forceMajor": True}).encode()
        status, body = call(node, "PUT", "/api/v1/bookie/gc", gc, "application/json")
        assert status == 200, body
        deadline = time.monotonic() + DEFAULTS_WAIT_S
        while read_only(node):
            assert time.monotonic() < deadline, f"still read-only; node log:\n{node.log()}"
            check_reads(node, acked)  # throughout, not only at the end
            time.sleep(1)

        for ledger in acked:
            for _ in range(DEFAULTS_AFTER):
                payload = rng.randbytes(DEFAULTS_ENTRY)
                status, body = put_entry(node, ledger, len(acked[ledger]), payload)
                assert status == 201, body
                acked[ledger][len(acked[ledger])] = payload
        check_reads(node, acked)
        assert node.terminate() == 0, node.log()
        node.start()
        check_reads(node, acked)
        assert node.terminate() == 0, node.log()


QUEUE_POLLS = 1000


async def test_a_purge_racing_a_failed_checkpoint_loses_nothing(disk: SmallDisk) -> None:
    """A GC purge of a deleted ledger that waits behind a checkpoint which then fails for
    want of space: the checkpoint's ledgers go back to dirty, and the purge must not
    forget one of them (the next checkpoint then failed with KeyError, forever, and the
    entries of its frozen cache were no longer readable)."""
    settings = make_settings(
        disk.root / "data",
        journal_pre_alloc_size=8 * MiB,  # the journal takes every add without growing
        flush_interval_ms=600_000,  # only the test's checkpoints run
    )
    storage = LedgerStorage(settings)
    await storage.start()
    rng = random.Random(23)
    try:
        doomed, _ = await storage.create_ledger()
        kept, _ = await storage.create_ledger()
        await storage.add_entries(doomed.ledger_id, [rng.randbytes(ENTRY)] * 4)
        await storage.checkpoint()
        await storage.delete_ledger(doomed.ledger_id)
        payloads = [rng.randbytes(ENTRY) for _ in range(BATCH)]
        await storage.add_entries(kept.ledger_id, payloads)
        ballast = await asyncio.to_thread(disk.fill)

        # Hold the flush thread so that the checkpoint's flush and the purge queue up.
        gate = threading.Event()
        flush_thread = storage._flush_executor  # the order of its jobs is the test
        held = flush_thread.submit(gate.wait)
        checkpoint = asyncio.create_task(storage.checkpoint())
        for _ in range(QUEUE_POLLS):  # until the checkpoint's flush waits behind it
            if flush_thread._work_queue.qsize():
                break
            await asyncio.sleep(POLL_S / 10)
        purge = asyncio.create_task(storage.purge_deleted_ledgers())
        await asyncio.sleep(0.05)  # the purge has chosen what to forget
        gate.set()
        await asyncio.wrap_future(held)
        with pytest.raises(OSError):
            await checkpoint
        await purge

        for entry_id, payload in enumerate(payloads):  # from the merged-back cache
            assert await storage.read_entry(kept.ledger_id, entry_id) == payload
        await asyncio.to_thread(ballast.unlink)
        await storage.checkpoint()  # raised KeyError before the fix
        await storage.purge_deleted_ledgers()
    finally:
        await storage.close()
    storage = LedgerStorage(settings)
    await storage.start()
    try:
        for entry_id, payload in enumerate(payloads):
            assert await storage.read_entry(kept.ledger_id, entry_id) == payload
        with pytest.raises(LedgerNotFound):
            storage.ledger(doomed.ledger_id)
    finally:
        await storage.close()


async def test_a_requested_gc_whose_checkpoint_finds_no_space_reclaims_what_is_durable(
    disk: SmallDisk, caplog: pytest.LogCaptureFixture
) -> None:
    """GC checkpoints before it scans, so that recent deletions count; on a full disk that
    checkpoint fails, and the run still reclaims the deletions an earlier one made durable."""
    storage = LedgerStorage(gc_settings(disk.root / "data"))
    await storage.start()
    try:
        gc = GarbageCollector(storage, SystemClock())
        durable = await interleave(storage, ledgers=2, rounds=10)
        pending = await interleave(storage, ledgers=2, rounds=10)
        for lid in durable:
            await storage.delete_ledger(lid)
        await storage.checkpoint()
        # Cached entries, so that the checkpoint has an entry log to write, and a deletion
        # no checkpoint has made durable yet.
        await storage.add_entries(pending[1], [gc_payload(pending[1], 0)] * UNFLUSHED_ENTRIES)
        await storage.delete_ledger(pending[0])
        ballast = await asyncio.to_thread(disk.fill)
        gc.request()
        report = await gc.run()
        assert "goes on without a checkpoint" in caplog.text
        # The failed checkpoint records its deletions on their own when the index can
        # take them: the pending one may go in this run already.
        purged = set(report.purged_ledgers)
        assert set(durable) <= purged <= {*durable, pending[0]} and report.deleted_logs
        assert storage.ledger(pending[1])  # the rest is as it was

        await asyncio.to_thread(ballast.unlink)
        gc.request()
        purged |= set((await gc.run()).purged_ledgers)
        assert purged == {*durable, pending[0]}
    finally:
        await storage.close()
