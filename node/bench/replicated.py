"""``python -m node bench replicated``: replicated ledgers (E=3, Qw=3, Qa=2) against single-copy
ones (E=Qw=Qa=1), through the same client (``node.client``, in this process, on uvloop), on one
local cluster this command starts: etcd and three nodes on loopback.

Runs, each for ``--seconds`` after a warm-up, each pair one after the other (single copy, then
replicated) so that both see the disk in the same state:
- batches: ``--writers`` ledgers, each with one ``add_batch`` of 100 entries of 1 KiB in flight;
- single adds: ``--writers`` ledgers, each with ``--window`` adds of 1 KiB in flight;
- one add at a time: one ledger, one add in flight (the latency floor).

Each row: entries/s, MB/s, p50 and p99 of an add (of a batch for the batch rows), the adds that
failed or ended unknown, and the CPU each process used in the measured window (in cores: CPU
seconds over wall seconds): this process (the client), every node, etcd. On a machine with few
cores three copies cost three times the nodes' work, so the ratio lines compare with targets:
replicated batch ingest at least 0.3x single copy, a single add's p50 at most 2x.

Read rows (``--rows reads``; ``--rows appends`` for the rows above only): a closed ledger of
``--read-entries`` entries of 1 KiB, single copy and E=3 Qw=3 Qa=2, read whole in pages of
``--read-page``, alternating: one node's plain range reads over HTTP
(``GET /api/v1/ledgers/{id}/entries?from=&to=``, following ``X-Next-Entry-Id`` when a reply is
cut), from the first node of the ledger's ensemble, then ``ReadHandle.read`` through the
client. Every entry read is compared with the one written there; a wrong or missing one fails
the bench (exit 1). The ratio lines hold the client's reads against the single-copy node's
range reads, with the streams' catch-up target (at least 0.8x).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.bench.common import (
    MB,
    P50,
    P99,
    Phase,
    markdown_table,
    quantile_ms,
    require_positive,
    scratch_dir,
    warmup_for,
)
from node.bench.server import (
    BATCH_ENTRIES,
    ENTRY_SIZE,
    FILL_BATCH,
    cpu_seconds,
    indexed_payload,
    misread,
    short_machine_line,
)
from node.bench.stream_replicated import parse_groups, start_cluster
from node.http.ledgers import NEXT_ENTRY_HEADER
from node.wire import decode_range

if TYPE_CHECKING:
    from node.localcluster import LocalCluster

NODES = 3
REPLICATED = (3, 3, 2)  # E, Qw, Qa
SINGLE_COPY = (1, 1, 1)
BATCH_TARGET = 0.3  # replicated batch entries/s over single copy's, at least
LATENCY_TARGET = 2.0  # replicated single-add p50 over single copy's, at most
READ_TARGET = 0.8  # the client's reads over one node's range reads (the streams' catch-up target)
BATCH, SINGLE, ONE = "batch", "single", "one"
APPENDS, READS = "appends", "reads"
GROUPS = (APPENDS, READS)
RANGE_READS, CLIENT_READS = "range reads from one node (HTTP)", "ReadHandle.read (client)"


@dataclass(slots=True)
class Row:
    name: str
    quorums: tuple[int, int, int]
    entries: int = 0
    seconds: float = 0.0
    errors: int = 0
    latencies: list[float] = field(default_factory=list, repr=False)
    cores: dict[str, float] = field(default_factory=dict)  # process name -> cores
    misread: int = 0  # read rows: entries read that are not the ones written there
    expected: int = 0  # read rows: the entries written (and so to read)

    @property
    def entries_per_s(self) -> float:
        return self.entries / self.seconds if self.seconds else 0.0

    def p(self, quantile: float) -> float:
        return quantile_ms(self.latencies, quantile)

    def cells(self, processes: list[str]) -> tuple[str, ...]:
        return (
            self.name,
            f"{self.entries_per_s:,.0f}",
            f"{self.entries_per_s * ENTRY_SIZE / MB:,.1f}",
            f"{self.p(P50):.2f}",
            f"{self.p(P99):.2f}",
            str(self.errors),
            *(f"{self.cores.get(name, 0.0):.2f}" for name in processes),
        )


def _label(quorums: tuple[int, int, int]) -> str:
    e, qw, qa = quorums
    return "single copy" if quorums == SINGLE_COPY else f"E={e} Qw={qw} Qa={qa}"


def _processes(cluster: LocalCluster) -> dict[str, int]:
    """Process name -> pid, for the CPU columns: this one (the client), the nodes, etcd."""
    procs = {node_id: cluster.node(node_id).proc for node_id in cluster.node_ids}
    procs["etcd"] = cluster.etcd.proc
    pids = {"client": os.getpid()}
    for name, proc in procs.items():
        assert proc is not None, f"{name} is not running"
        pids[name] = proc.pid
    return pids


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


async def _measure(
    client: Any,
    row: Row,
    mode: str,
    writers: int,
    window: int,
    seconds: float,
    pids: dict[str, int],
) -> Row:
    """Opens ``writers`` ledgers of ``row.quorums``, loads them as ``mode`` says, records
    ``seconds`` after a warm-up, closes them."""
    e, qw, qa = row.quorums
    ledgers = [
        await client.create_ledger(ensemble=e, write_quorum=qw, ack_quorum=qa)
        for _ in range(writers)
    ]
    payload = bytes(ENTRY_SIZE)
    batch = [payload] * BATCH_ENTRIES
    per_add = BATCH_ENTRIES if mode == BATCH else 1
    phase = Phase()
    clock = time.perf_counter

    async def slot(add: Callable[[], Awaitable[object]]) -> None:
        while phase.running:
            started = clock()
            try:
                await add()
            except Exception:  # counted: a failed or unknown add ends its slot
                if phase.recording:
                    row.errors += 1
                return
            if phase.recording:
                row.latencies.append(clock() - started)
                row.entries += per_add

    adds: list[Callable[[], Awaitable[object]]] = []
    for ledger in ledgers:
        if mode == BATCH:
            adds.append(functools.partial(ledger.add_batch, batch))
        else:
            adds += [functools.partial(ledger.add, payload)] * (window if mode == SINGLE else 1)
    tasks = [asyncio.create_task(slot(add)) for add in adds]
    await asyncio.sleep(warmup_for(seconds))
    before = _cpu(pids)
    row.seconds = await phase.record(seconds)
    after = _cpu(pids)
    phase.running = False
    await asyncio.gather(*tasks)
    row.cores = {name: (after[name] - before[name]) / row.seconds for name in pids}
    for ledger in ledgers:
        # A handle whose add failed may refuse to close: its errors are counted already.
        with contextlib.suppress(Exception):
            await ledger.close()
    return row


async def _runs(
    cluster: LocalCluster, groups: list[str], args: argparse.Namespace
) -> tuple[list[Row], list[Row]]:
    """The append rows and the read rows of ``groups``."""
    from node.client import Client

    pids = _processes(cluster)
    writers, window, seconds = args.writers, args.window, args.seconds
    shapes = [
        (BATCH, f"batches of {BATCH_ENTRIES} x 1 KiB, {writers} writers", writers),
        (SINGLE, f"single adds, {writers} writers x {window}", writers),
        (ONE, "one add at a time", 1),
    ]
    appends: list[Row] = []
    reads: list[Row] = []
    async with Client(cluster.metadata_url) as client:
        if APPENDS in groups:
            for mode, name, count in shapes:
                for quorums in (SINGLE_COPY, REPLICATED):
                    row = Row(f"{name}, {_label(quorums)}", quorums)
                    appends.append(await _measure(client, row, mode, count, window, seconds, pids))
        if READS in groups:
            reads = await _reads(cluster, client, args.read_entries, args.read_page, pids)
    return appends, reads


def read_shape(entries: int, page: int) -> str:
    return f"read a closed ledger of {entries:,} entries, pages of {page:,}"


async def _filled_ledger(client: Any, quorums: tuple[int, int, int], entries: int) -> Any:
    """A closed ledger of ``entries`` indexed entries: its metadata."""
    e, qw, qa = quorums
    ledger = await client.create_ledger(ensemble=e, write_quorum=qw, ack_quorum=qa)
    for first in range(0, entries, FILL_BATCH):
        last = min(entries, first + FILL_BATCH)
        await ledger.add_batch([indexed_payload(i) for i in range(first, last)])
    return await ledger.close()


async def _reads(
    cluster: LocalCluster, client: Any, entries: int, page: int, pids: dict[str, int]
) -> list[Row]:
    """Both ledgers written first, then the rows: range reads and the client's, single copy
    then replicated."""
    import aiohttp

    shape = read_shape(entries, page)
    written = [(q, await _filled_ledger(client, q, entries)) for q in (SINGLE_COPY, REPLICATED)]
    rows = []
    async with aiohttp.ClientSession() as session:
        for quorums, meta in written:
            node = meta.segments[0].ensemble[0]
            row = Row(f"{shape}, {RANGE_READS}, {_label(quorums)}", quorums, expected=entries)
            pages = _range_pages(session, cluster.url(node), meta.ledger_id, entries, page)
            rows.append(await _timed_read(row, pages, pids))
            row = Row(f"{shape}, {CLIENT_READS}, {_label(quorums)}", quorums, expected=entries)
            handle = await client.open_ledger(meta.ledger_id)
            rows.append(await _timed_read(row, _client_pages(handle, entries, page), pids))
    return rows


async def _range_pages(
    session: Any, url: str, ledger_id: int, entries: int, page: int
) -> AsyncIterator[list[tuple[int, bytes]]]:
    """One node's range reads of entries 0 .. ``entries - 1``, a request per page (and one
    more where a reply is cut)."""
    first = 0
    while first < entries:
        last = min(entries, first + page) - 1
        query = f"from={first}&to={last}"
        async with session.get(f"{url}/api/v1/ledgers/{ledger_id}/entries?{query}") as reply:
            body = await reply.read()
            if reply.status != 200:
                raise ReadRefused(f"range read {query}: {reply.status} {body[:300]!r}")
            cut = reply.headers.get(NEXT_ENTRY_HEADER)
        found = list(decode_range(body))
        if not found:
            return
        yield found
        first = int(cut) if cut is not None else last + 1


async def _client_pages(
    handle: Any, entries: int, page: int
) -> AsyncIterator[list[tuple[int, bytes]]]:
    """``ReadHandle.read`` of the whole ledger, handed on ``page`` entries at a time."""
    found: list[tuple[int, bytes]] = []
    async for entry in handle.read(0, entries - 1):
        found.append(entry)
        if len(found) == page:
            yield found
            found = []
    if found:
        yield found


class ReadRefused(RuntimeError):
    """A read answered with an error: the bench stops there."""


async def _timed_read(
    row: Row, pages: AsyncIterator[list[tuple[int, bytes]]], pids: dict[str, int]
) -> Row:
    """Takes ``pages`` to their end, checking every entry: its figures in ``row``."""
    clock = time.perf_counter
    before = _cpu(pids)
    started = page_started = clock()
    async for found in pages:
        row.latencies.append(clock() - page_started)
        ids = [entry_id for entry_id, _ in found]
        if ids != list(range(row.entries, row.entries + len(found))):
            row.misread += len(found)  # not the next entries in order
        else:
            row.misread += misread(row.entries, (payload for _, payload in found))
        row.entries += len(found)
        page_started = clock()
    row.seconds = clock() - started
    after = _cpu(pids)
    row.cores = {name: (after[name] - before[name]) / row.seconds for name in pids}
    return row


def _ratio_lines(rows: list[Row]) -> list[str]:
    """Replicated against single copy, pair by pair, with the targets."""
    lines = []
    for single, replicated in zip(rows[0::2], rows[1::2], strict=True):
        shape = single.name.rsplit(", ", 1)[0]
        if shape.startswith("batches"):
            ratio = replicated.entries_per_s / single.entries_per_s if single.entries_per_s else 0
            verdict = "met" if ratio >= BATCH_TARGET else "MISSED"
            lines.append(
                f"- {shape}: replicated / single copy entries/s = {ratio:.2f}x "
                f"(target >= {BATCH_TARGET}x: {verdict})"
            )
        else:
            ratio = replicated.p(P50) / single.p(P50) if single.p(P50) else 0
            verdict = "met" if ratio <= LATENCY_TARGET else "MISSED"
            throughput = (
                replicated.entries_per_s / single.entries_per_s if single.entries_per_s else 0
            )
            lines.append(
                f"- {shape}: replicated / single copy p50 = {ratio:.2f}x "
                f"(target <= {LATENCY_TARGET}x: {verdict}); entries/s = {throughput:.2f}x"
            )
    return lines


def read_ratio_lines(rows: list[Row]) -> list[str]:
    """The client's reads against one node's range reads of the single-copy ledger."""
    by_name = {row.name: row for row in rows}
    lines = []
    for row in rows:
        shape, how, copies = row.name.rsplit(", ", 2)
        baseline = by_name.get(f"{shape}, {RANGE_READS}, {_label(SINGLE_COPY)}")
        if how != CLIENT_READS or baseline is None:
            continue
        ratio = row.entries_per_s / baseline.entries_per_s if baseline.entries_per_s else 0
        verdict = "met" if ratio >= READ_TARGET else "MISSED"
        lines.append(
            f"- {shape}: {how}, {copies} / one node's range reads entries/s = {ratio:.2f}x "
            f"(target >= {READ_TARGET}x: {verdict})"
        )
    return lines


def read_failures(rows: list[Row]) -> list[str]:
    """Read rows that returned an entry other than the one written there, or fewer."""
    failures = []
    for row in rows:
        if row.misread:
            failures.append(f"{row.name}: {row.misread} entries read are not the ones written")
        elif row.entries != row.expected:
            failures.append(f"{row.name}: read {row.entries} entries of the {row.expected}")
    return failures


def main(args: argparse.Namespace) -> int:
    from node.runtime import run

    groups = parse_groups(args.rows, GROUPS)
    require_positive(
        seconds=args.seconds,
        writers=args.writers,
        window=args.window,
        read_entries=args.read_entries,
        read_page=args.read_page,
    )
    with scratch_dir(args.dir, "node-bench-replicated-") as scratch:
        print(
            f"## node bench replicated: {', '.join(groups)}; {args.seconds} s per timed run, "
            f"1 KiB entries, etcd and {NODES} nodes on loopback, the client in this process"
        )
        print(short_machine_line(scratch))
        cluster = start_cluster(Path(scratch), NODES)
        try:
            appends, reads = run(_runs(cluster, groups, args))
            processes = list(_processes(cluster))
        finally:
            cluster.close()
        cores = tuple(f"{name} cores" for name in processes)
        if appends:
            header = ("run", "entries/s", "MB/s", "add p50 ms", "add p99 ms", "errors", *cores)
            print()
            print("\n".join(markdown_table(header, [r.cells(processes) for r in appends])))
        if reads:
            header = ("run", "entries/s", "MB/s", "page p50 ms", "page p99 ms", "misread", *cores)
            cells = [
                (*r.cells(processes)[:5], str(r.misread), *r.cells(processes)[6:]) for r in reads
            ]
            print()
            print("\n".join(markdown_table(header, cells)))
        print()
        print("\n".join(_ratio_lines(appends) + read_ratio_lines(reads)))
        failures = read_failures(reads)
        for failure in failures:
            print(f"bench replicated: FAILED: {failure}")
    return 1 if failures else 0
