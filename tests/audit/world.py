"""Real node data for the audit tests, built with the engine in-process, then closed; and
the faults, each applied to its own copy of that data directory."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from rocksdict import AccessType, Options, Rdict, ReadOptions

from node.audit import fleet
from node.client.model import LedgerMetadata
from node.client.sync import SyncClient
from node.localcluster import LocalCluster
from node.offload.format import BLOCK_HEADER, ENTRY_HEADER, data_key
from node.offload.offloader import LocalLedger
from node.offload.service import OffloadService
from node.storage import entrylog, logformat
from node.storage.clock import SystemClock
from node.storage.index import (
    COLUMN_FAMILIES,
    LEDGER_KEY,
    LOCATION_KEY,
    LedgerMeta,
    decode_run,
    encode_run,
    find_run,
)
from node.storage.ledgers import LedgerStorage
from node.storage.wal import record_crc
from node.streams.manager import StreamManager
from node.streams.model import STREAM_PREFIX, Position, Stream
from tests.harness.settings import make_settings

LOG_SIZE = 64 * 1024
ENTRY_SIZE = 1000
RECORD_SIZE = ENTRY_SIZE + logformat.RECORD_OVERHEAD
# The first log: a ledger deleted (and purged) later, filling it but for one entry of the
# ledger that then pins it alone; the next batch no longer fits, so the log rolls.
DOOMED_ENTRIES = (LOG_SIZE - logformat.HEADER_SIZE) // RECORD_SIZE - 1
DAY_S = 24 * 3600
OLD_S = 30 * DAY_S  # the pinned log's age: far past 72 h retention + 24 h major interval
STREAM = "orders"
STREAM_LEDGER_ENTRIES = 5


@dataclass(slots=True)
class World:
    data_dir: Path
    pin: int = 0  # the ledger alone in the first log
    plain: list[int] = field(default_factory=list)  # interleaved ledgers
    offloaded: int = 0
    stream_ledgers: list[int] = field(default_factory=list)


def payload(ledger: int, entry: int) -> bytes:
    return f"{ledger}:{entry}:".encode().ljust(ENTRY_SIZE, bytes([ledger % 251]))


def settings_for(data_dir: Path) -> Any:
    return make_settings(
        data_dir,
        log_size_limit=LOG_SIZE,
        max_entry_size=16 * 1024,
        flush_interval_ms=3_600_000,
        gc_wait_time_ms=3_600_000,
        retention_scheduler_enabled=False,
        managed_ledger_offload_max_block_size_in_bytes=16 * 1024,
    )


async def _build(data_dir: Path) -> World:
    world = World(data_dir)
    settings = settings_for(data_dir)
    clock = SystemClock()
    storage = LedgerStorage(settings, clock)
    await storage.start()
    streams = StreamManager(storage, clock)
    await streams.start()
    offload = OffloadService(storage, streams, clock)
    await offload.start()
    try:
        world.pin = (await storage.create_ledger())[0].ledger_id
        doomed = (await storage.create_ledger())[0].ledger_id
        await storage.add_entries(world.pin, [payload(world.pin, 0)])
        await storage.add_entries(doomed, [payload(doomed, e) for e in range(DOOMED_ENTRIES)])
        await storage.checkpoint()
        await storage.delete_ledger(doomed)
        await storage.checkpoint()
        await storage.purge_deleted_ledgers()

        world.plain = [(await storage.create_ledger())[0].ledger_id for _ in range(3)]
        for _round in range(6):
            for lid in world.plain:
                first = storage.ledger(lid).last_entry_id + 1
                await storage.add_entries(lid, [payload(lid, first + i) for i in range(4)])
            await storage.checkpoint()
        for lid in world.plain:
            await storage.close_ledger(lid)

        world.offloaded = (await storage.create_ledger())[0].ledger_id
        await storage.add_entries(world.offloaded, [payload(world.offloaded, e) for e in range(40)])
        await storage.close_ledger(world.offloaded)
        await storage.checkpoint()
        await offload.offloader.offload(LocalLedger(storage, world.offloaded))

        await streams.put_stream(
            STREAM,
            {"maxEntriesPerLedger": STREAM_LEDGER_ENTRIES, "minLedgerRolloverTimeMinutes": 0},
        )
        await streams.create_cursor(STREAM, "reader", "earliest")
        positions: list[Position] = []
        for i in range(3 * STREAM_LEDGER_ENTRIES):
            positions += await streams.append(STREAM, [payload(9999, i)])
        # everything but the last entry acknowledged: the newest ledger holds the backlog
        await streams.acknowledge(STREAM, "reader", positions[-2])
        world.stream_ledgers = [info.ledger_id for info in streams.stream(STREAM).ledgers]
        await storage.checkpoint()
    finally:
        await storage.close()
    return world


def build(data_dir: Path) -> World:
    return asyncio.run(_build(data_dir))


# --- faults ----------------------------------------------------------------------------------


def _open_index(data_dir: Path) -> Rdict:
    return Rdict(
        str(data_dir / "index"),
        Options(raw_mode=True),
        column_families={name: Options(raw_mode=True) for name in COLUMN_FAMILIES},
        access_type=AccessType.read_write(),
    )


def _run_of(data_dir: Path, ledger_id: int, entry_id: int) -> tuple[bytes, int, list[int]]:
    """The index run holding the entry: its key, first entry id and locations."""
    db = _open_index(data_dir)
    try:
        cf = db.get_column_family("locations")
        read_options = ReadOptions()  # kept referenced: collected mid-scan, rocksdict misreads
        iterator = cf.iter(read_options)
        run = find_run(iterator, ledger_id, entry_id)
        del iterator, read_options, cf
        assert run is not None, f"entry {entry_id} of ledger {ledger_id} is not indexed"
        return run.key, run.first, list(decode_run(run.value))
    finally:
        db.close()


def _location(data_dir: Path, ledger_id: int, entry_id: int) -> int:
    _key, first, run = _run_of(data_dir, ledger_id, entry_id)
    return run[entry_id - first]


def _set_location(data_dir: Path, ledger_id: int, entry_id: int, location: int | None) -> None:
    """Point the entry elsewhere, or (None) drop it from the index: its run split around it."""
    key, first, run = _run_of(data_dir, ledger_id, entry_id)
    at = entry_id - first
    if location is not None:
        run[at] = location
        _update(data_dir, "locations", {key: encode_run(run)})
        return
    changes: dict[bytes, bytes | None] = {key: encode_run(run[:at]) if at else None}
    if at + 1 < len(run):
        changes[LOCATION_KEY.pack(ledger_id, entry_id + 1)] = encode_run(run[at + 1 :])
    _update(data_dir, "locations", changes)


def _update(data_dir: Path, family: str, changes: dict[bytes, bytes | None]) -> None:
    db = _open_index(data_dir)
    try:
        cf = db.get_column_family(family)
        for key, value in changes.items():
            if value is None:
                del cf[key]
            else:
                cf[key] = value
        del cf
    finally:
        db.close()


def flip_payload_byte(world: World, ledger_id: int, entry_id: int) -> None:
    log_id, offset = logformat.split_location(_location(world.data_dir, ledger_id, entry_id))
    path = logformat.log_path(world.data_dir / "ledgers", log_id)
    with open(path, "r+b") as f:
        f.seek(offset + logformat.RECORD_OVERHEAD + ENTRY_SIZE // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def delete_index_entry(world: World, ledger_id: int, entry_id: int) -> None:
    _set_location(world.data_dir, ledger_id, entry_id, None)


def move_index_entry(world: World, ledger_id: int, entry_id: int, to_entry: int) -> None:
    target = _location(world.data_dir, ledger_id, to_entry)
    _set_location(world.data_dir, ledger_id, entry_id, target)


def orphan_record(world: World, ledger_id: int, entry_id: int) -> tuple[int, int]:
    """A sealed log holding a second copy of an indexed entry (a compaction output whose
    index update never happened): returns (log id, offset) of the copy."""
    ledgers_dir = world.data_dir / "ledgers"
    log_id, offset = logformat.split_location(_location(world.data_dir, ledger_id, entry_id))
    with open(logformat.log_path(ledgers_dir, log_id), "rb") as f:
        f.seek(offset)
        head = f.read(logformat.RECORD_OVERHEAD)
        length = logformat.decode_record_header(head)[0]
        record = head + f.read(length)
    new_id = max(entrylog.list_logs(ledgers_dir)) + 1
    fd = entrylog.create_log(logformat.log_path(ledgers_dir, new_id))
    try:
        entrylog.write_fully(fd, record, logformat.HEADER_SIZE)
        entrylog.seal(fd, logformat.HEADER_SIZE + len(record), {ledger_id: len(record)})
        os.fsync(fd)
    finally:
        os.close(fd)
    return new_id, logformat.HEADER_SIZE


def age_first_log(world: World) -> int:
    first = min(entrylog.list_logs(world.data_dir / "ledgers"))
    path = logformat.log_path(world.data_dir / "ledgers", first)
    old = path.stat().st_mtime - OLD_S
    os.utime(path, (old, old))
    return first


def leave_ledger_out_of_retention(world: World) -> int:
    """The stream's first (acknowledged, closed) ledger closed ten days ago, as if
    retention had not run since."""
    db = _open_index(world.data_dir)
    try:
        cf = db.get_column_family("streams")
        key = STREAM_PREFIX + STREAM.encode()
        stream = Stream.decode(cast(bytes, cf[key]))
        del cf
    finally:
        db.close()
    first = stream.ledgers[0]
    first.closed_ms -= 10 * DAY_S * 1000
    first.created_ms -= 10 * DAY_S * 1000
    _update(world.data_dir, "streams", {key: stream.encode()})
    return first.ledger_id


def tamper_offloaded_object(world: World) -> None:
    db = _open_index(world.data_dir)
    try:
        cf = db.get_column_family("ledgers")
        meta = LedgerMeta.decode(world.offloaded, cast(bytes, cf[LEDGER_KEY.pack(world.offloaded)]))
        del cf
    finally:
        db.close()
    assert meta.offload is not None
    path = world.data_dir / "offload" / data_key(world.offloaded, meta.offload.attempt)
    data = bytearray(path.read_bytes())
    data[BLOCK_HEADER.size + ENTRY_HEADER.size + 1] ^= 0xFF  # inside the first payload
    path.write_bytes(bytes(data))


def hole_below_lac(world: World, ledger_id: int) -> list[int]:
    """The metadata claims two more entries than were ever written: ids that exist
    nowhere, at and below the LAC."""
    db = _open_index(world.data_dir)
    try:
        cf = db.get_column_family("ledgers")
        meta = LedgerMeta.decode(ledger_id, cast(bytes, cf[LEDGER_KEY.pack(ledger_id)]))
        del cf
    finally:
        db.close()
    missing = [meta.lac + 1, meta.lac + 2]
    meta.lac += 2
    meta.last_entry_id += 2
    meta.entries += 2
    _update(world.data_dir, "ledgers", {LEDGER_KEY.pack(ledger_id): meta.encode()})
    return missing


def copy(world: World, target: Path) -> World:
    shutil.copytree(world.data_dir, target)
    return World(target, world.pin, list(world.plain), world.offloaded, list(world.stream_ledgers))


def read_json(path: Path) -> dict[str, Any]:
    return cast(dict[str, Any], json.loads(path.read_text()))


# --- replicated fleets (tests/audit/test_replicas.py, tests/airflow) --------------------------

ARRIVAL_TIMEOUT_S = 30.0  # the copies beyond the ack quorum arrive after the add returned
POLL_S = 0.1


def status_of(url: str) -> int:
    """The status a GET of ``url`` answers (no token sent)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as e:
        return e.code


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def get_json(url: str, token: str | None = None) -> dict[str, Any]:
    request = urllib.request.Request(url, headers=_auth(token))
    with urllib.request.urlopen(request, timeout=30) as reply:
        return dict(json.loads(reply.read()))


