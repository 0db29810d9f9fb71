"""Replicated ledgers in the engine (node/storage: adds, transitions, reads, replay), in
process, on real files and a real RocksDB. A replica holds a stripe of ids chosen by the
writer (node/client); the tests fire racing requests concurrently."""

from __future__ import annotations

import asyncio
import random

import pytest

from node.settings import Settings
from node.storage.adds import ReplicaAdd
from node.storage.clock import SystemClock
from node.storage.errors import (
    DiskFull,
    EntryConflict,
    EntryNotFound,
    InvalidArgument,
    LedgerFenced,
    LedgerNotFound,
    NotReplicated,
    ReplicatedLedger,
)
from node.storage.faults import Faults
from node.storage.index import (
    META_VERSION,
    META_VERSION_OFFLOAD,
    META_VERSION_REPLICATED,
    UNKNOWN_REPLICATION,
    LedgerMeta,
    LedgerState,
    OffloadInfo,
    OffloadState,
)
from node.storage.journal import Journal
from node.storage.ledgers import LedgerStorage
from node.storage.wal import LogMark

LID = 1 << 62  # the fleet's ids start here (node/client/metadata/store.py)
E3 = ReplicaAdd((3, 2, 2), lac=-1)


def _at(lac: int, recovery: bool = False) -> ReplicaAdd:
    return ReplicaAdd((3, 2, 2), lac, (lac + 1) * 10, recovery)


async def _reopen(storage: LedgerStorage) -> LedgerStorage:
    await storage.close()
    again = LedgerStorage(storage.settings)
    await again.start()
    return again


def test_metadata_versions() -> None:
    """Local ledgers keep versions 1 and 2 byte for byte; replicated ones are version 3,
    with or without an offload record; a cut version 3 fails as a record."""
    local = LedgerMeta(4, lac=3, last_entry_id=3, properties={"a": "b"})
    assert local.encode()[0] == META_VERSION
    offload = OffloadInfo(OffloadState.OFFLOADED, "attempt-1", 10, 20, True)
    assert LedgerMeta(4, offload=offload).encode()[0] == META_VERSION_OFFLOAD
    for meta in (
        LedgerMeta(LID, replication=(5, 3, 2), writer_lac=41, writer_lac_length=4200),
        LedgerMeta(LID, state=LedgerState.FENCED, replication=UNKNOWN_REPLICATION),
        LedgerMeta(LID, replication=(3, 3, 2), offload=offload, writer_lac=7),
        local,
    ):
        data = meta.encode()
        assert LedgerMeta.decode(meta.ledger_id, data) == meta
        if meta.replication is not None:
            assert data[0] == META_VERSION_REPLICATED
            with pytest.raises(ValueError):
                LedgerMeta.decode(LID, data[:-1])


async def test_striped_adds_read_back_without_hole_bookkeeping(storage: LedgerStorage) -> None:
    # E=3, Qw=2: this replica holds the ids whose write set names it, never a prefix.
    ids = [i for i in range(3000) if i % 3 != 2]
    for entry_id in ids:
        await storage.add_replica(LID, [(entry_id, b"p%d" % entry_id)], _at(entry_id - 1))
    meta = storage.ledger(LID)
    assert meta.replication == (3, 2, 2) and meta.last_entry_id == ids[-1]
    assert meta.writer_lac == ids[-1] - 1 and meta.writer_lac_length == ids[-1] * 10
    assert not list(storage._lac.durable_above(LID))  # no set growing with every hole
    await storage.checkpoint(force=True)
    for entry_id in (0, 1, 1501, ids[-1]):
        assert await storage.read_entry(LID, entry_id) == b"p%d" % entry_id
    with pytest.raises(EntryNotFound):
        await storage.read_entry(LID, 2)
    got = [eid async for eid, _p in storage.read_range(LID, 10, 20)]
    assert got == [10, 12, 13, 15, 16, 18, 19]
    # Replicated ids never move the node's own allocation.
    local, _ = await storage.create_ledger()
    assert local.ledger_id < LID


