"""``python -m node bench stream --replicated``: replicated streams (E=3, Qw=3, Qa=2) on a local
cluster this command starts (etcd and four nodes on loopback) against a single node's streams
(no metadata store, as before replication) on the same machine, over HTTP, driven by the same
load process as ``bench stream``.

Runs, each for ``--seconds`` after a warm-up, each on a fresh stream (ledgers rolling over
every ``stream.ROLLOVER_ENTRIES`` entries), the single node's first, then the cluster's:
- batch appends: POST 100 entries of 1 KiB per request from ``--writers`` connections;
- single appends: POST one 1 KiB entry per request from ``--writers`` connections;
- one append at a time (one connection: the latency floor);
- on the cluster, one append at a time once more, sent to a node that does not own the
  stream (it forwards each request to the owner: one extra hop).

The cluster's streams are created and first appended to through n0, which takes them over;
the owner is then read from etcd (``stream-owners/<name>``). Each row: requests/s,
entries/s, MB/s, p50 and p99 of a request, the requests that failed, and the CPU the serving
processes used (in cores: all four nodes and etcd for the cluster). Ratio lines compare with
the targets: replicated batch ingest at least 0.3x a single node's (three copies on two
cores), a forwarded append's p50 at most 1.5x the owner's.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from node.bench.common import P50, markdown_table, require_positive, scratch_dir
from node.bench.server import (
    BATCH_ENTRIES,
    ENTRY_SIZE,
    Figures,
    call,
    run_load,
    serving,
    short_machine_line,
)
from node.bench.stream import BATCH, POLICIES, SINGLE
from node.http.frames import JSON_CONTENT_TYPE, OCTET_CONTENT_TYPE
from node.localcluster import LocalCluster

NODES = 4  # three copies, and a fourth node to forward from that holds none of some ledgers
REPLICATION = {"ensemble": 3, "writeQuorum": 3, "ackQuorum": 2}
BATCH_TARGET = 0.3  # replicated batch entries/s over a single node's, at least
FORWARD_TARGET = 1.5  # a forwarded append's p50 over the owner's, at most
SINGLE_NODE, REPLICATED, FORWARDED = "single node", "replicated 3/3/2", "replicated, forwarded"
LOAD_MODULE = "node.bench.stream"  # its load process (load_main)


class ReplicationRefused(RuntimeError):
    """The cluster would not create a replicated stream (a node without replicated streams)."""


@dataclass(slots=True)
class Row(Figures):
    errors: int = 0


def _shapes(writers: int) -> list[tuple[str, str, int]]:
    """(mode, name, connections) of the runs both sides make."""
    return [
        (BATCH, f"batch appends ({BATCH_ENTRIES} x 1 KiB), {writers} writers", writers),
        (SINGLE, f"single appends, {writers} writers", writers),
        (SINGLE, "one append at a time", 1),
    ]


def _policies(replicated: bool) -> bytes:
    replication = {"replication": REPLICATION} if replicated else {}
    return json.dumps({**POLICIES, **replication}).encode()


def _row(
    name: str, pids: list[int], url: str, mode: str, writers: int, seconds: float, stream: str
) -> Row:
    result, cpu_s = run_load(pids, url, LOAD_MODULE, mode, writers, seconds, stream)
    return Row(
        name=name,
        requests=result["requests"],
        entries=result["entries"],
        seconds=result["seconds"],
        latencies=result["appends"],
        server_cpu_s=cpu_s,
        errors=result["errors"],
    )


def _single_node(scratch: Path, writers: int, seconds: float) -> list[Row]:
    rows = []
    with serving(scratch / "single") as server:
        for n, (mode, name, count) in enumerate(_shapes(writers)):
            stream = f"single-{n}"
            call(
                f"{server.url}/api/v1/streams/{stream}", "PUT", _policies(False), JSON_CONTENT_TYPE
            )
            pids = [server.proc.pid]
            rows.append(
                _row(f"{name}, {SINGLE_NODE}", pids, server.url, mode, count, seconds, stream)
            )
    return rows


def owner_of(cluster: LocalCluster, stream: str) -> str:
    """The node id ``stream-owners/<stream>`` names; ReplicationRefused without one."""
    raw = cluster.etcd.get(f"/{cluster.prefix}/stream-owners/{stream}")
    if raw is None:
        raise ReplicationRefused(f"no owner of stream {stream} in etcd after an append")
    return str(json.loads(raw)["node"])


def _replicated_stream(cluster: LocalCluster, stream: str) -> str:
    """Creates ``stream`` (3/3/2) through n0 and appends once through it; its owner's id."""
    url = cluster.url(cluster.node_ids[0])
    try:
        call(f"{url}/api/v1/streams/{stream}", "PUT", _policies(True), JSON_CONTENT_TYPE)
        call(
            f"{url}/api/v1/streams/{stream}/entries", "POST", bytes(ENTRY_SIZE), OCTET_CONTENT_TYPE
        )
    except OSError as error:  # urllib's HTTPError: the refusal's body says why
        detail = error.read().decode(errors="replace") if hasattr(error, "read") else ""
        raise ReplicationRefused(f"{error} {detail}".strip()) from error
    return owner_of(cluster, stream)


