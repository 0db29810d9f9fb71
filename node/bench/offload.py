"""``python -m node bench offload``: an offloaded ledger's upload and reads, against local
entry-log reads of the same ledger.

The data set: one closed ledger of ``--ledger-mib`` MiB of ``--entry-size`` B entries,
written through the engine in-process and checkpointed into its entry logs, then copied for
each medium, so that every medium starts from the same files. Per medium, on one node (the
engine with the offload service, in-process, default offload settings: 64 MiB blocks, a
1 MiB index stride, a 64 MiB block cache, one span of prefetch):

1. **entry log**: the ledger read in order (``read_range``) from its entry logs: the
   baseline, measured in the same run on the same node just before the offload;
2. **upload**: the whole offload of the ledger (its entries read from the entry log, the
   multipart upload, the read-back verification of every block and of the index, the
   offloaded record), then the local copy is dropped (deletion lag 0), so what follows can
   only come from the object store;
3. **sequential read**: the ledger read in order again, now from the object store (ranged
   GETs of index spans, with prefetch);
4. **random reads**: ``--random-reads`` single entries at random ids (seeded), one at a
   time, none in the span of the read before it or the next one (that is a sequential
   reader, which prefetch is for), with the reader's cache emptied first: the bytes fetched
   from the object store by each read (a block cache hit fetches nothing; a miss fetches
   the one span of the index that holds the entry).

Media: the local store (``offload_store=local``, a directory on the scratch disk) and S3:
moto's server, started here on a free loopback port and spoken to over HTTP (``moto`` and
``boto3`` come with the ``dev`` extras). moto reads the whole object from its buffer for
every ranged GET and slices it, so its read figures say more about moto than about S3.
MB/s count the ledger's payload bytes (10^6) for every row, so that the ratios compare like
with like.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.bench.common import (
    MB,
    P50,
    P99,
    PAYLOAD_FILL,
    UsageError,
    latency_buffer,
    machine_line,
    markdown_table,
    quantile_ms,
    require_positive,
    scratch_dir,
)
from node.offload.format import LedgerIndex, index_key
from node.offload.offloader import LocalLedger
from node.offload.service import OffloadService
from node.runtime import run, tune
from node.settings import MiB, Settings, load
from node.storage.clock import SystemClock
from node.storage.errors import Backpressure
from node.storage.ledgers import LedgerStorage
from node.streams.manager import StreamManager

BUILD_BATCH_BYTES = 1 * MiB  # payload per add_entries call while the data set is written
BACKPRESSURE_WAIT_S = 0.01  # a refused batch of the data set is retried after this
RANDOM_SEED = 13  # the random reads' ids: the same on every medium and every run
LOOPBACK = "127.0.0.1"  # moto's default binds every interface
S3_REGION = "us-east-1"
S3_KEY_ID = "bench-key"  # moto accepts any credentials
S3_SECRET = "bench-secret"
S3_PREFIX = "node-bench"
# Random reads keep out of the previous read's span and the next one's (which start a
# prefetch) when the ledger has at least this many spans; fewer leave no choice.
MIN_SPANS_APART = 3
TARGET_RATIO = 0.5  # target: sequential reads from the local store >= 50% of entry-log reads

ENTRY_LOG = "entry log (baseline)"
LOCAL = "local store"
S3 = "S3 (moto, HTTP on loopback)"


@dataclass(slots=True)
class Pass:
    """One timed pass: ``bytes`` of payload in ``seconds``."""

    bytes: int
    seconds: float

    @property
    def mb_s(self) -> float:
        return self.bytes / self.seconds / MB if self.seconds > 0 else 0.0


@dataclass(slots=True)
class RandomReads:
    fetched: list[int]  # per read: bytes fetched from the object store (0: a cache hit)
    latencies: list[float]  # sorted

    @property
    def reads(self) -> int:
        return len(self.fetched)

    @property
    def misses(self) -> int:
        return sum(1 for n in self.fetched if n)

    @property
    def bytes_per_read(self) -> float:
        return sum(self.fetched) / self.reads if self.reads else 0.0

    @property
    def bytes_per_miss(self) -> float:
        return sum(self.fetched) / self.misses if self.misses else 0.0


@dataclass(slots=True)
class Medium:
    name: str
    entry_log: Pass
    upload: Pass
    sequential: Pass
    random: RandomReads
    stride: int  # the index stride the offload was made with
    largest_span: int  # the largest span of the ledger's index: no read fetches more

    @property
    def ratio(self) -> float:
        return self.sequential.mb_s / self.entry_log.mb_s if self.entry_log.mb_s else 0.0


# --- the data set ----------------------------------------------------------------------------


async def _build(settings: Settings, ledger_bytes: int, entry_size: int) -> int:
    """The ledger, closed and checkpointed into the entry logs; returns its id."""
    storage = LedgerStorage(settings)
    await storage.start()
    try:
        meta, _created = await storage.create_ledger()
        payload = bytes([PAYLOAD_FILL]) * entry_size
        batch = [payload] * max(1, BUILD_BATCH_BYTES // entry_size)
        entries = -(-ledger_bytes // entry_size)
        written = 0
        while written < entries:
            chunk = batch[: entries - written]
            try:
                await storage.add_entries(meta.ledger_id, chunk)
            except Backpressure:
                await asyncio.sleep(BACKPRESSURE_WAIT_S)
                continue
            written += len(chunk)
        await storage.close_ledger(meta.ledger_id)
        await storage.checkpoint(force=True)  # every entry in an entry log, none cached
        return meta.ledger_id
    finally:
        await storage.close()


# --- one medium ------------------------------------------------------------------------------


async def _read_all(storage: LedgerStorage, ledger_id: int, entry_size: int) -> Pass:
    size = 0
    started = time.perf_counter()
    async for _entry_id, payload in storage.read_range(ledger_id, 0):
        size += len(payload)
    elapsed = time.perf_counter() - started
    meta = storage.ledger(ledger_id)
    if size != meta.entries * entry_size:
        raise RuntimeError(f"read {size} bytes of ledger {ledger_id}, not {meta.payload_bytes}")
    return Pass(size, elapsed)


def _random_ids(index: LedgerIndex, last: int, reads: int) -> list[int]:
    """Seeded random entry ids, none in the span of the read before it or the next one: a
    read there is a sequential reader's, and starts a prefetch (the bench's reads begin
    after a read of entry 0)."""
    rng = random.Random(RANDOM_SEED)
    constrained = len(index.points) >= MIN_SPANS_APART
    ids: list[int] = []
    previous = index.point_of(0)
    while len(ids) < reads:
        entry_id = rng.randint(0, last)
        point = index.point_of(entry_id)
        if constrained and point - previous in (0, 1):
            continue
        ids.append(entry_id)
        previous = point
    return ids


async def _random_reads(
    storage: LedgerStorage, offload: OffloadService, index: LedgerIndex, reads: int, entry_size: int
) -> RandomReads:
    """Single-entry reads, one at a time, on a reader that has forgotten what the
    sequential pass left in its cache (a read of entry 0 first fetches the index again;
    it is not counted). What each read fetched: the reader's count of object bytes
    before and after it."""
    stats = offload.stats
    ledger_id = index.ledger_id
    offload.reader.forget(ledger_id)
    await storage.read_entry(ledger_id, 0)
    ids = _random_ids(index, storage.ledger(ledger_id).lac, reads)
    fetched: list[int] = []
    latencies = latency_buffer()
    clock = time.perf_counter
    for entry_id in ids:
        before = stats.fetched_bytes
        started = clock()
        payload = await storage.read_entry(ledger_id, entry_id)
        latencies.append(clock() - started)
        fetched.append(stats.fetched_bytes - before)
        if len(payload) != entry_size:
            raise RuntimeError(f"entry {entry_id} read back as {len(payload)} bytes")
    return RandomReads(fetched, sorted(latencies))


async def _medium(
    name: str, settings: Settings, ledger_id: int, entry_size: int, random_reads: int
) -> Medium:
    clock = SystemClock()
    storage = LedgerStorage(settings, clock)
    await storage.start()
    try:
        streams = StreamManager(storage, clock)
        await streams.start()
        offload = OffloadService(storage, streams, clock)
        await offload.start()
        entry_log = await _read_all(storage, ledger_id, entry_size)

        started = time.perf_counter()
        await offload.offloader.offload(LocalLedger(storage, ledger_id))
        upload = Pass(entry_log.bytes, time.perf_counter() - started)
        dropped = await offload.run()  # deletion lag 0: the local copy goes now
        if dropped.local_deleted != [ledger_id]:
            raise RuntimeError(f"the local copy of ledger {ledger_id} was not dropped: {dropped}")

        attempt = storage.ledger(ledger_id).offload
        assert attempt is not None
        # Straight from the store: the reader's cache and counters stay the reads' own.
        index = LedgerIndex.decode(await offload.store.get(index_key(ledger_id, attempt.attempt)))
        sequential = await _read_all(storage, ledger_id, entry_size)
        randoms = await _random_reads(storage, offload, index, random_reads, entry_size)
        return Medium(
            name,
            entry_log,
            upload,
            sequential,
            randoms,
            index.stride,
            max(point.length for point in index.points),
        )
    finally:
        await storage.close()


# --- S3: moto on loopback --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _moto() -> Iterator[dict[str, Any]]:
    """moto's S3 server on a free loopback port with a fresh bucket: the settings that
    point the node at it."""
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        raise UsageError(
            f"needs moto and boto3 (the dev extras: pip install -e '.[dev]'): {e}"
        ) from e
    # S3Store (and boto3) read AWS_* variables: an operator's profile must not leak in.
    for variable in [n for n in os.environ if n.startswith("AWS_")]:
        del os.environ[variable]
    # moto's HTTP server logs every request at INFO: thousands of lines of ranged GETs.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    port = _free_port()
    server = ThreadedMotoServer(ip_address=LOOPBACK, port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://{LOOPBACK}:{port}"
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=S3_REGION,
            aws_access_key_id=S3_KEY_ID,
            aws_secret_access_key=S3_SECRET,
        ).create_bucket(Bucket=bucket)
        yield {
            "offload_store": "s3",
            "offload_bucket": bucket,
            "offload_prefix": S3_PREFIX,
            "offload_endpoint": endpoint,
            "offload_region": S3_REGION,
            "offload_access_key_id": S3_KEY_ID,
            "offload_secret_access_key": S3_SECRET,
        }
    finally:
        server.stop()


# --- report ----------------------------------------------------------------------------------


def _report(media: list[Medium]) -> list[str]:
    rows: list[tuple[str, ...]] = [
        (f"{ENTRY_LOG}, node of the {m.name} run", "-", f"{m.entry_log.mb_s:,.1f}", "1.00", "-")
        for m in media
    ]
    rows += [
        (
            m.name,
            f"{m.upload.mb_s:,.1f}",
            f"{m.sequential.mb_s:,.1f}",
            f"{m.ratio:.2f}",
            f"{m.random.bytes_per_read:,.0f} / {max(m.random.fetched):,}",
        )
        for m in media
    ]
    out = [
        "",
        *markdown_table(
            (
                "medium",
                "upload MB/s",
                "sequential read MB/s",
                "ratio to entry-log reads",
                "bytes fetched per random read (mean / max)",
            ),
            rows,
        ),
        "",
    ]
    for m in media:
        r = m.random
        target = ""
        if m.name == LOCAL:
            target = (
                f" (target >= {TARGET_RATIO:.0%}: {'met' if m.ratio >= TARGET_RATIO else 'MISSED'})"
            )
        verdict = "met" if max(r.fetched) <= m.stride else "MISSED"
        out.append(
            f"- {m.name}: sequential reads at {m.ratio:.0%} of entry-log reads{target}; "
            f"{r.reads:,} random reads, {r.misses:,} fetched ({r.bytes_per_miss:,.0f} B each "
            f"on average), the others hit the block cache; at most {max(r.fetched):,} B "
            f"fetched by one read (largest span of the index {m.largest_span:,} B; stride "
            f"{m.stride:,} B: {verdict}); latency p50 "
            f"{quantile_ms(r.latencies, P50, ordered=True):.2f} ms, p99 "
            f"{quantile_ms(r.latencies, P99, ordered=True):.2f} ms"
        )
    return out


# --- driver ----------------------------------------------------------------------------------


def _settings(data_dir: Path, **store: Any) -> Settings:
    return load(
        data_dir=data_dir,
        managed_ledger_offload_deletion_lag_ms=0,  # the local copy goes right after
        managed_ledger_data_read_priority="tiered-storage-first",
        **store,
    )


def main(args: argparse.Namespace) -> int:
    ledger_mib, entry_size = int(args.ledger_mib), int(args.entry_size)
    random_reads = int(args.random_reads)
    require_positive(ledger_mib=ledger_mib, entry_size=entry_size, random_reads=random_reads)
    limit = load().max_entry_size
    if entry_size > limit:
        raise UsageError(f"--entry-size must be at most {limit:,} (max_entry_size)")
    with scratch_dir(args.dir, "node-bench-offload-") as scratch:
        return _run(scratch, ledger_mib * MiB, entry_size, random_reads)


def _run(scratch: Path, ledger_bytes: int, entry_size: int, random_reads: int) -> int:
    base_dir = scratch / "dataset"
    tune()  # as `serve` does
    started = time.perf_counter()
    ledger_id = run(_build(_settings(base_dir), ledger_bytes, entry_size))
    built_s = time.perf_counter() - started
    defaults = _settings(base_dir)
    print(
        "\n".join(
            [
                f"## node bench offload: one ledger of {ledger_bytes / MiB:g} MiB in "
                f"{entry_size:,} B entries, {random_reads:,} random reads",
                "",
                machine_line(scratch),
                f"- data set written and checkpointed in {built_s:.1f} s; offload settings: "
                f"blocks of {defaults.managed_ledger_offload_max_block_size_in_bytes // MiB} "
                f"MiB, index stride "
                f"{defaults.managed_ledger_offload_read_buffer_size_in_bytes:,} B, block cache "
                f"{defaults.offload_block_cache_size // MiB} MiB, prefetch "
                f"{defaults.managed_ledger_offload_prefetch_rounds} span(s)",
                "- MB/s = the ledger's payload bytes (10^6) per second; upload = the whole "
                "offload (read from the entry log, multipart upload, read-back verification); "
                "the entry logs and the local store's files are in the page cache (just "
                "written), moto keeps its objects in memory",
                f"- load average before: {os.getloadavg()[0]:.2f} "
                "(other processes on this machine share its CPUs and disk)",
            ]
        ),
        flush=True,
    )
    media = []
    local_dir = scratch / "local"
    shutil.copytree(base_dir, local_dir)
    media.append(run(_medium(LOCAL, _settings(local_dir), ledger_id, entry_size, random_reads)))
    shutil.rmtree(local_dir)
    s3_dir = scratch / "s3"
    shutil.copytree(base_dir, s3_dir)
    shutil.rmtree(base_dir)
    with _moto() as store:
        media.append(
            run(_medium(S3, _settings(s3_dir, **store), ledger_id, entry_size, random_reads))
        )
    print("\n".join(_report(media)), flush=True)
    print(f"- load average after: {os.getloadavg()[0]:.2f}", flush=True)
    return 0