async def test_concurrent_first_adds_agree(storage: LedgerStorage) -> None:
    """Racing first adds of a ledger share one creation: all succeed, on one ledger."""
    adds = [storage.add_replica(LID, [(i, b"%d" % i)], _at(i - 1)) for i in range(40)]
    adds += [storage.add_replica(LID, [(0, b"0")], E3) for _ in range(5)]  # resends
    adds.append(storage.add_replica(LID, [(100, b"a"), (101, b"b")], E3))
    metas = await asyncio.gather(*adds)
    assert all(m is metas[0] for m in metas)
    assert storage.ledger(LID).entries == 42
    # Two first adds of one id with other bytes: exactly one wins.
    other = LID + 1
    outcomes = await asyncio.gather(
        storage.add_replica(other, [(0, b"x")], E3),
        storage.add_replica(other, [(0, b"y")], E3),
        return_exceptions=True,
    )
    assert sorted(type(o).__name__ for o in outcomes) == ["EntryConflict", "LedgerMeta"]
    storage = await _reopen(storage)
    try:
        for i in range(40):
            assert await storage.read_entry(LID, i) == b"%d" % i
        assert storage.ledger(other).entries == 1
    finally:
        await storage.close()


async def test_resends_conflicts_and_bad_ids(storage: LedgerStorage) -> None:
    await storage.add_replica(LID, list(enumerate([b"a", b"b", b"c"], 5)), _at(4))
    await storage.add_replica(LID, [(5, b"a"), (7, b"c"), (9, b"new")], _at(2))  # resend + new
    assert storage.ledger(LID).entries == 4 and storage.ledger(LID).writer_lac == 4
    await storage.checkpoint(force=True)  # resends of indexed entries compare the stored bytes
    await storage.add_replica(LID, [(6, b"b")], E3)
    with pytest.raises(EntryConflict):
        await storage.add_replica(LID, [(6, b"B")], E3)
    with pytest.raises(InvalidArgument):
        await storage.add_replica(LID, [(3, b"x"), (3, b"y")], E3)
    assert await storage.read_entry(LID, 6) == b"b"


async def test_local_and_replicated_ledgers_do_not_mix(storage: LedgerStorage) -> None:
    local, _ = await storage.create_ledger()
    with pytest.raises(NotReplicated):
        await storage.add_replica(local.ledger_id, [(0, b"x")], E3)
    with pytest.raises(NotReplicated):
        await storage.fence_replica(local.ledger_id)
    await storage.add_replica(LID, [(0, b"x")], E3)
    with pytest.raises(ReplicatedLedger):
        await storage.add_entry(LID, None, b"y")
    with pytest.raises(ReplicatedLedger):
        await storage.add_entries(LID, [b"y"])
    with pytest.raises(ReplicatedLedger):
        await storage.close_ledger(LID)
    with pytest.raises(ReplicatedLedger):
        storage.begin_add(LID, b"y")  # the fast lane's path


async def test_recovery_adds_pass_a_fence_never_a_deletion(storage: LedgerStorage) -> None:
    await storage.add_replica(LID, [(0, b"a")], E3)
    await storage.fence_replica(LID)
    with pytest.raises(LedgerFenced):
        await storage.add_replica(LID, [(1, b"b")], _at(0))
    with pytest.raises(LedgerFenced):
        storage.begin_replica_add(LID, 1, b"b", _at(0))  # the fast lane's path
    await storage.add_replica(LID, [(1, b"b")], _at(0, recovery=True))
    assert await storage.read_entry(LID, 1) == b"b"
    await storage.delete_ledger(LID)
    with pytest.raises(LedgerNotFound):
        await storage.add_replica(LID, [(2, b"c")], _at(1, recovery=True))


async def _racing_add(
    storage: LedgerStorage, rng: random.Random, ledger: int, entry_id: int
) -> str:
    await asyncio.sleep(rng.random() * 0.002)
    try:
        await storage.add_replica(ledger, [(entry_id, b"v%d" % entry_id)], E3)
    except LedgerFenced:
        return "refused"
    return "acked"


async def _racing_read(
    storage: LedgerStorage, rng: random.Random, ledger: int, entry_id: int
) -> bytes | None:
    await asyncio.sleep(rng.random() * 0.002)
    try:
        return await storage.fencing_read(ledger, entry_id)
    except EntryNotFound:
        return None


