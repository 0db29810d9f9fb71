"""The node's crash tests with the raw-device WAL (``wal_kind=blockdev``) on a loop device.

The same workload, nemesis and checker as ``test_crash.py``; the WAL is a ring of 720 KiB
(little more than the least the churn settings' 256 KiB entries allow), which the workload
goes around many times a second: the ring asks for checkpoints as it fills, and appends now
and then find it full and wait for one. The named crash points are those of a checkpoint and
of the ring's trim (its header write). The random kills run in both ``wal_sync_mode``s.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.settings import KiB, MiB
from tests.crash.nodeproc import NodeProcess
from tests.crash.test_crash import RANDOM_TRIALS, Acknowledged, _check, _run_workload
from tests.loopdev import loop_device

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
    rng = random.Random(20261123)
    data = tmp_path / "data"
    acked = Acknowledged()
    shared: list[int] = []
    for trial in range(RANDOM_TRIALS):
        node = NodeProcess(data, env=ring_env)
        node.start()
        if trial:
            _check(node, acked)  # what survived the previous kill, before new writes
        asyncio.run(_run_workload(node, rng, acked, shared, kill_after_s=rng.uniform(0.2, 1.2)))
        node.kill()
    node = NodeProcess(data, env=ring_env)
    node.start()
    try:
        _check(node, acked)
        assert len(acked.entries) > 1000, "the workload acknowledged too little to prove much"
    finally:
        assert node.terminate() == 0


@pytest.mark.slow
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_crash_inside_checkpoint_and_trim_loses_nothing_on_the_ring(
    tmp_path: Path, ring_env: dict[str, str], point: str
) -> None:
    rng = random.Random(point)
    data = tmp_path / "data"
    acked = Acknowledged()
    node = NodeProcess(data, env={**ring_env, "NODE_CRASH_POINTS": json.dumps([point])})
    node.start()
    asyncio.run(_run_workload(node, rng, acked, [], kill_after_s=None))
    assert node.proc is not None
    assert node.proc.wait(10) == -signal.SIGKILL, "the crash point was never reached"
    for _ in range(2):  # and once more: the recovery itself left a clean state
        node = NodeProcess(data, env=ring_env)
        node.start()
        try:
            _check(node, acked)
        finally:
            assert node.terminate() == 0
