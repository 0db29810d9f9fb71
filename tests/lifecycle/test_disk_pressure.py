"""Retention under disk pressure on a real small file system: past
disk_space_clean_forcibly_ratio (0.85 as shipped) a retention run deletes acknowledged
closed ledgers whatever the stream's retention; the status summary shows both thresholds
and the mode the node is in, and the node's log says at WARNING what it deleted and why."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.settings import Settings
from tests.lifecycle.test_full_disk import COMMON, FS_SIZE, SmallDisk, call, small_disk, wait_until

JSON = "application/json"
STREAM = "kept-forever"
ENTRIES_PER_LEDGER = 5
PRESSURED = 0.90  # between the forced-cleaning ratio (0.85) and the read-only one (0.95)
# Only the disk monitor's read-only watermarks are out of the way (so that the ballast does
# not turn the node read-only); the two retention ratios under test stay as shipped.
ENV = {
    **COMMON,
    "NODE_FLUSH_INTERVAL_MS": "100",
    "NODE_GC_DISK_USAGE_THRESHOLD": "1.0",
    "NODE_DISK_USAGE_WARN_THRESHOLD": "1.0",
    "NODE_DISK_USAGE_THRESHOLD": "1.0",
    "NODE_DISK_USAGE_LWM_THRESHOLD": "1.0",
}


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with small_disk(tmp_path, FS_SIZE) as mounted:
        yield mounted


def _log_lines(disk: SmallDisk) -> list[str]:
    return disk.nodes[0].log_path.read_text(errors="replace").splitlines()


def _post_json(disk: SmallDisk, path: str, body: object) -> object:
    status, reply = call(disk.nodes[0], "POST", path, json.dumps(body).encode(), JSON)
    assert status == 200, reply
    return reply


def _ballast_to(disk: SmallDisk, share: float) -> None:
    stat = os.statvfs(disk.root)
    total, free = stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize
    size = int(total * share) - (total - free)
    assert size > 0, "the disk is already past the share"
    fd = os.open(disk.root / "ballast", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_forced_cleaning_deletes_retained_ledgers_says_why_and_shows_it(disk: SmallDisk) -> None:
    defaults = Settings.model_fields
    assert defaults["disk_max_used_space_ratio"].default == 0.75
    assert defaults["disk_space_clean_forcibly_ratio"].default == 0.85
    node = disk.node(ENV, defaults=True)
    status, _ = call(
        node,
        "PUT",
        f"/api/v1/streams/{STREAM}",
        json.dumps(
            {
                "retentionTimeInMinutes": -1,
                "retentionSizeInMB": -1,
                "minLedgerRolloverTimeMinutes": 0,
                "maxEntriesPerLedger": ENTRIES_PER_LEDGER,
            }
        ).encode(),
        JSON,
    )
    assert status in (200, 201)
    status, _ = call(
        node, "PUT", f"/api/v1/streams/{STREAM}/cursors/c", b'{"start": "earliest"}', JSON
    )
    assert status in (200, 201)
    last = ""
    for _ in range(3 * ENTRIES_PER_LEDGER):
        status, appended = call(node, "POST", f"/api/v1/streams/{STREAM}/entries", b"x" * 1000)
        assert status == 201, appended
        last = appended["position"]
    _post_json(disk, f"/api/v1/streams/{STREAM}/cursors/c/ack", {"position": last})
    closed = [info["ledgerId"] for info in node.get_json(f"/api/v1/streams/{STREAM}")["ledgers"]][
        :-1
    ]
    assert len(closed) >= 2

    retention = node.get_json("/api/v1/status/summary")["retention"]
    assert (retention["cleanAbove"], retention["forcedAbove"]) == (0.75, 0.85)
    assert retention["diskPressure"] == "none"
    assert _post_json(disk, "/api/v1/retention/run", {}) == {"dryRun": False, "streams": {}}

    _ballast_to(disk, PRESSURED)
    retention = node.get_json("/api/v1/status/summary")["retention"]
    assert retention["diskPressure"] == "forced", retention
    assert retention["diskUsage"] > 0.85
    done = _post_json(disk, "/api/v1/retention/run", {})
    deleted = done["streams"][STREAM]  # the full last ledger too: the run rolls it first
    assert {d["reason"] for d in deleted} == {"disk"}
    assert set(closed) <= {d["ledgerId"] for d in deleted}

    def warned() -> bool:
        return any(
            " WARNING " in line and "under disk pressure" in line for line in _log_lines(disk)
        )

    wait_until(node, warned, "the warning")
    line = next(line for line in _log_lines(disk) if "retention under disk pressure" in line)
    assert "disk_space_clean_forcibly_ratio 85%" in line
    assert f"stream {STREAM}" in line
    assert "whatever the streams' retention" in line
    for d in deleted:
        assert f"{d['ledgerId']} (disk, {d['bytes']} bytes)" in line