async def test_no_add_is_acknowledged_after_a_fencing_read_called_it_absent(
    storage: LedgerStorage,
) -> None:
    """BookKeeper #2614: adds race fencing reads of the same ids. Whenever a fencing read
    answered "absent" for an id, the add of that id was refused, never acknowledged. (With
    the lookup before the fence, this fails: an add lands between them.)"""
    rng = random.Random(31)
    outcomes = {"read": 0, "absent": 0}
    for round_ in range(60):
        ledger = LID + round_
        if round_ % 2:
            await storage.add_replica(ledger, [(0, b"seed")], E3)  # known: fence journaled
        ids = range(1, 9)
        adds = [asyncio.ensure_future(_racing_add(storage, rng, ledger, i)) for i in ids]
        reads = await asyncio.gather(*(_racing_read(storage, rng, ledger, i) for i in ids))
        results = await asyncio.gather(*adds)
        for entry_id, found, result in zip(ids, reads, results, strict=True):
            if found is None:
                outcomes["absent"] += 1
                assert result == "refused", (round_, entry_id)
            else:
                outcomes["read"] += 1
                assert found == b"v%d" % entry_id and result == "acked"
    assert outcomes["read"] and outcomes["absent"], outcomes  # both sides of the race ran


async def test_replication_writer_lac_and_fences_survive_a_restart(
    storage: LedgerStorage, settings: Settings
) -> None:
    await storage.add_replica(LID, [(0, b"a"), (3, b"b")], _at(2))
    await storage.add_replica(LID + 1, [(1, b"c")], _at(0))
    await storage.fence_replica(LID + 1)
    await storage.fence_replica(LID + 2)  # unknown: created FENCED
    storage = await _reopen(storage)
    try:
        meta = storage.ledger(LID)
        assert (meta.replication, meta.writer_lac, meta.writer_lac_length) == ((3, 2, 2), 2, 30)
        assert meta.state == LedgerState.OPEN
        assert storage.ledger(LID + 1).state == LedgerState.FENCED
        unknown = storage.ledger(LID + 2)
        assert (unknown.state, unknown.replication) == (LedgerState.FENCED, UNKNOWN_REPLICATION)
        assert sorted(lid for lid, _ms in storage.replicated_ledgers()) == [LID, LID + 1, LID + 2]
        assert await storage.read_entry(LID, 3) == b"b"
        local, _ = await storage.create_ledger()
        assert local.ledger_id < LID
    finally:
        await storage.close()


REFUSED = b"no room for this one"


class RefusingJournal(Journal):
    """The real journal, but an append of REFUSED is refused as a full disk refuses it
    (DiskFull: nothing of it written)."""

    def append(
        self, ledger_id: int, entry_id: int, crc: int, payload: bytes
    ) -> asyncio.Future[LogMark]:
        if payload != REFUSED:
            return super().append(ledger_id, entry_id, crc, payload)
        refused: asyncio.Future[LogMark] = asyncio.get_running_loop().create_future()
        refused.set_exception(DiskFull("injected: no space for this append"))
        return refused


async def test_a_refused_replica_add_forgets_only_itself(settings: Settings) -> None:
    """A replica add the WAL refused is forgotten, but the ids held before it stay counted:
    another add at one of them is still checked against the stored bytes."""
    wal = RefusingJournal(settings, SystemClock(), Faults())
    storage = LedgerStorage(settings, wal=wal)
    await storage.start()
    try:
        await storage.add_replica(LID, [(0, b"a"), (3, b"b")], E3)
        await storage.checkpoint(force=True)  # the held ids leave the write cache
        with pytest.raises(DiskFull):
            await storage.add_replica(LID, [(6, REFUSED)], E3)
        assert storage.ledger(LID).last_entry_id == 3
        pending = storage.begin_replica_add(LID, 7, REFUSED, E3)  # the fast lane's path
        assert pending is not None
        await asyncio.wait([pending.future])
        with pytest.raises(DiskFull):
            storage.finish_replica_add(pending)
        assert storage.ledger(LID).last_entry_id == 3
        with pytest.raises(EntryConflict):
            await storage.add_replica(LID, [(3, b"other")], E3)
        with pytest.raises(EntryNotFound):
            await storage.read_entry(LID, 6)
        await storage.add_replica(LID, [(6, b"c")], E3)  # a retry is a fresh add
        assert await storage.read_entry(LID, 6) == b"c"
        assert storage.ledger(LID).entries == 3
    finally:
        await storage.close()
