"""``python -m node bench rereplicate``: how fast autorecovery copies a lost node's fragments,
against the same bytes copied by a plain client, on one local cluster this command starts:
etcd and four nodes on loopback.

``--rereplicate-mib`` MiB are written as closed 3/3/2 ledgers of ``LEDGER_MIB`` MiB each
(``--entry-size`` entries, batches of 100); the node in most of their ensembles is killed and
its data deleted, and an audit marks the ledgers it held. Then, one after the other:

- baseline: for each marked ledger, this process's client reads every entry (from the
  surviving replicas) and adds it to a new single-copy ledger: one new copy of the same bytes,
  ``PARALLEL`` ledgers at a time;
- re-replication: each marker is sent to a live node's route (``POST
  /api/v1/autorecovery/rereplicate``), spread over the live nodes as the DAG spreads them,
  ``PARALLEL`` at a time (the DAG's ``max_active_tis_per_dagrun``): the worker reads each entry
  from both surviving replicas and compares their CRC32C, adds it to the replacement with a
  recovery add, reads it back, CASes the segment and counts the totals.

Each row: fragments, entries, MB copied, seconds, fragments/s, entries/s and MB/s; the ratio
line compares re-replication's MB/s with the baseline's (the price of the checks: two reads per
entry and a read-back, against one read)."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.bench.common import MB, markdown_table, require_positive, scratch_dir
from node.bench.server import short_machine_line

if TYPE_CHECKING:
    from node.client import Client
    from node.localcluster import LocalCluster

NODES = 4
SHAPE = (3, 3, 2)  # E, Qw, Qa of the ledgers written
LEDGER_MIB = 4  # each ledger's size (the last one may be smaller)
WRITE_BATCH = 100  # entries per add_batch while writing
COPY_BATCH = 64  # baseline: entries read, then added, together (the worker's COPY_BATCH)
PARALLEL = 4  # markers copied at once (the DAG's max_active_tis_per_dagrun)
TARGET = 0.3  # re-replication MB/s over the baseline's, at least
ENV = {"NODE_REGISTRATION_TTL_S": "2"}  # the killed node unregistered within 2 s
MIB = 1 << 20


@dataclass(slots=True)
class Row:
    name: str
    fragments: int = 0
    entries: int = 0
    size: int = 0  # payload bytes
    seconds: float = 0.0

    def per_s(self, count: float) -> float:
        return count / self.seconds if self.seconds else 0.0

    def cells(self) -> tuple[str, ...]:
        return (
            self.name,
            str(self.fragments),
            f"{self.entries:,}",
            f"{self.size / MB:,.1f}",
            f"{self.seconds:.2f}",
            f"{self.per_s(self.fragments):,.1f}",
            f"{self.per_s(self.entries):,.0f}",
            f"{self.per_s(self.size) / MB:,.1f}",
        )


async def _write(client: Client, total_mib: float, entry_size: int) -> list[int]:
    """Closed 3/3/2 ledgers holding ``total_mib`` MiB of random entries; their ids."""
    rng = random.Random(0)
    per_ledger = max(1, LEDGER_MIB * MIB // entry_size)
    left = max(1, int(total_mib * MIB) // entry_size)
    ids = []
    while left > 0:
        count = min(per_ledger, left)
        left -= count
        ledger = await client.create_ledger(*SHAPE)
        for start in range(0, count, WRITE_BATCH):
            await ledger.add_batch(
                [rng.randbytes(entry_size) for _ in range(min(WRITE_BATCH, count - start))]
            )
        await ledger.close()
        ids.append(ledger.id)
    return ids


async def _lose_a_node(cluster: LocalCluster, client: Client, ids: list[int]) -> list[int]:
    """Kill and wipe the node in most ensembles; the ledgers an audit then marks."""
    from node.autorecovery.auditor import audit
    from node.client.model import decode, ledger_key, node_key

    ensembles = []
    for ledger_id in ids:
        found = await client.store.get(ledger_key(ledger_id))
        assert found is not None
        ensembles.append(decode(found.value).segments[0].ensemble)
    victim = max(cluster.node_ids, key=lambda n: sum(n in e for e in ensembles))
    await asyncio.to_thread(cluster.wipe, victim)
    deadline = time.monotonic() + 30
    while await client.store.get(node_key(victim)) is not None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{victim} still registered 30 s after its death")
        await asyncio.sleep(0.1)
    return sorted((await audit(client, lost_node_delay_s=0)).markers)


async def _baseline(client: Client, marked: list[int]) -> Row:
    """Each marked ledger read whole by the client and added to a new single-copy ledger."""
    row = Row(f"client reads + adds, {PARALLEL} ledgers at a time")
    gate = asyncio.Semaphore(PARALLEL)

    async def copy(ledger_id: int) -> None:
        async with gate:
            reader = await client.open_ledger(ledger_id)
            last = reader.metadata.last_entry_id
            target = await client.create_ledger(1, 1, 1)
            for start in range(0, last + 1, COPY_BATCH):
                end = min(start + COPY_BATCH, last + 1) - 1
                batch = [bytes(p) async for _e, p in reader.read(start, end)]
                await target.add_batch(batch)
                row.entries += len(batch)
                row.size += sum(map(len, batch))
            await target.close()
            row.fragments += 1

    started = time.perf_counter()
    await asyncio.gather(*(copy(ledger_id) for ledger_id in marked))
    row.seconds = time.perf_counter() - started
    return row


async def _rereplicate(cluster: LocalCluster, marked: list[int]) -> Row:
    """Each marker re-replicated by a live node's route, as the DAG sends them."""
    import aiohttp

    row = Row(f"re-replication (nodes' route), {PARALLEL} markers at a time")
    live = sorted(cluster.url(n) for n in cluster.node_ids if cluster.node(n).alive())
    gate = asyncio.Semaphore(PARALLEL)
    timeout = aiohttp.ClientTimeout(total=3600)

    async def move(http: aiohttp.ClientSession, ledger_id: int) -> None:
        body = {"metadataUrl": cluster.metadata_url, "ledgerId": ledger_id}
        url = f"{live[ledger_id % len(live)]}/api/v1/autorecovery/rereplicate"
        async with gate, http.post(url, json=body) as resp:
            answer: dict[str, Any] = await resp.json()
        if resp.status != 200 or answer.get("outcome") != "done":
            raise RuntimeError(f"ledger {ledger_id}: {resp.status} {answer}")
        row.fragments += answer["fragments"]
        row.entries += answer["entries"]
        row.size += answer["bytes"]

    async with aiohttp.ClientSession(timeout=timeout) as http:
        started = time.perf_counter()
        await asyncio.gather(*(move(http, ledger_id) for ledger_id in marked))
        row.seconds = time.perf_counter() - started
    return row


