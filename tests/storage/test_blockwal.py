"""The raw-device WAL on a real loop device and on a plain file: formats, round trips,
wrap-around, trim, torn blocks, corrupted header slots, holes, capacity checks, a full ring,
the engine on top of it, and SIGKILLed writer processes.

Crashes in-process are crash images: ``snapshot`` reads the medium while the WAL is idle
(what a crash at that moment would leave), the WAL is closed, the image (maybe altered:
a block zeroed as if it never reached the disk) is put back, and a new WAL recovers it.
"""

from __future__ import annotations

import asyncio
import random
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.settings import KiB, MiB, Settings, SettingsError
from node.storage import ringformat
from node.storage.blockwal import BlockWal
from node.storage.clock import SystemClock
from node.storage.errors import Backpressure, CorruptRecord, WalDeviceError
from node.storage.faults import Faults
from node.storage.ledgers import LedgerStorage
from node.storage.ringformat import (
    BLOCK_ALIGNMENT,
    DATA_MAGIC,
    HEADER_AREA,
    HEADER_SIZE,
    HEADER_SLOT_SIZE,
    PADDING_MAGIC,
    RECORD_HEADER_SIZE,
    Shutdown,
    WalHeader,
)
from node.storage.ringscan import RingScan, ScanKind
from node.storage.wal import LogMark, WalRecord, record_crc
from tests.harness.loopdev import loop_device, restore, snapshot
from tests.harness.settings import make_settings
from tests.storage import blockwal_writer

REPO = Path(__file__).resolve().parents[2]
RING = 1 * MiB  # small: a few hundred KiB of records wrap it
DEVICE = 2 * MiB  # the loop device is larger than the ring: used only up to the capacity
MAX_ENTRY = 32 * KiB
GROUP = 5  # records per group; a sync point after each closes its block

U64 = st.integers(0, (1 << 64) - 1)
U32 = st.integers(0, (1 << 32) - 1)


# --- fixtures and helpers --------------------------------------------------------------------