def post_json(url: str, body: dict[str, Any], token: str | None = None) -> dict[str, Any]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **_auth(token)},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return dict(json.loads(reply.read()))


def ledger_metadata(cluster: LocalCluster) -> dict[int, LedgerMetadata]:
    doc = fleet.dump_url(cluster.metadata_url)
    return {m.ledger_id: m for m in fleet.parse(doc, "etcd")}


def wait_every_copy(cluster: LocalCluster, metas: dict[int, LedgerMetadata], last: int) -> None:
    """Every node of every entry's write set answers it: the clean fleet is clean."""
    deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
    for meta in metas.values():
        for entry in range(last + 1):
            for node in meta.write_set(entry):
                url = f"{cluster.url(node)}/api/v1/ledgers/{meta.ledger_id}/entries/{entry}"
                while status_of(url) != 200:
                    assert time.monotonic() < deadline, f"{url} never answered 200"
                    time.sleep(POLL_S)


def write_ledgers(
    cluster: LocalCluster,
    shapes: list[tuple[int, int, int, bool]],
    entries: int,
    token: str | None = None,
) -> list[int]:
    """One replicated ledger per (E, Qw, Qa, close?) with ``entries`` entries each, written
    through the client (with the nodes' admin token, if they have one); returns once every
    copy is on its node."""
    ids = []
    with SyncClient(cluster.metadata_url, token=token) as client:
        for ensemble, write_quorum, ack_quorum, close in shapes:
            ledger = client.create_ledger(ensemble, write_quorum, ack_quorum)
            lid = ledger.metadata.ledger_id
            for entry in range(entries):
                assert ledger.add(payload(lid, entry)) == entry
            if close:
                ledger.close()
            ids.append(lid)
        wait_every_copy(cluster, ledger_metadata(cluster), entries - 1)
    return ids