def _cluster_pids(cluster: LocalCluster) -> list[int]:
    procs = [cluster.node(n).proc for n in cluster.node_ids] + [cluster.etcd.proc]
    return [p.pid for p in procs if p is not None]


def _replicated(scratch: Path, writers: int, seconds: float) -> list[Row]:
    rows = []
    cluster = LocalCluster(scratch / "cluster", nodes=NODES)
    try:
        pids = _cluster_pids(cluster)
        for n, (mode, name, count) in enumerate(_shapes(writers)):
            stream = f"replicated-{n}"
            url = cluster.url(_replicated_stream(cluster, stream))
            rows.append(_row(f"{name}, {REPLICATED}", pids, url, mode, count, seconds, stream))
        stream = "forwarded"
        owner = _replicated_stream(cluster, stream)
        other = next(n for n in cluster.node_ids if n != owner)
        name = f"one append at a time, {FORWARDED}"
        rows.append(_row(name, pids, cluster.url(other), SINGLE, 1, seconds, stream))
    finally:
        cluster.close()
    return rows


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


def ratio_lines(rows: list[Row]) -> list[str]:
    """The replicated rows against the single node's, shape by shape, then the forwarded
    append against the owner's, with the targets."""
    by_name = {row.name: row for row in rows}
    lines = []
    for shape in dict.fromkeys(row.name.rsplit(", ", 1)[0] for row in rows):
        single = by_name.get(f"{shape}, {SINGLE_NODE}")
        replicated = by_name.get(f"{shape}, {REPLICATED}")
        if single is None or replicated is None:
            continue
        throughput = _ratio(replicated.entries_per_s, single.entries_per_s)
        latency = _ratio(replicated.latency_ms(P50), single.latency_ms(P50))
        if shape.startswith("batch"):
            verdict = "met" if throughput >= BATCH_TARGET else "MISSED"
            lines.append(
                f"- {shape}: replicated / single node entries/s = {throughput:.2f}x "
                f"(target >= {BATCH_TARGET}x: {verdict}); p50 = {latency:.2f}x"
            )
        else:
            lines.append(
                f"- {shape}: replicated / single node entries/s = {throughput:.2f}x; "
                f"p50 = {latency:.2f}x"
            )
    owner = by_name.get(f"one append at a time, {REPLICATED}")
    forwarded = by_name.get(f"one append at a time, {FORWARDED}")
    if owner is not None and forwarded is not None:
        ratio = _ratio(forwarded.latency_ms(P50), owner.latency_ms(P50))
        verdict = "met" if ratio <= FORWARD_TARGET else "MISSED"
        lines.append(
            f"- one append at a time: forwarded (to a non-owner) / owner p50 = {ratio:.2f}x "
            f"(target <= {FORWARD_TARGET}x: {verdict})"
        )
    return lines


def table(rows: list[Row]) -> list[str]:
    header = (
        "run",
        "requests/s",
        "entries/s",
        "MB/s",
        "p50 ms",
        "p99 ms",
        "errors",
        "server cores",
    )
    return markdown_table(header, [(*row.cells(), str(row.errors), row.cores) for row in rows])


def main(args: argparse.Namespace) -> int:
    require_positive(seconds=args.seconds, writers=args.writers)
    with scratch_dir(args.dir, "node-bench-stream-replicated-") as scratch:
        print(
            f"## node bench stream --replicated: {args.seconds} s per run, 1 KiB entries, "
            f"a single node against etcd and {NODES} nodes on loopback (E=3 Qw=3 Qa=2)"
        )
        print(short_machine_line(scratch))
        rows = _single_node(scratch, args.writers, args.seconds)
        try:
            rows += _replicated(scratch, args.writers, args.seconds)
        except ReplicationRefused as error:
            print("\n".join(table(rows)))
            print(f"bench stream --replicated: no replicated stream on the cluster: {error}")
            return 1
        print("\n".join(table(rows)))
        print()
        print("\n".join(ratio_lines(rows)))
    return 0