@pytest.fixture(params=["loop device", "file"])
def medium(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    if request.param == "file":
        yield tmp_path / "wal.ring"  # the WAL creates it
        return
    with loop_device(tmp_path / "loop.img", DEVICE) as device:
        yield device


@pytest.fixture
def loop_medium(tmp_path: Path) -> Iterator[Path]:
    with loop_device(tmp_path / "loop.img", DEVICE) as device:
        yield device


def wal_settings(data: Path, medium: Path, capacity: int = RING, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "wal_kind": "blockdev",
        "wal_path": medium,
        "wal_capacity": capacity,
        "max_entry_size": MAX_ENTRY,
        "wal_write_rate_limit": 0,
    }
    values.update(overrides)
    return make_settings(data, **values)


async def open_wal(settings: Settings, **kwargs: Any) -> tuple[BlockWal, list[WalRecord]]:
    """A WAL recovered as the engine recovers it (its records), not yet started; the caller
    closes it (an open one keeps its loop device from detaching)."""
    wal = BlockWal(settings, SystemClock(), Faults(), **kwargs)
    try:
        mark = await asyncio.to_thread(wal.last_mark)
        records = await asyncio.to_thread(lambda: list(wal.recover(mark)))
    except BaseException:
        await wal.close()
        raise
    return wal, records


async def recover_all(settings: Settings) -> list[WalRecord]:
    """What a recovery finds, the medium closed again."""
    wal, records = await open_wal(settings)
    await wal.close()
    return records


async def started(settings: Settings, **kwargs: Any) -> BlockWal:
    wal, _ = await open_wal(settings, **kwargs)
    await wal.start()
    return wal


def record(ledger: int, entry: int, rng: random.Random, size: int | None = None) -> WalRecord:
    n = rng.randrange(0, 1500) if size is None else size
    return WalRecord(ledger, entry, rng.randbytes(n))


def append(wal: BlockWal, rec: WalRecord) -> asyncio.Future[LogMark]:
    return wal.append(rec.ledger_id, rec.entry_id, record_crc(*rec), rec.payload)


async def write_groups(
    wal: BlockWal, groups: int, rng: random.Random
) -> tuple[list[list[WalRecord]], list[int]]:
    """``groups`` groups of GROUP records, each closed into a block of its own by a sync
    point. Returns the groups and each block's [start, end) boundaries (len groups + 1)."""
    written: list[list[WalRecord]] = []
    bounds = [wal.durable_offset]
    for g in range(groups):
        group = [record(1, g * GROUP + i, rng) for i in range(GROUP)]
        futures = [append(wal, rec) for rec in group]
        mark = await wal.sync_point()
        assert all(f.result() == mark for f in futures)  # one block, one shared mark
        written.append(group)
        bounds.append(mark.offset)
    return written, bounds


def physical(offset: int, capacity: int = RING) -> int:
    return HEADER_AREA + offset % (capacity - HEADER_AREA)


async def checkpoint(wal: BlockWal) -> LogMark:
    mark = await wal.checkpoint_point()
    await asyncio.to_thread(wal.checkpoint_complete, mark)
    return mark


# --- formats (property tests) -------------------------------------------------------------------


@given(
    capacity=st.integers(HEADER_AREA, (1 << 64) - 1),
    trim=st.integers(1, (1 << 63) - 1),  # logical offsets start a lap or more in
    sequence=U64,
    written_ms=U64,
    window=U64,
    node_id=U64,
    shutdown=st.sampled_from(Shutdown),
    records=st.one_of(st.none(), st.integers(0, (1 << 63) - 1)),
)
def test_header_round_trip(
    capacity: int,
    trim: int,
    sequence: int,
    written_ms: int,
    window: int,
    node_id: int,
    shutdown: Shutdown,
    records: int | None,
) -> None:
    end = 0 if records is None else trim + min(records, capacity - HEADER_AREA)
    header = WalHeader(capacity, trim, sequence, written_ms, window, node_id, shutdown, end)
    data = ringformat.encode_header(header)
    assert len(data) == HEADER_SIZE == 88
    assert data[:4] == b"BKWH"
    assert ringformat.decode_header(data.ljust(HEADER_SLOT_SIZE, b"\0")) == header


@pytest.mark.parametrize("end", [8192 - 4096, 8192 + RING - HEADER_AREA + 4096])
def test_header_with_an_end_offset_outside_the_ring_is_refused(end: int) -> None:
    header = WalHeader(RING, 8192, 7, 1, 4096, 3, Shutdown.GRACEFUL, end)
    with pytest.raises(ValueError, match="end offset"):
        ringformat.decode_header(ringformat.encode_header(header))


@given(position=st.integers(0, HEADER_SIZE - 1), bit=st.integers(0, 7))
def test_header_with_any_flipped_bit_is_refused(position: int, bit: int) -> None:
    data = bytearray(
        ringformat.encode_header(WalHeader(RING, 8192, 7, 1, 4096, 3, Shutdown.GRACEFUL))
    )
    data[position] ^= 1 << bit
    with pytest.raises(ValueError):
        ringformat.decode_header(bytes(data))


def test_header_of_another_version_is_refused() -> None:
    header = WalHeader(RING, 0, 1, 0, 0, 0, Shutdown.GRACEFUL, version=ringformat.VERSION + 1)
    with pytest.raises(ValueError, match="version"):
        ringformat.decode_header(ringformat.encode_header(header))


@given(
    magic=st.sampled_from([DATA_MAGIC, PADDING_MAGIC]),
    length=U32,
    offset=st.integers(0, (1 << 64) - 1 - RECORD_HEADER_SIZE),
    crc=U32,
)
def test_record_header_round_trip(magic: bytes, length: int, offset: int, crc: int) -> None:
    data = ringformat.encode_record_header(magic, length, offset + RECORD_HEADER_SIZE, crc)
    assert len(data) == RECORD_HEADER_SIZE == 24
    assert ringformat.decode_record_header(data, offset) == (magic, length, crc)
    # The same bytes read as a record of another lap (or another place) are refused.
    assert isinstance(ringformat.decode_record_header(data, offset ^ BLOCK_ALIGNMENT), str)


@given(position=st.integers(0, RECORD_HEADER_SIZE - 1), bit=st.integers(0, 7))
def test_record_header_with_any_flipped_bit_is_refused(position: int, bit: int) -> None:
    data = bytearray(ringformat.encode_record_header(DATA_MAGIC, 100, 4096 + 24, 12345))
    data[position] ^= 1 << bit
    assert isinstance(ringformat.decode_record_header(bytes(data), 4096), str)


def _build_ring(
    capacity: int, start: int, groups: list[list[bytes]]
) -> tuple[bytearray, list[tuple[int, int, list[WalRecord]]]]:
    """A ring in memory, packed as the spec says (an independent model of the writer):
    returns it and each block's (start, end, records)."""
    area = capacity - HEADER_AREA
    ring = bytearray(capacity)
    blocks = []
    offset = start
    for g, payloads in enumerate(groups):
        records = [WalRecord(g, i, p) for i, p in enumerate(payloads)]
        size = sum(ringformat.RECORD_OVERHEAD + len(p) for p in payloads)
        to_end = area - offset % area
        if size > to_end:  # padding to the end, the block at the start of the next lap
            pad = ringformat.encode_record_header(
                PADDING_MAGIC, to_end - RECORD_HEADER_SIZE, offset + RECORD_HEADER_SIZE, 0
            )
            ring[physical(offset, capacity) : physical(offset, capacity) + len(pad)] = pad
            offset += to_end
        at = offset
        for rec in records:
            body = ringformat.BODY_PREFIX.pack(rec.ledger_id, rec.entry_id) + rec.payload
            head = ringformat.encode_record_header(
                DATA_MAGIC, len(body), at + RECORD_HEADER_SIZE, record_crc(*rec)
            )
            where = physical(at, capacity)
            ring[where : where + len(head) + len(body)] = head + body
            at += len(head) + len(body)
        end = offset + ringformat.align_up(size)
        blocks.append((offset, end, records))
        offset = end
    return ring, blocks


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(
        st.lists(st.binary(max_size=3000), min_size=1, max_size=6), min_size=1, max_size=14
    ),
    lap=st.integers(0, 5),
    position=st.integers(0, 15),
    lost=st.integers(0, 100),
    data=st.data(),
)
def test_scan_finds_every_record_around_the_end_and_past_a_hole(
    groups: list[list[bytes]], lap: int, position: int, lost: int, data: st.DataObject
) -> None:
    capacity = 72 * KiB  # 16 blocks of 4 KiB: the groups wrap it
    area = capacity - HEADER_AREA
    start = lap * area + position * BLOCK_ALIGNMENT
    total = sum(ringformat.align_up(sum(40 + len(p) for p in g)) for g in groups)
    if total + area // 2 > area:  # keep the model within one lap (no self-overwrite)
        groups = groups[:2]
    ring, blocks = _build_ring(capacity, start, groups)
    stale = data.draw(st.booleans())
    if stale:  # the same bytes one lap earlier must not be read as this lap's
        start += area
    lose = lost % len(blocks) if len(blocks) > 1 and lost < 50 else None
    if lose is not None and not stale:
        begin, end, _ = blocks[lose]
        for o in range(begin, end, BLOCK_ALIGNMENT):
            ring[physical(o, capacity) : physical(o, capacity) + BLOCK_ALIGNMENT] = bytes(
                BLOCK_ALIGNMENT
            )

    def read(at: int, n: int) -> bytes:
        return bytes(ring[at : at + n])

    scan = RingScan(read, capacity, start, window=area)
    found = [e.record for e in scan if e.kind is ScanKind.RECORD]
    if stale:
        assert found == []
        return
    expected = [r for i, (_, _, recs) in enumerate(blocks) if i != lose for r in recs]
    assert found == expected
    if lose is not None and lose < len(blocks) - 1:
        assert [h.offset for h in scan.holes] == [blocks[lose][0]]