async def _runs(cluster: LocalCluster, total_mib: float, entry_size: int) -> list[Row]:
    from node.client import Client

    async with Client(cluster.metadata_url) as client:
        ids = await _write(client, total_mib, entry_size)
        marked = await _lose_a_node(cluster, client, ids)
        if not marked:
            raise RuntimeError("the lost node held no ledger: nothing to copy")
        baseline = await _baseline(client, marked)
    return [baseline, await _rereplicate(cluster, marked)]


def _ratio_line(baseline: Row, rows: Row) -> str:
    base = baseline.per_s(baseline.size)
    ratio = rows.per_s(rows.size) / base if base else 0.0
    verdict = "met" if ratio >= TARGET else "MISSED"
    return (
        f"- re-replication / client reads + adds MB/s = {ratio:.2f}x "
        f"(target >= {TARGET}x: {verdict})"
    )


def main(args: argparse.Namespace) -> int:
    from node.localcluster import LocalCluster
    from node.runtime import run

    require_positive(rereplicate_mib=args.rereplicate_mib, entry_size=args.entry_size)
    with scratch_dir(args.dir, "node-bench-rereplicate-") as scratch:
        print(
            f"## node bench rereplicate: {args.rereplicate_mib} MiB in {SHAPE[0]}/{SHAPE[1]}/"
            f"{SHAPE[2]} ledgers of {LEDGER_MIB} MiB, {args.entry_size} B entries, etcd and "
            f"{NODES} nodes on loopback, one node lost"
        )
        print(short_machine_line(scratch))
        cluster = LocalCluster(Path(scratch) / "cluster", nodes=NODES, env=ENV)
        try:
            rows = run(_runs(cluster, args.rereplicate_mib, args.entry_size))
        finally:
            cluster.close()
        header = ("run", "fragments", "entries", "MB", "s", "fragments/s", "entries/s", "MB/s")
        print("\n".join(markdown_table(header, [row.cells() for row in rows])))
        print()
        print(_ratio_line(*rows))
    return 0
