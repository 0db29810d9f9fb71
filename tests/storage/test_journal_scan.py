"""Property tests of the file journal: what is written is recovered byte for byte, in order,
across rotations and from any mark; group writes are 512-byte aligned; a torn tail is cut;
corruption followed by valid data is refused (or skipped when allowed).

Each hypothesis example writes real journal files with the real Journal class in its own
temporary directory (tmp_path is per test function, not per example).
"""

from __future__ import annotations

import asyncio
import os
import struct
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from node.settings import Settings, load
from node.storage.clock import SystemClock
from node.storage.errors import CorruptRecord, JournalFailed
from node.storage.faults import Faults
from node.storage.journal import Journal
from node.storage.journalformat import (
    GROUP_START,
    GROUP_START_ENTRY_ID,
    HEADER_SIZE,
    PADDING_MASK,
    VERSION,
    encode_group_start,
    journal_path,
    list_journals,
)
from node.storage.wal import (
    CLOSE,
    DELETE,
    EXPLICIT_LAC,
    FENCE,
    LEDGER_CREATED,
    REPLAY_RUN_ENTRIES,
    EntryRun,
    LogMark,
    WalRecord,
    record_crc,
)
from tests.harness.files import flip_byte

ALIGN = 512
PRE_ALLOC = 1 << 20
RECORD_HEADER = struct.Struct(">IqqI")  # len | ledger id | entry id | crc32c (journal.py's layout)
PADDING_HEADER = struct.Struct(">II")  # 0xFFFFFF00 | pad len
MASK_BYTES = PADDING_HEADER.pack(PADDING_MASK, 0)[:4]
METADATA_KINDS = [LEDGER_CREATED, FENCE, CLOSE, DELETE, EXPLICIT_LAC]

Rec = tuple[int, int, bytes]


def _filler(args: tuple[int, int]) -> bytes:
    size, byte = args
    return bytes([byte]) * size


PAYLOADS = st.one_of(
    st.binary(max_size=80),
    st.tuples(st.integers(0, 2500), st.integers(0, 255)).map(_filler),
)
RECORDS = st.tuples(
    st.integers(0, (1 << 63) - 1),
    st.one_of(st.integers(0, (1 << 63) - 1), st.sampled_from(METADATA_KINDS)),
    PAYLOADS,
)
GROUPS = st.lists(st.lists(RECORDS, min_size=1, max_size=6), min_size=1, max_size=8)
MAX_SIZES = st.sampled_from([1024, 4096, 64 << 10])


class Placed(NamedTuple):
    record: WalRecord
    log_id: int
    offset: int
    group: int


def journal_settings(root: Path, **overrides: Any) -> Settings:
    """Settings for a journal alone: small files, so that scans cross rotations."""
    values: dict[str, Any] = {
        "data_dir": root / "d",
        "journal_pre_alloc_size": PRE_ALLOC,
        "journal_max_size": 64 << 10,
    }
    values.update(overrides)
    return load(**values)


def new_journal(s: Settings) -> Journal:
    return Journal(s, SystemClock(), Faults())


START = LogMark(0, 0)


def recover_all(s: Settings, mark: LogMark = START) -> list[WalRecord]:
    return list(new_journal(s).recover(mark))