# --- round trips and wrap-around ---------------------------------------------------------------


async def test_records_round_trip_and_survive_a_restart(medium: Path, tmp_path: Path) -> None:
    settings = wal_settings(tmp_path / "data", medium)
    wal = await started(settings)
    rng = random.Random(1)
    sizes = [0, 1, 23, 24, 4096 - 40, 4096 - 39, 4096, MAX_ENTRY, 70_000]  # 70 KB: metadata
    written = [record(rng.randrange(1 << 63), i - 5, rng, size) for i, size in enumerate(sizes)]
    written += [record(7, i, rng) for i in range(500)]
    futures = [append(wal, rec) for rec in written]
    marks = await asyncio.gather(*futures)
    assert marks == sorted(marks)  # acknowledged in offset order
    assert wal.direct_io
    await wal.close()

    again, recovered = await open_wal(settings)
    assert recovered == written
    await again.start()
    more = [record(8, i, rng) for i in range(50)]
    await asyncio.gather(*(append(again, rec) for rec in more))
    await again.close()
    recovered = await recover_all(settings)
    assert recovered == written + more


async def test_wraps_around_many_times_with_checkpoints_on_request(
    medium: Path, tmp_path: Path
) -> None:
    """Two hundred times the ring's size goes through it; the WAL asks for checkpoints as it
    fills and appends wait for them. What was not checkpointed comes back, nothing else."""
    requested = asyncio.Event()
    settings = wal_settings(tmp_path / "data", medium)
    wal = await started(settings, request_checkpoint=requested.set)
    first = wal.durable_offset
    rng = random.Random(2)
    acked: list[tuple[WalRecord, int]] = []
    trims: list[int] = []
    writing = True

    async def checkpointer() -> None:
        while writing:
            await requested.wait()
            requested.clear()
            trims.append((await checkpoint(wal)).offset)

    async def writer(ledger: int) -> None:
        for entry in range(300):
            rec = record(ledger, entry, rng, rng.choice([rng.randrange(2000), MAX_ENTRY]))
            acked.append((rec, (await append(wal, rec)).offset))

    task = asyncio.create_task(checkpointer())
    await asyncio.gather(*(writer(ledger) for ledger in range(20)))
    writing = False
    requested.set()
    await task
    laps = (wal.durable_offset - first) / (RING - HEADER_AREA)
    assert laps > 50, laps
    assert len(trims) > 50
    await wal.close()

    again, recovered = await open_wal(settings)
    trim = (await asyncio.to_thread(again.last_mark)).offset
    await again.close()
    assert trim == trims[-1]
    acked.sort(key=lambda pair: pair[1])
    assert recovered == [rec for rec, mark in acked if mark > trim]


