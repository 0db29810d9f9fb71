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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import time
from collections.abc import Awaitable, Callable
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
from node.bench.server import BATCH_ENTRIES, ENTRY_SIZE, cpu_seconds, short_machine_line

if TYPE_CHECKING:
    from node.localcluster import LocalCluster

NODES = 3
REPLICATED = (3, 3, 2)  # E, Qw, Qa
SINGLE_COPY = (1, 1, 1)
BATCH_TARGET = 0.3  # replicated batch entries/s over single copy's, at least
LATENCY_TARGET = 2.0  # replicated single-add p50 over single copy's, at most
BATCH, SINGLE, ONE = "batch", "single", "one"


@dataclass(slots=True)
class Row:
    name: str
    quorums: tuple[int, int, int]
    entries: int = 0
    seconds: float = 0.0
    errors: int = 0
    latencies: list[float] = field(default_factory=list, repr=False)
    cores: dict[str, float] = field(default_factory=dict)  # process name -> cores

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


async def _runs(cluster: LocalCluster, writers: int, window: int, seconds: float) -> list[Row]:
    from node.client import Client

    pids = _processes(cluster)
    shapes = [
        (BATCH, f"batches of {BATCH_ENTRIES} x 1 KiB, {writers} writers", writers),
        (SINGLE, f"single adds, {writers} writers x {window}", writers),
        (ONE, "one add at a time", 1),
    ]
    rows = []
    async with Client(cluster.metadata_url) as client:
        for mode, name, count in shapes:
            for quorums in (SINGLE_COPY, REPLICATED):
                row = Row(f"{name}, {_label(quorums)}", quorums)
                rows.append(await _measure(client, row, mode, count, window, seconds, pids))
    return rows


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


def main(args: argparse.Namespace) -> int:
    from node.localcluster import LocalCluster
    from node.runtime import run

    require_positive(seconds=args.seconds, writers=args.writers, window=args.window)
    with scratch_dir(args.dir, "node-bench-replicated-") as scratch:
        print(
            f"## node bench replicated: {args.seconds} s per run, 1 KiB entries, "
            f"etcd and {NODES} nodes on loopback, the client in this process"
        )
        print(short_machine_line(scratch))
        cluster = LocalCluster(Path(scratch) / "cluster", nodes=NODES)
        try:
            rows = run(_runs(cluster, args.writers, args.window, args.seconds))
            processes = list(_processes(cluster))
        finally:
            cluster.close()
        header = (
            "run",
            "entries/s",
            "MB/s",
            "add p50 ms",
            "add p99 ms",
            "errors",
            *(f"{name} cores" for name in processes),
        )
        print("\n".join(markdown_table(header, [row.cells(processes) for row in rows])))
        print()
        print("\n".join(_ratio_lines(rows)))
    return 0