def group_end(n: int) -> int:
    """Where a group whose records end at ``n`` ends: the next sector boundary, or the one
    after it when the gap is too small for the 8-byte padding record."""
    if n % ALIGN == 0:
        return n
    end = -(-n // ALIGN) * ALIGN
    return end if end - n >= PADDING_HEADER.size else end + ALIGN


def append(j: Journal, rec: Rec) -> asyncio.Future[LogMark]:
    lid, eid, payload = rec
    return j.append(lid, eid, record_crc(lid, eid, payload), payload)


async def write_groups(
    s: Settings, groups: Sequence[Sequence[Rec]]
) -> tuple[list[Placed], list[LogMark]]:
    """Append each group's records in one go, then await them: one group commit each.
    Returns where every record landed (derived from the marks) and each group's mark."""
    j = new_journal(s)
    await j.start()
    placed: list[Placed] = []
    marks: list[LogMark] = []
    previous: LogMark | None = None
    try:
        for g, group in enumerate(groups):
            futures = [append(j, rec) for rec in group]
            results = [await f for f in futures]
            mark = results[-1]
            assert all(m == mark for m in results)  # one group, one write, one mark
            assert mark.offset % ALIGN == 0  # the group write ends on a sector boundary
            if previous is None:
                assert mark.log_id == 1
                start = HEADER_SIZE
            elif previous.offset >= s.journal_max_size:  # the last write rotated the file
                assert mark.log_id == previous.log_id + 1
                start = HEADER_SIZE
            else:
                assert mark.log_id == previous.log_id
                start = previous.offset
            pos = start + len(encode_group_start(start))  # every write opens with one
            for lid, eid, payload in group:
                placed.append(Placed(WalRecord(lid, eid, payload), mark.log_id, pos, g))
                pos += RECORD_HEADER.size + len(payload)
            assert mark.offset == group_end(pos)
            previous = mark
            marks.append(mark)
    finally:
        await j.close()
    return placed, marks


def check_layout(s: Settings, placed: list[Placed], marks: list[LogMark]) -> None:
    """Read the files with an independent parser of journal.py's layout: header, records, one
    padding record closing each unaligned group, zeros (preallocation) after the data."""
    last = marks[-1]
    newest = last.log_id + (1 if last.offset >= s.journal_max_size else 0)
    assert list_journals(s.journal_dir) == list(range(1, newest + 1))
    for log_id in range(1, newest + 1):
        data = journal_path(s.journal_dir, log_id).read_bytes()
        assert data[:4] == b"BKLG"
        assert struct.unpack_from(">I", data, 4) == (VERSION,)
        assert not any(data[8:HEADER_SIZE])
        pos = HEADER_SIZE
        for g, mark in enumerate(marks):
            if mark.log_id != log_id:
                continue
            opener = encode_group_start(pos)  # tagged with its own offset
            assert data[pos : pos + len(opener)] == opener
            length, lid, eid, _crc = RECORD_HEADER.unpack_from(data, pos)
            assert (length, lid, eid) == (GROUP_START.size, 0, GROUP_START_ENTRY_ID)
            pos += len(opener)
            for p in placed:
                if p.group != g:
                    continue
                assert p.offset == pos
                lid, eid, payload = p.record
                crc = record_crc(lid, eid, payload)
                assert RECORD_HEADER.unpack_from(data, pos) == (len(payload), lid, eid, crc)
                pos += RECORD_HEADER.size
                assert data[pos : pos + len(payload)] == payload
                pos += len(payload)
            if pos != mark.offset:
                mask, pad_len = PADDING_HEADER.unpack_from(data, pos)
                assert mask == PADDING_MASK
                assert pos + PADDING_HEADER.size + pad_len == mark.offset
                assert not any(data[pos + PADDING_HEADER.size : mark.offset])
                pos = mark.offset
        if log_id < newest:
            assert len(data) == pos  # a rotated file gives its preallocated tail back
            assert pos >= s.journal_max_size
        else:
            assert len(data) >= pos
            assert len(data) % PRE_ALLOC == 0
            assert not any(data[pos:])


# --- round trips ------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(groups=GROUPS, max_size=MAX_SIZES)
def test_recover_returns_every_record_in_order(groups: list[list[Rec]], max_size: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        s = journal_settings(Path(tmp), journal_max_size=max_size)
        placed, marks = asyncio.run(write_groups(s, groups))
        check_layout(s, placed, marks)
        everything = [p.record for p in placed]
        assert recover_all(s) == everything
        assert recover_all(s) == everything  # recovery of intact files changes nothing
        # a mark returned by an append: exactly the records appended after it
        for g, mark in enumerate(marks):
            assert recover_all(s, mark) == [p.record for p in placed if p.group > g]


STEPS = st.lists(
    st.tuples(
        st.lists(RECORDS, max_size=4),
        st.lists(st.sampled_from(["sync", "yield", "sync", "yield", "sleep", "await"]), max_size=4),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(steps=STEPS, max_size=MAX_SIZES, when_empty=st.booleans())
def test_sync_point_covers_exactly_what_was_appended_before_it(
    steps: list[tuple[list[Rec], list[str]]], max_size: int, when_empty: bool
) -> None:
    """A checkpoint swaps its cache at a sync point: the mark must fall after every record
    appended before the call and before every record appended after it - whether the
    appends are still queued, sealed by an earlier sync point or being written."""

    async def run(s: Settings) -> tuple[list[WalRecord], list[LogMark], list[tuple[int, LogMark]]]:
        j = new_journal(s)
        await j.start()
        records: list[WalRecord] = []
        futures: list[asyncio.Future[LogMark]] = []
        syncs: list[tuple[int, asyncio.Future[LogMark]]] = []
        try:
            for batch, actions in steps:
                for rec in batch:
                    records.append(WalRecord(*rec))
                    futures.append(append(j, rec))
                for action in actions:
                    if action == "sync":
                        syncs.append((len(records), j.sync_point()))
                    elif action == "yield":
                        await asyncio.sleep(0)
                    elif action == "sleep":
                        await asyncio.sleep(0.003)  # past the group wait: a group is written
                    elif futures:
                        await futures[-1]
            marks = [await f for f in futures]
            sync_marks = [(n, await f) for n, f in syncs]
            last = j.sync_point()  # with everything durable already
            sync_marks.append((len(records), await last))
        finally:
            await j.close()
        return records, marks, sync_marks

    with tempfile.TemporaryDirectory() as tmp:
        s = journal_settings(
            Path(tmp), journal_max_size=max_size, journal_flush_when_queue_empty=when_empty
        )
        records, marks, sync_marks = asyncio.run(run(s))
        assert marks == sorted(marks)  # marks never go back
        assert recover_all(s) == records
        for n, mark in sync_marks:
            if n > 0:
                assert mark >= marks[n - 1]  # at or after the last append's mark
            if n < len(marks):
                assert mark < marks[n]  # before the next append's
            assert recover_all(s, mark) == records[n:]


@settings(max_examples=20, deadline=None)
@given(groups=GROUPS)
def test_restart_continues_in_a_new_file(groups: list[list[Rec]]) -> None:
    """A restarted journal opens a new file after the existing ones and recovery reads the
    old and new files in order."""
    half = len(groups) // 2
    with tempfile.TemporaryDirectory() as tmp:
        s = journal_settings(Path(tmp), journal_max_size=4096)
        placed, _marks = asyncio.run(write_groups(s, groups[:half])) if half else ([], [])
        before = list_journals(s.journal_dir)

        async def second() -> list[LogMark]:
            j = new_journal(s)
            await j.start()
            try:
                out = []
                for group in groups[half:]:
                    futures = [append(j, rec) for rec in group]
                    out.append([await f for f in futures][-1])
                return out
            finally:
                await j.close()

        later = asyncio.run(second())
        assert all(m.offset % ALIGN == 0 for m in later)
        assert later[0].log_id == (before[-1] + 1 if before else 1)
        expected = [p.record for p in placed] + [WalRecord(*r) for g in groups[half:] for r in g]
        assert recover_all(s) == expected


def test_close_writes_queued_appends() -> None:
    """Wal.close(): "Write what is queued, fsync, stop the writer" - with appends still
    queued (their futures not awaited yet), close() must write them and return."""

    async def run(s: Settings) -> LogMark:
        j = new_journal(s)
        await j.start()
        future = append(j, (1, 0, b"queued"))
        try:
            await asyncio.wait_for(j.close(), 2)
        except TimeoutError:
            pytest.fail(f"close() hangs with an append queued (its future: {future})")
        assert future.done()
        return future.result()

    with tempfile.TemporaryDirectory() as tmp:
        s = journal_settings(Path(tmp))
        mark = asyncio.run(run(s))
        assert mark == LogMark(1, 2 * ALIGN)
        assert recover_all(s) == [WalRecord(1, 0, b"queued")]


def test_the_writer_starts_the_next_write_while_the_loop_is_busy() -> None:
    """After a write, the writer thread waits (journal_max_group_wait_ms) for the next
    records instead of handing back to the loop: a record appended then is written and
    synced while the loop is still busy (here: blocked), which is how the disk and the
    loop overlap under a full window of adds. And close() wakes a waiting writer at once,
    however long it would wait."""

    async def run(s: Settings) -> tuple[LogMark, LogMark]:
        j = new_journal(s)
        await j.start()
        try:
            first = await append(j, (1, 0, b"first"))
            second = append(j, (1, 1, b"second"))
            deadline = time.monotonic() + 10
            while j.groups_written < 2 and time.monotonic() < deadline:
                pass  # keeps the loop busy on purpose: none of its callbacks runs meanwhile
            assert j.groups_written == 2, "the second record waited for the loop"
        finally:
            began = time.monotonic()
            await j.close()
            assert time.monotonic() - began < 5, "close() waited for the waiting writer"
        return first, second.result()

    with tempfile.TemporaryDirectory() as tmp:
        # A long wait, so that the writer still waits when the second record comes.
        s = journal_settings(Path(tmp), journal_max_group_wait_ms=60_000)
        first, second = asyncio.run(run(s))
        assert first < second
        assert recover_all(s) == [WalRecord(1, 0, b"first"), WalRecord(1, 1, b"second")]


def test_a_lone_record_after_an_idle_gap_finds_the_writer_thread_waiting() -> None:
    """Default settings, a record 20 ms after the last write (a tailing stream's pace, ten
    times journal_max_group_wait_ms): the writer thread still waits for it and writes it
    while the loop is busy. Handing back to the loop after 2 ms made each such record wait
    for a turn of the loop and the executor's hand-off."""

    async def run(s: Settings) -> None:
        j = new_journal(s)
        await j.start()
        try:
            await append(j, (1, 0, b"lone"))  # the first write starts the thread: the loop's
            for entry_id in range(1, 4):
                await asyncio.sleep(0.02)
                lone = append(j, (1, entry_id, b"lone"))
                deadline = time.monotonic() + 10
                while j.groups_written <= entry_id and time.monotonic() < deadline:
                    pass  # keeps the loop busy on purpose: none of its callbacks runs meanwhile
                assert j.groups_written == entry_id + 1, "the record waited for the loop"
                await lone
        finally:
            await j.close()

    with tempfile.TemporaryDirectory() as tmp:
        s = journal_settings(Path(tmp))
        asyncio.run(run(s))
        assert recover_all(s) == [WalRecord(1, n, b"lone") for n in range(4)]


def test_a_cancelled_writer_fails_what_is_pending_and_keeps_what_is_acknowledged() -> None:
    """The writer's task cancelled (a loop torn down without close()) while its thread,
    having acknowledged a write, waits for the next records: the acknowledged append keeps
    its mark, later appends are refused, and the task ends without an error of its own."""

    async def run(s: Settings) -> None:
        j = new_journal(s)
        await j.start()
        first = append(j, (1, 0, b"first"))
        mark = await first
        writer = j._writer
        assert writer is not None
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
        assert not writer.cancelled() and writer.exception() is None
        assert first.result() == mark
        with pytest.raises(JournalFailed):
            append(j, (1, 1, b"refused"))
        began = time.monotonic()
        await j.close()
        assert time.monotonic() - began < 5, "close() waited for the waiting writer"

    with tempfile.TemporaryDirectory() as tmp:
        # A long wait, so that the writer thread still waits when the task is cancelled.
        s = journal_settings(Path(tmp), journal_max_group_wait_ms=60_000)
        asyncio.run(run(s))
        assert recover_all(s) == [WalRecord(1, 0, b"first")]


SLOW_SYNC_S = 0.5  # the slowed fdatasync: waiting for it too would take twice as long


def test_the_next_write_waits_for_as_many_records_as_the_last_one_carried() -> None:
    """Group commit for clients that each keep one add outstanding: after a write of three
    records, the next write waits for three (at most as long as the last fdatasync took)
    rather than start with the first one back and leave the other two waiting behind it.
    A record that stays alone is still written once that wait is over, and a checkpoint's
    sync point does not wait at all. A slow disk (each fdatasync 0.5 s longer) makes the
    wait long enough to see."""
    slow_fdatasync = Faults(faults=[f"journal.fsync=delay:{SLOW_SYNC_S}"])  # (writer thread)

    async def run(s: Settings) -> tuple[list[LogMark], LogMark]:
        j = Journal(s, SystemClock(), slow_fdatasync)
        await j.start()
        try:
            await asyncio.gather(*(append(j, (1, n, b"x")) for n in range(3)))
            assert j.groups_written == 1
            futures = []
            for n in range(3, 6):  # one by one, the writer waiting between them
                futures.append(append(j, (1, n, b"x")))
                await asyncio.sleep(0.05)
            marks = list(await asyncio.gather(*futures))
            assert j.groups_written == 2, "the three records took more than one write"
            alone = await asyncio.wait_for(append(j, (1, 6, b"x")), 5)
            assert j.groups_written == 3
            await asyncio.gather(*(append(j, (1, n, b"x")) for n in range(7, 10)))
            append(j, (1, 10, b"x"))
            began = time.monotonic()
            await j.sync_point()  # one write, not the wait for two more records first
            assert time.monotonic() - began < 1.8 * SLOW_SYNC_S
        finally:
            await j.close()
        return marks, alone

    with tempfile.TemporaryDirectory() as tmp:
        s = journal_settings(Path(tmp), journal_max_group_wait_ms=60_000)
        marks, alone = asyncio.run(run(s))
        assert marks[0] == marks[1] == marks[2] < alone  # one group's mark
        assert recover_all(s) == [WalRecord(1, n, b"x") for n in range(11)]


# --- torn tails -------------------------------------------------------------------------


def _drop_empty_newest(s: Settings, placed: list[Placed]) -> int:
    """Remove a newest file that holds no record (the write before close() rotated): the
    state of a crash just before that rotation. Returns the id of the newest file left."""
    last_with_data = placed[-1].log_id
    for log_id in list_journals(s.journal_dir):
        if log_id > last_with_data:
            journal_path(s.journal_dir, log_id).unlink()
    return last_with_data


@settings(max_examples=50, deadline=None)
@given(groups=GROUPS, max_size=MAX_SIZES, data=st.data())
def test_torn_last_record_is_cut(
    groups: list[list[Rec]], max_size: int, data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        s = journal_settings(Path(tmp), journal_max_size=max_size)
        placed, _marks = asyncio.run(write_groups(s, groups))
        newest = _drop_empty_newest(s, placed)
        last = placed[-1]
        size = RECORD_HEADER.size + len(last.record.payload)
        cut = last.offset + data.draw(st.integers(1, size - 1), label="bytes of it left")
        path = journal_path(s.journal_dir, newest)
        os.truncate(path, cut)
        fragment = path.read_bytes()[last.offset :]

        before = [p.record for p in placed[:-1]]
        assert recover_all(s) == before
        left = path.read_bytes()
        if any(fragment):
            assert len(left) == last.offset  # cut where the torn record began
        else:
            # zeros read as "end of data", like preallocated space: nothing to cut
            assert len(left) in (last.offset, cut) and not any(left[last.offset :])
        assert recover_all(s) == before  # and again, after the cut

        async def more() -> None:
            j = new_journal(s)
            await j.start()
            try:
                assert (await append(j, (5, 5, b"after"))).log_id == newest + 1
            finally:
                await j.close()

        asyncio.run(more())
        assert recover_all(s) == [*before, WalRecord(5, 5, b"after")]


@settings(max_examples=50, deadline=None)
@given(groups=GROUPS, max_size=MAX_SIZES, garbage=st.binary(min_size=1, max_size=1500))
def test_garbage_after_the_last_record_is_cut(
    groups: list[list[Rec]], max_size: int, garbage: bytes
) -> None:
    # Garbage, not data: something in the first record header's bytes, no padding record
    # (0xFFFFFF00) at its start or at a later 512-byte boundary inside it.
    assume(any(garbage[: RECORD_HEADER.size]))
    assume(all(garbage[k : k + 4] != MASK_BYTES for k in range(0, len(garbage), ALIGN)))
    with tempfile.TemporaryDirectory() as tmp:
        s = journal_settings(Path(tmp), journal_max_size=max_size)
        placed, marks = asyncio.run(write_groups(s, groups))
        newest = list_journals(s.journal_dir)[-1]
        end = marks[-1].offset if marks[-1].log_id == newest else HEADER_SIZE
        path = journal_path(s.journal_dir, newest)
        with open(path, "r+b") as f:
            f.seek(end)
            f.write(garbage)

        everything = [p.record for p in placed]
        assert recover_all(s) == everything
        assert path.stat().st_size == end  # cut at the end of the last group
        assert recover_all(s) == everything


# --- corruption -------------------------------------------------------------------------

SAFE_PAYLOADS = PAYLOADS.filter(lambda p: b"\xff\xff\xff" not in p)
SAFE_RECORDS = st.tuples(
    st.integers(0, (1 << 31) - 1),
    st.one_of(st.integers(0, (1 << 31) - 1), st.sampled_from(METADATA_KINDS)),
    SAFE_PAYLOADS,
)
SAFE_GROUPS = st.lists(st.lists(SAFE_RECORDS, min_size=1, max_size=6), min_size=2, max_size=8)


def _flip_a_byte(s: Settings, bad: Placed, byte: int, xor: int) -> Path:
    """XOR one byte (``byte`` modulo the record's size) of the record at ``bad``."""
    at = bad.offset + byte % (RECORD_HEADER.size + len(bad.record.payload))
    path = journal_path(s.journal_dir, bad.log_id)
    flip_byte(path, at, xor)
    return path


def _check_corruption(s: Settings, placed: list[Placed], bad: Placed, path: Path) -> None:
    """Recovery refuses (CorruptRecord naming the file and the record's offset) and cuts
    nothing; with skip_replay_journal_invalid_record it returns every record except the
    bad one and the rest of its group write, resuming at the next write in the same file
    (found by its group start record) or at the next file."""
    size_before = path.stat().st_size
    with pytest.raises(CorruptRecord) as caught:
        recover_all(s)
    assert caught.value.path == str(path)
    assert caught.value.offset == bad.offset
    assert str(path) in str(caught.value) and str(bad.offset) in str(caught.value)
    assert path.stat().st_size == size_before

    resume = min(  # the next group write in the same file (each group is one write here)
        [(p.log_id, p.offset) for p in placed if p.log_id == bad.log_id and p.group > bad.group],
        default=(bad.log_id + 1, 0),
    )
    expected = [
        p.record
        for p in placed
        if (p.log_id, p.offset) < (bad.log_id, bad.offset) or (p.log_id, p.offset) >= resume
    ]
    skipping = s.model_copy(update={"skip_replay_journal_invalid_record": True})
    assert recover_all(skipping) == expected
    assert path.stat().st_size == size_before


CORRUPTION = {
    "which": st.integers(0, 1 << 16),
    "byte": st.integers(0, 1 << 16),
    "xor": st.integers(1, 255),
}


@settings(max_examples=60, deadline=None)
@given(groups=SAFE_GROUPS, max_size=st.sampled_from([4096, 64 << 10]), **CORRUPTION)
def test_flipped_byte_before_valid_groups(
    groups: list[list[Rec]], max_size: int, which: int, byte: int, xor: int
) -> None:
    """A record that fails its check with valid groups after it in the same file is
    corruption, not a torn tail."""
    with tempfile.TemporaryDirectory() as tmp:
        s = journal_settings(Path(tmp), journal_max_size=max_size)
        placed, marks = asyncio.run(write_groups(s, groups))
        last_group_of = {m.log_id: g for g, m in enumerate(marks)}
        candidates = [p for p in placed if p.group < last_group_of[p.log_id]]
        assume(candidates)
        bad = candidates[which % len(candidates)]
        _check_corruption(s, placed, bad, _flip_a_byte(s, bad, byte, xor))


@example(groups=[[(0, 0, b"")], [(0, 1, b"")]], max_size=1024, which=0, byte=0, xor=1)
@settings(max_examples=30, deadline=None)
@given(groups=SAFE_GROUPS, max_size=st.sampled_from([1024, 2048]), **CORRUPTION)
def test_flipped_byte_at_the_end_of_a_rotated_file(
    groups: list[list[Rec]], max_size: int, which: int, byte: int, xor: int
) -> None:
    """A rotated journal was truncated and fsynced before the next one was opened, so a bad
    record in its last group is corruption too (never a torn tail), with valid groups in
    the next files: CorruptRecord; skip_replay_journal_invalid_record replays on from the
    next file (BookKeeper likewise skips the rest of that journal)."""
    with tempfile.TemporaryDirectory() as tmp:
        s = journal_settings(Path(tmp), journal_max_size=max_size)
        placed, marks = asyncio.run(write_groups(s, groups))
        last_group_of = {m.log_id: g for g, m in enumerate(marks)}
        candidates = [
            p for p in placed if p.group == last_group_of[p.log_id] and p.group < len(marks) - 1
        ]
        assume(candidates)
        bad = candidates[which % len(candidates)]
        _check_corruption(s, placed, bad, _flip_a_byte(s, bad, byte, xor))


def test_torn_write_with_sectors_out_of_order_is_a_torn_tail() -> None:
    """Power loss in the middle of the last write can persist its sectors in any order: a
    later record of the same write may survive a lost sector before it. Only a group start
    record proves a later write, so this is a torn tail to cut, not corruption."""
    with tempfile.TemporaryDirectory() as tmp:
        s = journal_settings(Path(tmp))
        # The first write fills [512, 1024); the second opens at 1024 with its group start,
        # then record 1 up to the sector boundary 2048 where record 2 starts.
        first_at = 2 * ALIGN + len(encode_group_start(0))
        first = b"a" * (4 * ALIGN - first_at - RECORD_HEADER.size)
        groups = [[(0, 0, b"early")], [(0, 1, first), (0, 2, b"b")]]
        placed, _ = asyncio.run(write_groups(s, groups))
        assert placed[2].offset % ALIGN == 0  # the survivor starts on a sector boundary
        path = journal_path(s.journal_dir, 1)
        with open(path, "r+b") as f:  # the sector in the middle of record 1 never landed
            f.seek(placed[1].offset + ALIGN)
            f.write(bytes(ALIGN))
        assert recover_all(s) == [WalRecord(0, 0, b"early")]
        assert path.stat().st_size == placed[1].offset  # cut at the first bad record


# --- batch records ----------------------------------------------------------------------

# An append: one record, or a batch (ledger id, first entry id, payloads).
Append = tuple[str, Any]
APPENDS: st.SearchStrategy[Append] = st.one_of(
    RECORDS.map(lambda r: ("one", r)),
    st.tuples(
        st.integers(0, (1 << 62) - 1),
        st.integers(0, (1 << 62) - 1),
        st.lists(PAYLOADS, min_size=1, max_size=8),
    ).map(lambda b: ("batch", b)),
)


def _entries(appended: Append) -> list[WalRecord]:
    kind, value = appended
    if kind == "one":
        return [WalRecord(*value)]
    lid, first, payloads = value
    return [WalRecord(lid, first + n, p) for n, p in enumerate(payloads)]


async def _write_appends(s: Settings, groups: Sequence[Sequence[Append]]) -> list[LogMark]:
    """Each group's appends in one go (one group commit), batches by ``append_batch``."""
    j = new_journal(s)
    await j.start()
    marks = []
    try:
        for group in groups:
            futures = []
            for kind, value in group:
                if kind == "one":
                    futures.append(append(j, value))
                    continue
                lid, first, payloads = value
                crcs = [record_crc(lid, first + n, p) for n, p in enumerate(payloads)]
                futures.append(j.append_batch(lid, first, crcs, payloads))
            marks.append([await f for f in futures][-1])
    finally:
        await j.close()
    return marks


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(st.lists(APPENDS, min_size=1, max_size=4), min_size=1, max_size=5),
    limit=st.sampled_from([64, 700, 4096, 1 << 20]),
    max_size=MAX_SIZES,
)
def test_batches_come_back_whole_with_their_crcs(
    groups: list[list[Append]], limit: int, max_size: int
) -> None:
    """Batches (split into records of at most max_entry_size bytes) and single records,
    across rotations: recover gives every entry in order; replay gives each batch record
    as one BatchRecord, entries of single records as runs (EntryRun), metadata records one
    by one, every CRC the entry's own record_crc."""
    with tempfile.TemporaryDirectory() as tmp:
        s = journal_settings(Path(tmp), journal_max_size=max_size, max_entry_size=limit)
        asyncio.run(_write_appends(s, groups))
        appends = [appended for group in groups for appended in group]
        expected = [r for appended in appends for r in _entries(appended)]
        assert recover_all(s) == expected
        replayed: list[WalRecord] = []
        spans = set()  # (first index in expected, count) of each EntryRun
        for record, crc in new_journal(s).replay(START):
            if isinstance(record, EntryRun):
                assert 0 < len(record.payloads) <= REPLAY_RUN_ENTRIES
                spans.add((len(replayed), len(record.payloads)))
                entries, crcs = list(record.records()), record.crcs
            else:
                assert record.entry_id < 0  # an entry comes in a run, even a run of one
                entries, crcs = [record], [crc]
            for entry, entry_crc in zip(entries, crcs, strict=True):
                assert entry_crc == record_crc(*entry)
            replayed += entries
        assert replayed == expected
        if limit == 1 << 20:  # every batch of two or more fits in one record: one BatchRecord
            at = 0
            for kind, value in appends:
                count = len(_entries((kind, value)))
                if kind == "batch" and count > 1:
                    assert (at, count) in spans
                at += count


def test_replay_gathers_single_records_of_a_ledger_at_consecutive_ids_into_runs(
    tmp_path: Path,
) -> None:
    """What single adds journal comes back as runs: across group writes, broken by a gap in
    the ids, another ledger's record, a metadata record or a batch record (and at the end of
    a journal file), never longer than REPLAY_RUN_ENTRIES."""
    s = journal_settings(tmp_path, journal_max_size=1 << 20)  # one file
    longest = REPLAY_RUN_ENTRIES + 100
    groups: list[list[Append]] = [
        [("one", (5, n, b"a%d" % n)) for n in range(0, 3)],
        [("one", (5, n, b"a%d" % n)) for n in range(3, 6)],  # the same run, a later write
        [("one", (5, 7, b"gap")), ("one", (6, 8, b"other")), ("one", (6, 9, b"x"))],
        [("one", (6, FENCE, b"")), ("one", (6, 10, b"y"))],
        [("batch", (6, 11, [b"b1", b"b2"])), ("one", (6, 13, b"z"))],
        *(
            [
                ("one", (9, n, bytes([n % 256]) * 100))
                for n in range(first, min(first + 100, longest))
            ]
            for first in range(0, longest, 100)
        ),
    ]
    asyncio.run(_write_appends(s, groups))
    replayed = [
        (r.ledger_id, r.first_entry_id, len(r.payloads)) if isinstance(r, EntryRun) else r
        for r, _crc in new_journal(s).replay(START)
    ]
    assert replayed == [
        (5, 0, 6),
        (5, 7, 1),
        (6, 8, 2),
        WalRecord(6, FENCE, b""),
        (6, 10, 1),
        (6, 11, 2),  # the batch record: not merged with the run before or after it
        (6, 13, 1),
        (9, 0, REPLAY_RUN_ENTRIES),
        (9, REPLAY_RUN_ENTRIES, longest - REPLAY_RUN_ENTRIES),
    ]
    expected = [r for group in groups for appended in group for r in _entries(appended)]
    assert recover_all(s) == expected


def _batch_groups(count: int) -> list[list[Append]]:
    return [[("batch", (7, 10 * g, [bytes([g, n]) * 100 for n in range(5)]))] for g in range(count)]


def _batch_at(s: Settings, group: int) -> tuple[Path, int, int]:
    """(file, offset, size) of the batch record of ``group`` (written by _batch_groups)."""
    path = journal_path(s.journal_dir, 1)
    data = path.read_bytes()
    pos = HEADER_SIZE
    for _ in range(group + 1):
        start = pos
        pos += len(encode_group_start(pos))
        length = RECORD_HEADER.unpack_from(data, pos)[0]
        at, size = pos, RECORD_HEADER.size + length
        pos = group_end(pos + size)
        assert start < pos
    return path, at, size


@settings(max_examples=40, deadline=None)
@given(byte=st.integers(0, 1 << 16), xor=st.integers(1, 255))
def test_a_flipped_byte_in_a_batch_record_is_corruption(byte: int, xor: int) -> None:
    """One CRC guards a whole batch: a byte flipped anywhere in it (head, table, any
    entry) with a valid write after it refuses the replay; nothing of the batch comes back
    with skip_replay_journal_invalid_record."""
    with tempfile.TemporaryDirectory() as tmp:
        s = journal_settings(Path(tmp), journal_max_size=1 << 20)
        groups = _batch_groups(3)
        asyncio.run(_write_appends(s, groups))
        path, at, size = _batch_at(s, 1)
        with open(path, "r+b") as f:
            f.seek(at + byte % size)
            old = f.read(1)[0]
            f.seek(at + byte % size)
            f.write(bytes([old ^ xor]))
        with pytest.raises(CorruptRecord) as caught:
            recover_all(s)
        assert caught.value.offset == at
        skipping = s.model_copy(update={"skip_replay_journal_invalid_record": True})
        expected = [r for g in (groups[0], groups[2]) for appended in g for r in _entries(appended)]
        assert recover_all(skipping) == expected


@settings(max_examples=30, deadline=None)
@given(left=st.integers(1, 5 * 200 + 12 + 40 + 23))
def test_a_torn_batch_record_at_the_tail_is_cut_whole(left: int) -> None:
    """A crash in the middle of the last write leaves part of its batch record: none of
    the batch's entries comes back (none was acknowledged), the earlier ones all do."""
    with tempfile.TemporaryDirectory() as tmp:
        s = journal_settings(Path(tmp), journal_max_size=1 << 20)
        groups = _batch_groups(2)
        asyncio.run(_write_appends(s, groups))
        path, at, size = _batch_at(s, 1)
        cut = at + min(left, size - 1)
        os.truncate(path, cut)
        fragment = path.read_bytes()[at:]
        assert recover_all(s) == [r for appended in groups[0] for r in _entries(appended)]
        # zeros (a fragment of the length field) read as the end of data: nothing to cut
        assert path.stat().st_size == (at if any(fragment) else cut)


def test_a_version_1_journal_still_replays() -> None:
    """A journal written before batch records (version 1: plain records only) replays."""
    with tempfile.TemporaryDirectory() as tmp:
        s = journal_settings(Path(tmp))
        groups = [[(1, 0, b"a"), (1, 1, b"b")], [(2, 0, b"c")]]
        placed, _ = asyncio.run(write_groups(s, groups))
        with open(journal_path(s.journal_dir, 1), "r+b") as f:
            f.seek(4)
            f.write(struct.pack(">I", 1))
        assert recover_all(s) == [p.record for p in placed]