async def test_trim_then_recover_after_a_crash(medium: Path, tmp_path: Path) -> None:
    settings = wal_settings(tmp_path / "data", medium)
    wal = await started(settings)
    rng = random.Random(3)
    before = [record(1, i, rng) for i in range(40)]
    await asyncio.gather(*(append(wal, rec) for rec in before))
    mark = await checkpoint(wal)
    after = [record(1, 40 + i, rng) for i in range(40)]
    await asyncio.gather(*(append(wal, rec) for rec in after))
    image = await asyncio.to_thread(snapshot, medium, RING)  # the crash: no graceful header
    await wal.close()
    await asyncio.to_thread(restore, medium, image)

    again, recovered = await open_wal(settings)
    assert await asyncio.to_thread(again.last_mark) == mark
    assert recovered == after
    # The next start goes one full ring ahead; the recovered records keep their space until
    # a checkpoint trims them.
    await again.start()
    assert again.durable_offset == mark.offset + RING - HEADER_AREA
    late = record(2, 0, rng)
    pending = append(again, late)
    await asyncio.sleep(0.05)
    assert not pending.done(), "a block overwrote recovered records before they were trimmed"
    await checkpoint(again)
    await pending
    await again.close()
    recovered = await recover_all(settings)
    assert recovered == [late]


async def test_a_cancelled_append_does_not_fail_the_others_of_its_block(
    loop_medium: Path, tmp_path: Path
) -> None:
    """Appends of a block share one future: one waiter cancelled (a client gone) must not
    cancel it for the rest; the cancelled one ends when the block does."""
    wal = await started(wal_settings(tmp_path / "data", loop_medium))
    rng = random.Random(20)
    records = [record(1, i, rng) for i in range(10)]
    futures = [append(wal, rec) for rec in records]
    assert len(set(map(id, futures))) == 1  # one block

    async def add(future: asyncio.Future[LogMark]) -> LogMark:
        return await future

    tasks = [asyncio.create_task(add(f)) for f in futures]
    await asyncio.sleep(0)
    tasks[3].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[3], asyncio.CancelledError)
    assert all(isinstance(r, LogMark) for i, r in enumerate(results) if i != 3)
    await wal.close()
    recovered = await recover_all(wal_settings(tmp_path / "data", loop_medium))
    assert recovered == records


async def test_write_rate_limit_spaces_the_blocks(loop_medium: Path, tmp_path: Path) -> None:
    rate = 200
    wal = await started(wal_settings(tmp_path / "data", loop_medium, wal_write_rate_limit=rate))
    rng = random.Random(21)
    began = time.monotonic()
    for i in range(40):  # one at a time: every append is a block of its own
        await append(wal, record(1, i, rng))
    elapsed = time.monotonic() - began
    burst = wal_settings(tmp_path, loop_medium).wal_io_depth  # blocks at once, then paced
    assert elapsed >= (40 - burst) / rate * 0.9, elapsed
    assert wal.blocks_written == 40
    await wal.close()


