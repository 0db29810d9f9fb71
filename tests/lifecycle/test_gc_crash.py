"""SIGKILL during compaction, at named steps of its protocol and at random moments: nothing
is lost, no index entry dangles, and the next GC run reclaims what the crash left."""

from __future__ import annotations

import asyncio
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node.lifecycle.gc import GarbageCollector
from node.storage import entrylog, logformat
from node.storage.clock import SystemClock
from node.storage.compaction import MARKER_SUFFIX
from node.storage.ledgers import LedgerStorage
from tests.lifecycle.gc_world import (
    check_survivors,
    dangling_entries,
    gc_settings,
    interleave,
    log_bytes,
)

REPO = Path(__file__).resolve().parents[2]
CRASH_POINTS = [
    "compaction.after_copy",
    "compaction.after_seal",
    "compaction.after_marker",
    "compaction.after_rename",
    "compaction.after_index",
    "compaction.after_retire",
]
RANDOM_KILLS = 14
SLOW_RATE = 400_000  # bytes/s: a compaction of ~1.5 MB lasts a few seconds
FAST_RATE = 100_000_000


async def _prepare(data: Path) -> list[int]:
    """Interleaved ledgers, most deleted (durably): logs are partly live."""
    storage = LedgerStorage(gc_settings(data))
    await storage.start()
    ids = await interleave(storage, ledgers=8, rounds=40)
    for lid in ids[:5]:
        await storage.delete_ledger(lid)
    await storage.checkpoint()
    await storage.close()
    return ids[5:]


async def _verify(data: Path, survivors: list[int], expect_bytes: int | None) -> int:
    """Recover, check, let GC reclaim leftovers; returns the entry log bytes after it."""
    storage = LedgerStorage(gc_settings(data))
    await storage.start()
    try:
        await check_survivors(storage, survivors)
        gc = GarbageCollector(storage, SystemClock())
        gc.request(force_major=True)
        report = await gc.run()  # recovery first, then compaction of what is left
        await check_survivors(storage, survivors)
        assert await dangling_entries(storage) == []
        directory = storage.settings.ledgers_dir
        leftovers = await asyncio.to_thread(
            lambda: [
                p.name
                for p in directory.iterdir()
                if p.name.endswith((MARKER_SUFFIX, entrylog.COMPACTING_SUFFIX))
            ]
        )
        assert leftovers == [], (leftovers, report.recovered)
        size = await asyncio.to_thread(log_bytes, directory)
        if expect_bytes is not None:  # as small as an uninterrupted compaction leaves it
            assert size <= expect_bytes * 1.05 + logformat.HEADER_SIZE * 4, (size, expect_bytes)
        return size
    finally:
        await storage.close()


def _worker(data: Path, crash_point: str, rate: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.lifecycle.gc_crash_worker",
            str(data),
            crash_point,
            str(rate),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int], int]:
    base = tmp_path_factory.mktemp("gc-crash")
    pristine = base / "pristine"
    survivors = asyncio.run(_prepare(pristine))
    clean = base / "clean"
    shutil.copytree(pristine, clean)
    worker = _worker(clean, "-", FAST_RATE)
    out, err = worker.communicate(timeout=120)
    assert worker.returncode == 0 and "done" in out, err
    expect = asyncio.run(_verify(clean, survivors, None))
    return pristine, survivors, expect


@pytest.mark.slow
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_crash_at_each_step_of_the_protocol(
    prepared: tuple[Path, list[int], int], tmp_path: Path, point: str
) -> None:
    pristine, survivors, expect = prepared
    data = tmp_path / "data"
    shutil.copytree(pristine, data)
    worker = _worker(data, point, FAST_RATE)
    _out, err = worker.communicate(timeout=120)
    assert worker.returncode == -signal.SIGKILL, f"{point} was never reached: {err[-2000:]}"
    asyncio.run(_verify(data, survivors, expect))


@pytest.mark.slow
def test_sigkill_at_random_moments_of_a_throttled_compaction(
    prepared: tuple[Path, list[int], int], tmp_path: Path
) -> None:
    pristine, survivors, expect = prepared
    rng = random.Random(5)
    for trial in range(RANDOM_KILLS):
        data = tmp_path / f"trial-{trial}"
        shutil.copytree(pristine, data)
        worker = _worker(data, "-", SLOW_RATE)
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "compacting"
        time.sleep(rng.uniform(0.0, 3.0))
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)
        assert "done" not in worker.stdout.read(), "the kill came after the compaction"
        worker.stdout.close()
        assert worker.stderr is not None
        worker.stderr.close()
        asyncio.run(_verify(data, survivors, expect))
        shutil.rmtree(data)