FAULTS = ("flip", "unindexed", "moved", "orphan", "pinned", "retention", "offload", "hole")


def delete_ledger_replica(data_dir: Path, ledger_id: int) -> int:
    """The node forgets a ledger (its metadata and every index entry; the records stay in
    the logs, unreferenced): a replica lost as a wrong reclaim would lose it. Returns how
    many index runs went."""
    db = _open_index(data_dir)
    try:
        cf = db.get_column_family("locations")
        read_options = ReadOptions()  # kept referenced: collected mid-scan, rocksdict misreads
        keys = []
        for key in cf.keys(from_key=LOCATION_KEY.pack(ledger_id, 0), read_opt=read_options):
            if LOCATION_KEY.unpack(cast(bytes, key)[: LOCATION_KEY.size])[0] != ledger_id:
                break
            keys.append(cast(bytes, key))
        del cf, read_options
    finally:
        db.close()
    _update(data_dir, "locations", dict.fromkeys(keys))
    _update(data_dir, "ledgers", {LEDGER_KEY.pack(ledger_id): None})
    return len(keys)


def rewrite_payload_byte(data_dir: Path, ledger_id: int, entry_id: int) -> None:
    """Another byte in the copy and a CRC32C that matches it: a copy that passes its own
    check but is not the entry the other replicas hold."""
    log_id, offset = logformat.split_location(_location(data_dir, ledger_id, entry_id))
    path = logformat.log_path(data_dir / "ledgers", log_id)
    with open(path, "r+b") as f:
        f.seek(offset)
        head = f.read(logformat.RECORD_OVERHEAD)
        length, lid, eid, _crc = logformat.decode_record_header(head)
        payload = bytearray(f.read(length))
        payload[len(payload) // 2] ^= 0xFF
        f.seek(offset)
        f.write(logformat.encode_record(lid, eid, record_crc(lid, eid, payload), bytes(payload)))