async def test_ring_figures_for_metrics(loop_medium: Path, tmp_path: Path) -> None:
    """What the metrics read: the ring's size, the bytes from the trim to the newest block
    (the one taking appends included), blocks being written."""
    wal = await started(wal_settings(tmp_path / "data", loop_medium))
    start = wal.durable_offset
    assert (wal.ring_bytes, wal.ring_used_bytes, wal.blocks_in_flight) == (RING - HEADER_AREA, 0, 0)
    rng = random.Random(26)
    futures = [append(wal, record(1, i, rng, 1000)) for i in range(10)]  # one block, 10,400 B
    assert wal.ring_used_bytes == 3 * BLOCK_ALIGNMENT and wal.blocks_in_flight == 0
    await asyncio.sleep(0)  # the pump hands the block over; its completion comes back later
    assert wal.blocks_in_flight == 1
    await asyncio.gather(*futures)
    assert wal.blocks_in_flight == 0
    assert wal.ring_used_bytes == wal.durable_offset - start == 3 * BLOCK_ALIGNMENT
    await checkpoint(wal)
    assert wal.ring_used_bytes == 0
    await wal.close()


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A file system without O_DIRECT (ramfs refuses the flag)."""
    mount_point = tmp_path / "ramfs"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "ramfs", "ramfs", str(mount_point)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.fail(f"cannot mount a ramfs (root is needed): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        done = subprocess.run(["umount", str(mount_point)], capture_output=True, text=True)
        if done.returncode != 0:  # a file left open: detach it anyway, and say so
            subprocess.run(["umount", "--lazy", str(mount_point)], check=False)
            pytest.fail(f"the ramfs was still busy after the test: {done.stderr.strip()}")


@pytest.mark.parametrize("volatile", [True, False], ids=["volatile-cache", "no-volatile-cache"])
async def test_a_file_system_without_o_direct_falls_back_to_the_page_cache(
    ramfs: Path, tmp_path: Path, volatile: bool
) -> None:
    """Through the page cache the blocks are fdatasync'ed before their acknowledgment, even
    where the settings say the device has no volatile write cache: the page cache is one."""
    settings = wal_settings(
        tmp_path / "data", ramfs / "wal.ring", wal_volatile_write_cache=volatile
    )
    wal = await started(settings)
    assert not wal.direct_io
    rng = random.Random(22)
    written = [record(1, i, rng) for i in range(100)]
    await asyncio.gather(*(append(wal, rec) for rec in written))
    assert wal.fdatasyncs > 0
    await wal.close()
    recovered = await recover_all(settings)
    assert recovered == written


async def test_without_a_volatile_write_cache_direct_writes_are_not_flushed(
    loop_medium: Path, tmp_path: Path
) -> None:
    """With O_DIRECT on a device without a volatile cache (EBS), a completed write is durable:
    no fdatasync, as the setting says."""
    settings = wal_settings(tmp_path / "data", loop_medium, wal_volatile_write_cache=False)
    wal = await started(settings)
    assert wal.direct_io
    rng = random.Random(23)
    written = [record(1, i, rng) for i in range(100)]
    await asyncio.gather(*(append(wal, rec) for rec in written))
    assert wal.fdatasyncs == 0
    await wal.close()
    assert await recover_all(settings) == written


# --- damage: torn blocks, header slots, holes ---------------------------------------------------


async def test_torn_last_block_loses_only_what_it_held(medium: Path, tmp_path: Path) -> None:
    settings = wal_settings(tmp_path / "data", medium)
    wal = await started(settings)
    groups, bounds = await write_groups(wal, 6, random.Random(4))
    image = await asyncio.to_thread(snapshot, medium, RING)
    await wal.close()
    # The last block was torn: its first sectors reached the disk, the rest did not.
    start, end = bounds[-2], bounds[-1]
    tear = start + (end - start) // 2 // 512 * 512
    image[physical(tear) : physical(start) + (end - start)] = bytes(end - tear)
    await asyncio.to_thread(restore, medium, image)

    recovered = await recover_all(settings)
    whole: list[WalRecord] = []
    at = start
    for rec in groups[-1]:
        at += ringformat.RECORD_OVERHEAD + len(rec.payload)
        if at <= tear:
            whole.append(rec)
    assert recovered == [r for g in groups[:-1] for r in g] + whole


async def test_a_corrupt_header_slot_loses_to_the_other(medium: Path, tmp_path: Path) -> None:
    settings = wal_settings(tmp_path / "data", medium)
    wal = await started(settings)
    await write_groups(wal, 1, random.Random(5))
    older = await checkpoint(wal)
    middle, _ = await write_groups(wal, 1, random.Random(6))
    newer = await checkpoint(wal)
    last, _ = await write_groups(wal, 1, random.Random(7))
    image = await asyncio.to_thread(snapshot, medium, RING)
    await wal.close()
    slots = [ringformat.decode_header(image[i * HEADER_SLOT_SIZE :]) for i in range(2)]
    newest = max(range(2), key=lambda i: slots[i].sequence)
    assert slots[newest].trim == newer.offset
    assert slots[1 - newest].trim == older.offset

    # The newest slot torn (a crash in the middle of its write): the older one wins, and
    # recovery starts from its (earlier) trim offset: more records, none lost.
    torn = bytearray(image)
    torn[newest * HEADER_SLOT_SIZE + 20] ^= 0xFF
    await asyncio.to_thread(restore, medium, torn)
    again, recovered = await open_wal(settings)
    assert await asyncio.to_thread(again.last_mark) == older
    assert recovered == middle[0] + last[0]
    await again.close()

    # The older slot corrupt: the newest wins as usual.
    rotten = bytearray(image)
    rotten[(1 - newest) * HEADER_SLOT_SIZE + 9] ^= 0x01
    await asyncio.to_thread(restore, medium, rotten)
    again, recovered = await open_wal(settings)
    assert await asyncio.to_thread(again.last_mark) == newer
    assert recovered == last[0]
    await again.close()

    # Both corrupt: the trim offset is lost, the start is refused, naming the path.
    both = bytearray(torn)
    both[(1 - newest) * HEADER_SLOT_SIZE + 9] ^= 0x01
    await asyncio.to_thread(restore, medium, both)
    with pytest.raises(CorruptRecord, match="both WAL header slots") as refused:
        await open_wal(settings)
    assert refused.value.path == str(medium) and refused.value.offset == 0


async def test_hole_left_by_a_block_in_flight(medium: Path, tmp_path: Path) -> None:
    """Blocks are written by several threads: at a crash a later block may be on disk and an
    earlier one not. Recovery reads past the hole (within the window) and goes on."""
    settings = wal_settings(tmp_path / "data", medium)
    wal = await started(settings)
    groups, bounds = await write_groups(wal, 6, random.Random(8))
    image = await asyncio.to_thread(snapshot, medium, RING)
    await wal.close()
    hole = 3
    begin, end = physical(bounds[hole]), physical(bounds[hole + 1])
    image[begin:end] = bytes(end - begin)  # the fourth block never reached the disk
    await asyncio.to_thread(restore, medium, image)

    again, recovered = await open_wal(settings)
    assert recovered == [r for i, g in enumerate(groups) if i != hole for r in g]
    # Writing goes on a lap ahead, once the engine's first checkpoint has trimmed what was
    # recovered; a second crash recovers the new records and nothing of the old lap.
    await again.start()
    await checkpoint(again)
    late, _ = await write_groups(again, 2, random.Random(9))
    image = await asyncio.to_thread(snapshot, medium, RING)
    await again.close()
    await asyncio.to_thread(restore, medium, image)
    recovered = await recover_all(settings)
    assert recovered == [r for g in late for r in g]


async def test_hole_after_a_graceful_shutdown_is_corruption(medium: Path, tmp_path: Path) -> None:
    settings = wal_settings(tmp_path / "data", medium)
    wal = await started(settings)
    groups, bounds = await write_groups(wal, 5, random.Random(10))
    await wal.close()  # graceful: no block was in flight
    image = await asyncio.to_thread(snapshot, medium, RING)
    begin = physical(bounds[2])
    image[begin : begin + BLOCK_ALIGNMENT] = bytes(BLOCK_ALIGNMENT)
    await asyncio.to_thread(restore, medium, image)

    with pytest.raises(CorruptRecord, match="graceful shutdown") as refused:
        await open_wal(settings)
    assert refused.value.offset == bounds[2] and refused.value.path == str(medium)
    skipping = wal_settings(tmp_path / "data", medium, skip_replay_journal_invalid_record=True)
    recovered = await recover_all(skipping)
    assert recovered == [r for i, g in enumerate(groups) if i != 2 for r in g]


def _newest_header(medium: Path) -> WalHeader:
    image = snapshot(medium, HEADER_AREA)
    slots = [ringformat.decode_header(image[i * HEADER_SLOT_SIZE :]) for i in range(2)]
    return max(slots, key=lambda header: header.sequence)


@pytest.mark.parametrize("alone", [True, False], ids=["own block", "end of a block"])
@pytest.mark.parametrize("damage", ["body byte", "header byte", "torn tail"])
async def test_damaged_last_record_after_a_graceful_shutdown_is_corruption(
    medium: Path, tmp_path: Path, damage: str, alone: bool
) -> None:
    """A graceful shutdown records where the records end, so the very last record damaged (a
    flipped byte, or its block's second half never written) is corruption, not a torn tail,
    whether it starts its block or ends one: the start is refused, naming its offset. With
    skip_replay_journal_invalid_record the others come back, never its bad bytes."""
    settings = wal_settings(tmp_path / "data", medium)
    wal = await started(settings)
    rng = random.Random(23)
    groups, bounds = await write_groups(wal, 3, rng)
    tail = [record(2, i, rng, 1000) for i in range(1 if alone else 3)]
    futures = [append(wal, rec) for rec in tail]
    block_end = (await wal.sync_point()).offset
    assert all(f.result().offset == block_end for f in futures)  # one block
    await wal.close()  # graceful: nothing in flight
    assert (await asyncio.to_thread(_newest_header, medium)).end == block_end
    last = bounds[-1] + sum(ringformat.RECORD_OVERHEAD + len(r.payload) for r in tail[:-1])
    image = await asyncio.to_thread(snapshot, medium, RING)
    at = physical(last)
    if damage == "body byte":
        image[at + RECORD_HEADER_SIZE + 500] ^= 0xFF
    elif damage == "header byte":
        image[at + 9] ^= 0x01  # the body offset
    else:  # the first sectors of the block landed, the rest (inside the record) did not
        tear = (at + RECORD_HEADER_SIZE + 512) // 512 * 512
        image[tear : physical(block_end - 1) + 1] = bytes(physical(block_end - 1) + 1 - tear)
    await asyncio.to_thread(restore, medium, image)

    with pytest.raises(CorruptRecord, match="graceful shutdown") as refused:
        await open_wal(settings)
    assert refused.value.offset == last and refused.value.path == str(medium)
    assert f"before offset {block_end} where the records end" in str(refused.value)
    assert "skip_replay_journal_invalid_record=true" in str(refused.value)

    skipping = wal_settings(tmp_path / "data", medium, skip_replay_journal_invalid_record=True)
    again, recovered = await open_wal(skipping)
    expected = [r for g in groups for r in g] + tail[:-1]
    assert recovered == expected
    # Writing goes on after the end; the damage stays until a checkpoint trims it, so the
    # next graceful stop cannot vouch for the ring (no end offset) and the next start
    # takes it as after a crash: not refused again, the damaged record still not returned.
    await again.start()
    more = [record(3, i, rng) for i in range(5)]
    await asyncio.gather(*(append(again, rec) for rec in more))
    await again.close()
    header = await asyncio.to_thread(_newest_header, medium)
    assert header.shutdown is Shutdown.GRACEFUL and header.end == 0
    assert await recover_all(settings) == expected + more


async def test_graceful_stop_with_crash_leftovers_untrimmed_is_not_corruption(
    medium: Path, tmp_path: Path
) -> None:
    """A crash leaves a hole; the next run recovers, starts and stops gracefully before any
    checkpoint: the hole is still in the ring, so the header gives no end offset and the next
    start finds the same records rather than refusing. Once a checkpoint has trimmed them, a
    graceful stop vouches for the ring again."""
    settings = wal_settings(tmp_path / "data", medium)
    wal = await started(settings)
    groups, bounds = await write_groups(wal, 5, random.Random(24))
    image = await asyncio.to_thread(snapshot, medium, RING)
    await wal.close()
    begin, end = physical(bounds[2]), physical(bounds[3])
    image[begin:end] = bytes(end - begin)  # the third block was in flight at the crash
    await asyncio.to_thread(restore, medium, image)

    expected = [r for i, g in enumerate(groups) if i != 2 for r in g]
    again, recovered = await open_wal(settings)
    assert recovered == expected
    await again.start()
    await again.close()  # graceful, nothing trimmed
    header = await asyncio.to_thread(_newest_header, medium)
    assert header.shutdown is Shutdown.GRACEFUL and header.end == 0
    again, recovered = await open_wal(settings)
    assert recovered == expected
    await again.start()
    await checkpoint(again)
    late, _ = await write_groups(again, 2, random.Random(25))
    durable = again.durable_offset
    await again.close()
    assert (await asyncio.to_thread(_newest_header, medium)).end == durable
    assert await recover_all(settings) == [r for g in late for r in g]


# --- capacity ----------------------------------------------------------------------------------


async def test_capacity_mismatch_is_refused_with_what_to_do(medium: Path, tmp_path: Path) -> None:
    wal = await started(wal_settings(tmp_path / "data", medium))
    await wal.close()
    other = wal_settings(tmp_path / "data", medium, capacity=RING - 64 * KiB)
    with pytest.raises(WalDeviceError, match=f"NODE_WAL_CAPACITY={RING}"):
        await open_wal(other)


def test_too_small_device_or_file_is_refused(tmp_path: Path) -> None:
    with loop_device(tmp_path / "small.img", RING // 2) as device:
        wal = BlockWal(wal_settings(tmp_path / "data", device), SystemClock(), Faults())
        with pytest.raises(WalDeviceError, match="device holds 524288 bytes, less than"):
            wal.last_mark()
    short = tmp_path / "short.ring"
    short.write_bytes(bytes(RING // 2))
    wal = BlockWal(wal_settings(tmp_path / "data", short), SystemClock(), Faults())
    with pytest.raises(WalDeviceError, match="file holds 524288 bytes"):
        wal.last_mark()


def test_capacity_too_small_for_the_largest_entry_is_refused(tmp_path: Path) -> None:
    settings = wal_settings(tmp_path / "data", tmp_path / "w.ring", max_entry_size=1 * MiB)
    with pytest.raises(WalDeviceError, match="max_entry_size"):
        BlockWal(settings, SystemClock(), Faults())


def test_capacity_off_the_block_size_is_refused_by_the_settings(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="wal_capacity must be a multiple of 4096"):
        wal_settings(tmp_path / "data", tmp_path / "w.ring", capacity=RING + 512)


async def test_a_missing_device_is_refused(tmp_path: Path) -> None:
    with pytest.raises(WalDeviceError, match="does not exist"):
        await open_wal(wal_settings(tmp_path / "data", Path("/dev/no-such-wal-device")))


# --- a full ring --------------------------------------------------------------------------------


async def test_full_ring_waits_then_refuses_with_backpressure(
    loop_medium: Path, tmp_path: Path
) -> None:
    """Nobody checkpoints: appends wait, then are refused with Backpressure, and none of
    their records is ever written (the engine forgets them); after a checkpoint the ring
    takes appends again."""
    asked: list[float] = []
    settings = wal_settings(tmp_path / "data", loop_medium, db_storage_max_throttle_time_ms=200)
    wal = await started(settings, request_checkpoint=lambda: asked.append(time.monotonic()))
    start = wal.durable_offset
    rng = random.Random(11)
    written = [record(1, i, rng, 16 * KiB) for i in range(100)]  # 1.6 rings
    futures = [append(wal, rec) for rec in written]
    await asyncio.sleep(1.0)  # well past the throttle time
    assert asked, "the WAL never asked for a checkpoint"
    acknowledged = [f for f in futures if f.done() and f.exception() is None]
    refused = [f for f in futures if f.done() and isinstance(f.exception(), Backpressure)]
    assert acknowledged and refused and len(acknowledged) + len(refused) == len(futures)
    assert futures[: len(acknowledged)] == acknowledged  # a prefix, in order
    assert wal.queued_bytes == 0
    # Every refused append waited first; every acknowledged one fitted at once.
    assert wal.rejected_appends == wal.throttled_appends == len(refused)
    assert wal.ring_used_bytes == wal.durable_offset - start > (RING - HEADER_AREA) // 2
    await checkpoint(wal)
    assert wal.ring_used_bytes == 0
    later = [record(2, i, rng, 16 * KiB) for i in range(10)]
    await asyncio.gather(*(append(wal, rec) for rec in later))
    assert wal.throttled_appends == len(refused)
    await wal.close()
    recovered = await recover_all(settings)
    assert recovered == later  # the checkpoint trimmed the acknowledged ones


# --- the engine on the ring ---------------------------------------------------------------------


async def test_ledger_storage_on_a_small_ring(loop_medium: Path, tmp_path: Path) -> None:
    """The engine with wal_kind=blockdev on the smallest ring its entry size allows: the ring
    wraps many times over ~12 MB of adds, asking for checkpoints itself (the interval is an
    hour), and appends now and then find it full and wait; every entry reads back, across a
    restart too."""
    ring = ringformat.minimum_capacity(wal_settings(tmp_path, loop_medium)) + 2 * BLOCK_ALIGNMENT
    settings = wal_settings(tmp_path / "data", loop_medium, ring, flush_interval_ms=3_600_000)
    storage = LedgerStorage(settings)
    await storage.start()
    rng = random.Random(12)
    payloads: dict[int, list[bytes]] = {}
    try:
        ledgers = [(await storage.create_ledger())[0].ledger_id for _ in range(8)]

        async def writer(ledger: int) -> None:
            mine = payloads.setdefault(ledger, [])
            for _ in range(75):
                data = rng.randbytes(rng.choice([100, 20_000]))
                await storage.add_entry(ledger, None, data)
                mine.append(data)

        await asyncio.gather(*(writer(lid) for lid in ledgers))
        assert storage.stats.checkpoints > 10
        wal = storage._wal
        assert isinstance(wal, BlockWal) and wal.throttled_appends > 0
    finally:
        await storage.close()
    storage = LedgerStorage(settings)
    await storage.start()
    try:
        assert storage.stats.replayed_records == 0
        for ledger, expected in payloads.items():
            got = [p async for _, p in storage.read_range(ledger, 0)]
            assert got == expected
    finally:
        await storage.close()


# --- SIGKILL of a writer process ----------------------------------------------------------------

KILL_TRIALS = 20
KILL_RING = 2 * MiB
WRITER_START_S = 60.0  # for the writer's first line: its interpreter's start, on a busy machine


def _read_lines(proc: subprocess.Popen[str], run_s: float) -> list[str]:
    """Lines the writer printed in ``run_s`` from its first one (then it is killed): the kill
    lands in its writing, however long its interpreter took to start."""
    assert proc.stdout is not None
    lines: list[str] = []
    until = time.monotonic() + WRITER_START_S
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < until:
            if not selector.select(max(0.0, until - time.monotonic())):
                break
            line = proc.stdout.readline()  # the writer prints whole lines, flushed
            if not line:
                break
            if not lines:
                until = time.monotonic() + run_s
            lines.append(line.rstrip("\n"))
    return lines


@pytest.mark.parametrize("sync_mode", ["fdatasync", "dsync"])
def test_sigkill_of_a_writer_at_random_moments_loses_nothing_acknowledged(
    medium: Path, tmp_path: Path, sync_mode: str
) -> None:
    """A writer process appends (and trims when the ring asks) until SIGKILL at a random
    moment; every record it was told was durable comes back byte for byte, in order, unless
    a durable trim covers it. Twenty trials on one ring, each starting from the last."""
    rng = random.Random(13)
    data_dir = tmp_path / "data"
    settings = blockwal_writer.settings_for(medium, KILL_RING, data_dir, sync_mode)
    acked: dict[tuple[int, int], tuple[int, int]] = {}  # (trial, seq) -> (size, mark)
    durable_trim = 0
    totals = {"acked": 0, "trims": 0}
    for trial in range(1, KILL_TRIALS + 1):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.storage.blockwal_writer",
                str(medium),
                str(KILL_RING),
                str(trial),
                str(data_dir),
                sync_mode,
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        try:
            lines = _read_lines(proc, rng.uniform(0.35, 1.1))
        finally:
            proc.send_signal(signal.SIGKILL)
            assert proc.stdout is not None
            lines += proc.stdout.read().splitlines()  # printed before the kill
            proc.stdout.close()
            proc.wait()
        for line in lines:
            kind, *values = line.split()
            if kind == "ack":
                seq, size, mark = map(int, values)
                acked[(trial, seq)] = (size, mark)
                totals["acked"] += 1
            elif kind == "trim":
                durable_trim = max(durable_trim, int(values[0]))
                totals["trims"] += 1

        wal = BlockWal(settings, SystemClock(), Faults())
        mark = wal.last_mark()
        recovered = list(wal.recover(mark))
        asyncio.run(wal.close())
        assert mark.offset >= durable_trim, "a durable trim went back"
        keys = [(r.ledger_id, r.entry_id) for r in recovered]
        assert keys == sorted(keys), f"trial {trial}: records out of order"
        for rec in recovered:
            size = len(rec.payload)
            assert rec.payload == blockwal_writer.payload(rec.ledger_id, rec.entry_id, size)
        found = set(keys)
        expected = [key for key, (_, end) in acked.items() if end > mark.offset]
        lost = [key for key in expected if key not in found]
        assert not lost, f"trial {trial}: acknowledged records lost: {lost[:10]}"
        for key in list(acked):  # trimmed: gone for good, and rightly
            if acked[key][1] <= mark.offset:
                del acked[key]
    assert totals["acked"] > 5000, totals
    assert totals["trims"] > 20, totals
