"""The node's crash tests with the raw-device WAL (``wal_kind=blockdev``) on a loop device.

The same workload, nemesis and checker as ``test_crash.py``; the WAL is a ring of 720 KiB
(little more than the least the churn settings' 256 KiB entries allow), which the workload
goes around many times a second: the ring asks for checkpoints as it fills, and appends now
and then find it full and wait for one. The named crash points are those of a checkpoint and
of the ring's trim (its header write). The random kills run in both ``wal_sync_mode``s.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from node.settings import KiB, MiB
from tests.crash.test_crash import crash_at, random_kills
from tests.harness.loopdev import loop_device

RING = 720 * KiB
DEVICE = 4 * MiB  # larger than the ring: the WAL uses it only up to its capacity
CRASH_POINTS = [
    "checkpoint.before_entrylog",
    "checkpoint.after_entrylog_fsync",
    "checkpoint.after_index",
    "checkpoint.after_mark",
    "blockwal.trim.before_header",
    "blockwal.trim.after_header",
]


@pytest.fixture
def ring_env(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    sync_mode = getattr(request, "param", "fdatasync")  # parametrized indirectly, or not
    with loop_device(tmp_path / "wal.img", DEVICE) as device:
        yield {
            "NODE_WAL_KIND": "blockdev",
            "NODE_WAL_PATH": str(device),
            "NODE_WAL_CAPACITY": str(RING),
            "NODE_WAL_SYNC_MODE": sync_mode,
        }


@pytest.mark.slow
@pytest.mark.parametrize("ring_env", ["fdatasync", "dsync"], indirect=True)
def test_sigkill_at_random_moments_loses_nothing_acknowledged_on_the_ring(
    tmp_path: Path, ring_env: dict[str, str]
) -> None:
    random_kills(tmp_path / "data", seed=20261123, env=ring_env)


@pytest.mark.slow
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_crash_inside_checkpoint_and_trim_loses_nothing_on_the_ring(
    tmp_path: Path, ring_env: dict[str, str], point: str
) -> None:
    crash_at(tmp_path / "data", point, env=ring_env)
