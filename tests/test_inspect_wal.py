"""``python -m node inspect wal PATH``: a ring written by the engine on a loop device, read by
the command run as a subprocess; then with a header slot corrupted and with a hole."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.settings import KiB, MiB, Settings
from node.storage import ringformat
from node.storage.blockwal import BlockWal
from node.storage.clock import SystemClock
from node.storage.faults import Faults
from node.storage.ledgers import LedgerStorage
from node.storage.ringformat import BLOCK_ALIGNMENT, HEADER_AREA, HEADER_SLOT_SIZE
from node.storage.wal import LogMark, record_crc
from tests.harness.loopdev import loop_device, restore, snapshot
from tests.harness.settings import make_settings

REPO = Path(__file__).resolve().parent.parent
RING = 1 * MiB
ENTRIES = 30
EXIT_OK, EXIT_FAILED, EXIT_WRONG_KIND = 0, 1, 2


def _settings(data: Path, device: Path) -> Settings:
    return make_settings(
        data,
        wal_kind="blockdev",
        wal_path=device,
        wal_capacity=RING,
        max_entry_size=32 * KiB,
        flush_interval_ms=3_600_000,
    )


def _inspect(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "node", "inspect", "wal", str(path), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def device(tmp_path: Path) -> Iterator[Path]:
    with loop_device(tmp_path / "wal.img", RING) as made:
        yield made


async def _crash_image(settings: Settings) -> tuple[bytearray, LogMark]:
    """A ledger with ENTRIES entries after a checkpoint, the device as a crash leaves it
    (nothing trimmed since the checkpoint), and that checkpoint's mark."""
    storage = LedgerStorage(settings)
    await storage.start()
    meta, _ = await storage.create_ledger()
    await storage.checkpoint()
    mark = storage.last_checkpoint_mark
    for i in range(ENTRIES):
        await storage.add_entry(meta.ledger_id, None, bytes([i]) * (100 + i))
    await storage.fence(meta.ledger_id)
    assert settings.wal_path is not None
    image = await asyncio.to_thread(snapshot, settings.wal_path, RING)
    await storage.close()
    return image, mark


async def test_inspect_wal_prints_header_trim_and_recoverable_records(
    device: Path, tmp_path: Path
) -> None:
    image, mark = await _crash_image(_settings(tmp_path / "data", device))
    await asyncio.to_thread(restore, device, image)

    result = await asyncio.to_thread(_inspect, device, "--records")
    assert result.returncode == EXIT_OK, result.stdout + result.stderr
    out = result.stdout
    assert f"raw-device WAL {device} (block device, {RING} bytes)" in out
    assert re.search(r"header slot 0: sequence \d+, capacity 1048576", out)
    assert re.search(r"header slot 1: sequence \d+", out)
    assert re.search(r"winner: slot \d \(sequence \d+\)", out)
    assert f"trim offset: {mark.offset} " in out
    assert f"records: {ENTRIES + 1} ({ENTRIES} entries, 1 metadata)" in out
    assert "FENCE: 1" in out
    assert f"payload bytes: {sum(100 + i for i in range(ENTRIES))}" in out
    assert len(re.findall(r"ledger 0 entry \d+ len \d+ crc ok", out)) == ENTRIES
    assert "holes: 0" in out and "next offset: " in out
    assert out.rstrip().endswith("OK")


async def test_inspect_wal_shows_which_slot_wins(device: Path, tmp_path: Path) -> None:
    image, _ = await _crash_image(_settings(tmp_path / "data", device))
    sequences = [
        ringformat.decode_header(image[slot * HEADER_SLOT_SIZE :]).sequence for slot in range(2)
    ]
    newest = sequences.index(max(sequences))
    image[newest * HEADER_SLOT_SIZE + 30] ^= 0xFF  # the newest slot torn
    await asyncio.to_thread(restore, device, image)
    result = await asyncio.to_thread(_inspect, device)
    assert f"header slot {newest}: INVALID (CRC32C mismatch)" in result.stdout
    assert f"winner: slot {1 - newest} (sequence {sequences[1 - newest]})" in result.stdout
    assert result.returncode == EXIT_OK


@pytest.mark.parametrize("damage", ["hole", "last record"])
async def test_inspect_wal_fails_on_damage_after_a_graceful_shutdown(
    device: Path, tmp_path: Path, damage: str
) -> None:
    settings = _settings(tmp_path / "data", device)
    wal = BlockWal(settings, SystemClock(), Faults())
    await asyncio.to_thread(wal.last_mark)
    await wal.start()
    marks = []
    for i in range(10):  # one block each: each awaited before the next
        payload = bytes([i]) * 500
        marks.append(await wal.append(1, i, record_crc(1, i, payload), payload))
    await wal.close()  # graceful: nothing was in flight
    end = marks[-1].offset
    image = await asyncio.to_thread(snapshot, device, RING)
    bad = marks[4 if damage == "hole" else 8].offset  # the sixth block's start, or the last's
    at = HEADER_AREA + bad % (RING - HEADER_AREA)
    if damage == "hole":
        image[at : at + BLOCK_ALIGNMENT] = bytes(BLOCK_ALIGNMENT)
        reason = "no record (zeros)"
    else:
        image[at + 100] ^= 0xFF  # in its body
        reason = "torn or corrupt body (CRC32C mismatch)"
    await asyncio.to_thread(restore, device, image)

    result = await asyncio.to_thread(_inspect, device)
    assert result.returncode == EXIT_FAILED, result.stdout
    assert re.search(rf"header slot \d: sequence \d+, .* end {end}, ", result.stdout)
    assert f"offset {bad}: {reason}" in result.stdout
    assert "records: 9 (9 entries, 0 metadata)" in result.stdout
    assert (
        result.stdout.rstrip()
        .splitlines()[-1]
        .startswith(
            f"FAILED: invalid data at offset {bad} ({reason}) before offset {end}, where the "
            "records end after a graceful shutdown"
        )
    )


async def test_inspect_wal_refuses_what_is_not_a_ring(tmp_path: Path) -> None:
    other = tmp_path / "zeros"
    await asyncio.to_thread(other.write_bytes, bytes(HEADER_AREA * 2))
    result = await asyncio.to_thread(_inspect, other)
    assert result.returncode == EXIT_WRONG_KIND
    assert "no WAL header" in result.stderr
