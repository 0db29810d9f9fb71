"""``python -m node bench stream --replicated``: replicated streams (E=3, Qw=3, Qa=2) on a local
cluster this command starts (etcd and four nodes on loopback) against a single node's streams
(no metadata store, as before replication) on the same machine, over HTTP, both up for the
whole run and measured alternately, row by row: the single node's, then the cluster's.

Groups of rows (``--rows``, comma-separated; all by default), each row on a fresh stream whose
ledgers roll over every ``stream.ROLLOVER_ENTRIES`` entries:
- appends: batch appends (100 entries of 1 KiB per request) and single appends from
  ``--writers`` connections, one append at a time (the latency floor), each for ``--seconds``
  after a warm-up (stream.py's load process); on the cluster once more one append at a time,
  sent to a node that does not own the stream (it forwards each request: one extra hop);
- reads: catch-up reads of a stream filled with ``--read-entries`` entries of 1 KiB, from its
  start in pages of ``--read-page`` (stream_reads.py): plain reads through the single node,
  through the owner, through a non-owner (forwarded), and of a 1/1/1 stream on the fleet
  through its owner; a cursor's reads (read, ack, read) through the single node and the
  owner. Every entry read is compared with the one written there;
- tail: one writer appending single entries at ``stream.TAIL_RATE`` per second, one consumer
  long-polling from the end; end-to-end latency from the append's send to the consumer's
  receipt, with the consumer on the single node, on the owner, and on a non-owner. The three
  take turns ``TAIL_ROUNDS`` times, ``--seconds`` split among the turns, each row's pooled.

The cluster's streams are created and first appended to through n0, which takes them over;
the owner is then read from etcd (``stream-owners/<name>``). CPU: the cores each serving
process used in the measured window, the owner's, the other nodes' (summed) and etcd's apart.
Ratio lines compare with the replicated path's targets, each "met" or "MISSED"; a row that read an
entry other than the one written, or fewer entries, fails the bench (exit 1).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from node.bench.common import (
    P50,
    P99,
    UsageError,
    markdown_table,
    quantile_ms,
    require_positive,
    scratch_dir,
)
from node.bench.server import (
    BATCH_ENTRIES,
    ENTRY_SIZE,
    FILL_BATCH,
    Figures,
    LoadFailed,
    Server,
    call,
    indexed_payload,
    load_process,
    run_load_by_pid,
    serving,
    short_machine_line,
)
from node.bench.stream import (
    BATCH,
    DEDUP_MODES,
    POLICIES,
    SINGLE,
    TAIL_PACED,
    TAIL_RATE,
    dedup_lines,
    dedup_runs,
)
from node.bench.stream_reads import CURSOR, PLAIN
from node.localcluster import LocalCluster, ProcessExited
from node.wire import BATCH_CONTENT_TYPE, JSON_CONTENT_TYPE, OCTET_CONTENT_TYPE, encode_batch

NODES = 4  # three copies, and a fourth node to forward from that holds none of some ledgers
REPLICATION = {"ensemble": 3, "writeQuorum": 3, "ackQuorum": 2}
ONE_COPY = {"ensemble": 1, "writeQuorum": 1, "ackQuorum": 1}
APPENDS, READS, TAIL = "appends", "reads", "tail"
GROUPS = (APPENDS, READS, TAIL)
DEDUP = "dedup"  # --dedup: appends with producer headers against without, replicated
# Targets: replicated over single node (at least for throughput, at most for latency)
BATCH_TARGET = 0.3  # batch appends, entries/s (three copies on two cores: about 1/3 at best)
SINGLE_TARGET = 0.3  # single appends, entries/s
ONE_TARGET = 2.0  # one append at a time, p50
FORWARD_TARGET = 1.5  # a forwarded append's p50 over the owner's
CATCH_UP_TARGET = 0.8  # catch-up reads of a 3/3/2 stream, entries/s
FLEET_TARGET = 0.9  # catch-up reads of a 1/1/1 stream on the fleet, entries/s
TAIL_TARGET = 1.5  # a tailing consumer's end-to-end p50
TAIL_ROUNDS = 3  # the tail rows take turns this many times in a run (``_tail``)
SINGLE_NODE, REPLICATED, FORWARDED = "single node", "replicated 3/3/2", "replicated, forwarded"
OWNER_SIDE = f"{REPLICATED}, through the owner"
OTHER_SIDE = f"{REPLICATED}, through a non-owner"
FLEET_SIDE = "1/1/1 on the fleet, through the owner"
CONSUMER_ELSEWHERE = f"{REPLICATED}, the consumer on a non-owner"
OWNER, OTHERS, ETCD = "owner", "other nodes", "etcd"  # the CPU columns
ROLES = (OWNER, OTHERS, ETCD)
LOAD_MODULE = "node.bench.stream"  # the appends' and the tail's load process (load_main)
READ_MODULE = "node.bench.stream_reads"  # the catch-up reads'
CLUSTER_ATTEMPTS = 3  # starts of the cluster when a node's port was taken meanwhile
PORT_TAKEN = "Address already in use"  # a node's refusal to start, in its log


class ReplicationRefused(RuntimeError):
    """The cluster would not create a replicated stream (a node without replicated streams)."""


@dataclass(slots=True)
class Row(Figures):
    errors: int = 0
    cpu: dict[str, float] = field(default_factory=dict)  # role -> CPU seconds
    misread: int = 0  # entries read that are not the ones written there
    expected: int = 0  # reads: the entries written (and so to read)
    e2e: list[float] = field(default_factory=list, repr=False)  # tail: append to receipt
    appended: int = 0  # tail: entries appended in the measured window ...
    delivered: int = 0  # ... and how many of them the consumer received

    def role_cores(self, role: str) -> str:
        if role not in self.cpu or not self.seconds:
            return "-"
        return f"{self.cpu[role] / self.seconds:.2f}"

    def cpu_cells(self) -> tuple[str, ...]:
        """Cores of all serving processes, then of each role (0.00 when measured as none:
        a short read may end within one tick of the CPU clock)."""
        total = f"{self.server_cpu_s / self.seconds:.2f}" if self.cpu and self.seconds else "-"
        return (total, *(self.role_cores(role) for role in ROLES))

    def failure(self) -> str | None:
        """Why this row shows a wrong read, or None."""
        if self.misread:
            return f"{self.name}: {self.misread} entries read are not the ones written there"
        if self.expected and self.entries != self.expected:
            return f"{self.name}: read {self.entries} entries of the {self.expected} written"
        if self.delivered < self.appended:
            return f"{self.name}: received {self.delivered} of the {self.appended} appended"
        return None


def start_cluster(root: Path, nodes: int) -> LocalCluster:
    """A LocalCluster under ``root``, started again (in a fresh directory) when a node lost
    its port to another process meanwhile: on a shared machine other tests' clusters pick
    ports from the same range."""
    for attempt in range(1, CLUSTER_ATTEMPTS + 1):
        try:
            return LocalCluster(root / f"cluster-{attempt}", nodes=nodes)
        except ProcessExited as error:
            if PORT_TAKEN not in str(error) or attempt == CLUSTER_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def parse_groups(text: str | None, groups: tuple[str, ...]) -> list[str]:
    """``--rows``: the comma-separated groups asked for (all without it), in run order."""
    if text is None:
        return list(groups)
    asked = {part.strip() for part in text.split(",") if part.strip()}
    unknown = asked - set(groups)
    if unknown or not asked:
        raise UsageError(f"--rows takes some of {', '.join(groups)}, got {text!r}")
    return [group for group in groups if group in asked]


# --- the two sides -------------------------------------------------------------------------


@dataclass(slots=True)
class Sides:
    """The single node and the cluster, both up for the whole run."""

    single: Server
    cluster: LocalCluster

    def single_roles(self) -> dict[int, str]:
        return {self.single.proc.pid: OWNER}

    def roles(self, owner: str) -> dict[int, str]:
        """pid -> role of every process of the cluster, for a stream that ``owner`` owns."""
        roles = {}
        for node_id in self.cluster.node_ids:
            proc = self.cluster.node(node_id).proc
            if proc is not None:
                roles[proc.pid] = OWNER if node_id == owner else OTHERS
        if self.cluster.etcd.proc is not None:
            roles[self.cluster.etcd.proc.pid] = ETCD
        return roles

    def other_than(self, owner: str) -> str:
        return self.cluster.url(next(n for n in self.cluster.node_ids if n != owner))


def _by_role(roles: dict[int, str], by_pid: dict[int, float]) -> dict[str, float]:
    cpu: dict[str, float] = {}
    for pid, seconds in by_pid.items():
        cpu[roles[pid]] = cpu.get(roles[pid], 0.0) + seconds
    return cpu


def _policies(replication: dict[str, int] | None, dedup: bool = False) -> bytes:
    return json.dumps(
        {
            **POLICIES,
            **({"replication": replication} if replication else {}),
            **({"deduplication": True} if dedup else {}),
        }
    ).encode()


def _single_stream(server: Server, stream: str) -> None:
    call(f"{server.url}/api/v1/streams/{stream}", "PUT", _policies(None), JSON_CONTENT_TYPE)


def owner_of(cluster: LocalCluster, stream: str) -> str:
    """The node id ``stream-owners/<stream>`` names; ReplicationRefused without one."""
    raw = cluster.etcd.get(f"/{cluster.prefix}/stream-owners/{stream}")
    if raw is None:
        raise ReplicationRefused(f"no owner of stream {stream} in etcd after an append")
    return str(json.loads(raw)["node"])


def _replicated_stream(
    cluster: LocalCluster,
    stream: str,
    replication: dict[str, int] = REPLICATION,
    first: bytes = bytes(ENTRY_SIZE),
    content_type: str = OCTET_CONTENT_TYPE,
    dedup: bool = False,
) -> str:
    """Creates ``stream`` through n0 and appends ``first`` through it; its owner's id."""
    url = cluster.url(cluster.node_ids[0])
    policies = _policies(replication, dedup)
    try:
        call(f"{url}/api/v1/streams/{stream}", "PUT", policies, JSON_CONTENT_TYPE)
        call(f"{url}/api/v1/streams/{stream}/entries", "POST", first, content_type)
    except OSError as error:  # urllib's HTTPError: the refusal's body says why
        detail = error.read().decode(errors="replace") if hasattr(error, "read") else ""
        raise ReplicationRefused(f"{error} {detail}".strip()) from error
    return owner_of(cluster, stream)


def _fill_batches(start: int, stop: int) -> Iterator[bytes]:
    for first in range(start, stop, FILL_BATCH):
        last = min(stop, first + FILL_BATCH)
        yield encode_batch([indexed_payload(i) for i in range(first, last)])


def _fill(url: str, stream: str, start: int, stop: int) -> None:
    """Appends entries ``start`` .. ``stop - 1`` (``indexed_payload``) in order."""
    for body in _fill_batches(start, stop):
        call(f"{url}/api/v1/streams/{stream}/entries", "POST", body, BATCH_CONTENT_TYPE)


def _filled_replicated(
    cluster: LocalCluster, stream: str, entries: int, replication: dict[str, int]
) -> str:
    """A replicated stream of ``entries`` indexed entries: its first batch through n0 (which
    takes the stream over), the rest through the owner. The owner's id."""
    first = next(_fill_batches(0, entries))
    owner = _replicated_stream(cluster, stream, replication, first, BATCH_CONTENT_TYPE)
    _fill(cluster.url(owner), stream, min(FILL_BATCH, entries), entries)
    return owner


# --- the rows ------------------------------------------------------------------------------


def _load_row(
    name: str,
    roles: dict[int, str],
    url: str,
    mode: str,
    writers: int,
    seconds: float,
    stream: str,
    reader_url: str = "",
) -> Row:
    extra = [reader_url] if reader_url else []
    result, by_pid = run_load_by_pid(
        list(roles), url, LOAD_MODULE, mode, writers, seconds, stream, *extra
    )
    return Row(
        name=name,
        requests=result["requests"],
        entries=result["entries"],
        seconds=result["seconds"],
        latencies=result["appends"],
        server_cpu_s=sum(by_pid.values()),
        errors=result["errors"],
        cpu=_by_role(roles, by_pid),
        misread=result.get("misread", 0),
        e2e=result["e2e"],
        appended=result["appended_in_window"],
        delivered=result["delivered"],
    )


def _read_row(
    name: str, roles: dict[int, str], url: str, stream: str, mode: str, entries: int, page: int
) -> Row:
    pids = ",".join(map(str, roles))
    result = load_process(READ_MODULE, url, stream, mode, entries, page, pids)
    by_pid = {int(pid): seconds for pid, seconds in result["cpu"].items()}
    return Row(
        name=name,
        requests=result["requests"],
        entries=result["entries"],
        seconds=result["seconds"],
        latencies=result["pages"],
        server_cpu_s=sum(by_pid.values()),
        cpu=_by_role(roles, by_pid),
        misread=result["misread"],
        expected=entries,
    )


def _append_shapes(writers: int) -> list[tuple[str, str, int]]:
    """(mode, name, connections) of the append rows both sides make."""
    return [
        (BATCH, f"batch appends ({BATCH_ENTRIES} x 1 KiB), {writers} writers", writers),
        (SINGLE, f"single appends, {writers} writers", writers),
        (SINGLE, "one append at a time", 1),
    ]


def _appends(sides: Sides, writers: int, seconds: float) -> list[Row]:
    rows = []
    for n, (mode, shape, count) in enumerate(_append_shapes(writers)):
        stream = f"single-{n}"
        _single_stream(sides.single, stream)
        name = f"{shape}, {SINGLE_NODE}"
        rows.append(
            _load_row(name, sides.single_roles(), sides.single.url, mode, count, seconds, stream)
        )
        stream = f"replicated-{n}"
        owner = _replicated_stream(sides.cluster, stream)
        url = sides.cluster.url(owner)
        name = f"{shape}, {REPLICATED}"
        rows.append(_load_row(name, sides.roles(owner), url, mode, count, seconds, stream))
    stream = "forwarded"
    owner = _replicated_stream(sides.cluster, stream)
    name = f"one append at a time, {FORWARDED}"
    rows.append(
        _load_row(name, sides.roles(owner), sides.other_than(owner), SINGLE, 1, seconds, stream)
    )
    return rows


def _dedup_rows(sides: Sides, writers: int, seconds: float) -> list[Row]:
    """Replicated appends with producer headers against without (stream.dedup_runs)."""
    rows = []
    for n, (shape, mode, count) in enumerate(dedup_runs(writers)):
        stream = f"dedup-{n}"
        owner = _replicated_stream(sides.cluster, stream, dedup=mode in DEDUP_MODES)
        url = sides.cluster.url(owner)
        rows.append(
            _load_row(
                f"{shape}, {REPLICATED}", sides.roles(owner), url, mode, count, seconds, stream
            )
        )
    return rows


def catch_up_shape(entries: int, page: int, cursor: bool = False) -> str:
    how = "a cursor's catch-up (read + ack)" if cursor else "catch-up read"
    return f"{how} of {entries:,} entries, pages of {page:,}"


def _reads(sides: Sides, entries: int, page: int) -> list[Row]:
    """Every stream filled first (so no read row shares the machine with a fill), then the
    rows, alternating between the single node and the cluster."""
    _single_stream(sides.single, "catch-up")
    _fill(sides.single.url, "catch-up", 0, entries)
    owner = _filled_replicated(sides.cluster, "catch-up", entries, REPLICATION)
    fleet_owner = _filled_replicated(sides.cluster, "catch-up-fleet", entries, ONE_COPY)
    single = (sides.single_roles(), sides.single.url, "catch-up")
    through_owner = (sides.roles(owner), sides.cluster.url(owner), "catch-up")
    elsewhere = (sides.roles(owner), sides.other_than(owner), "catch-up")
    fleet = (sides.roles(fleet_owner), sides.cluster.url(fleet_owner), "catch-up-fleet")
    runs = [
        (PLAIN, SINGLE_NODE, single),
        (PLAIN, OWNER_SIDE, through_owner),
        (PLAIN, OTHER_SIDE, elsewhere),
        (PLAIN, FLEET_SIDE, fleet),
        (CURSOR, SINGLE_NODE, single),
        (CURSOR, OWNER_SIDE, through_owner),
    ]
    rows = []
    for mode, side, (roles, url, stream) in runs:
        name = f"{catch_up_shape(entries, page, mode == CURSOR)}, {side}"
        rows.append(_read_row(name, roles, url, stream, mode, entries, page))
    return rows


def tail_shape() -> str:
    return f"tailing consumer, 1 writer at {TAIL_RATE}/s"


def _tail(sides: Sides, seconds: float) -> list[Row]:
    """The three rows in turn, ``TAIL_ROUNDS`` times for ``seconds / TAIL_ROUNDS`` each (on
    fresh streams), each row's rounds pooled: a p50 of 100/s moves with the machine's state
    by more than the gap between the rows, and taking turns shares that drift among them."""
    shape = tail_shape()
    per_round = seconds / TAIL_ROUNDS
    rounds: dict[str, list[Row]] = {}
    for turn in range(TAIL_ROUNDS):
        stream = f"tail-{turn}"
        _single_stream(sides.single, stream)
        name = f"{shape}, {SINGLE_NODE}"
        rounds.setdefault(name, []).append(
            _load_row(
                name, sides.single_roles(), sides.single.url, TAIL_PACED, 1, per_round, stream
            )
        )
        for side in (OWNER_SIDE, CONSUMER_ELSEWHERE):
            stream = f"tail-{turn}" if side == OWNER_SIDE else f"tail-elsewhere-{turn}"
            owner = _replicated_stream(sides.cluster, stream)
            reader = sides.other_than(owner) if side == CONSUMER_ELSEWHERE else ""
            url = sides.cluster.url(owner)
            name = f"{shape}, {side}"
            rounds.setdefault(name, []).append(
                _load_row(name, sides.roles(owner), url, TAIL_PACED, 1, per_round, stream, reader)
            )
    return [_pooled(name, runs) for name, runs in rounds.items()]


def _pooled(name: str, runs: list[Row]) -> Row:
    """One row of several runs of the same shape: counts and CPU summed, samples joined."""
    cpu: dict[str, float] = {}
    for run in runs:
        for role, used in run.cpu.items():
            cpu[role] = cpu.get(role, 0.0) + used
    return Row(
        name=name,
        requests=sum(r.requests for r in runs),
        entries=sum(r.entries for r in runs),
        seconds=sum(r.seconds for r in runs),
        latencies=[x for r in runs for x in r.latencies],
        server_cpu_s=sum(r.server_cpu_s for r in runs),
        errors=sum(r.errors for r in runs),
        cpu=cpu,
        misread=sum(r.misread for r in runs),
        e2e=[x for r in runs for x in r.e2e],
        appended=sum(r.appended for r in runs),
        delivered=sum(r.delivered for r in runs),
    )


# --- the report ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    """One ratio line: row ``shape, side`` over row ``shape, baseline`` of ``figure``."""

    shape: str
    side: str
    baseline: str
    figure: str  # "entries/s", "p50" (of a request) or "end-to-end p50"
    target: float  # at least (entries/s), or at most (latencies)


def _figure(row: Row, figure: str) -> float:
    if figure == "entries/s":
        return row.entries_per_s
    if figure == "p50":
        return row.latency_ms(P50)
    return quantile_ms(row.e2e, P50)


def targets(writers: int, entries: int, page: int) -> list[Target]:
    """The replicated path's targets, row against row."""
    batch, single, one = (shape for _, shape, _ in _append_shapes(writers))
    found = [
        Target(batch, REPLICATED, SINGLE_NODE, "entries/s", BATCH_TARGET),
        Target(single, REPLICATED, SINGLE_NODE, "entries/s", SINGLE_TARGET),
        Target(one, REPLICATED, SINGLE_NODE, "p50", ONE_TARGET),
        Target(one, FORWARDED, REPLICATED, "p50", FORWARD_TARGET),
    ]
    for cursor in (False, True):
        shape = catch_up_shape(entries, page, cursor)
        found += [
            Target(shape, OWNER_SIDE, SINGLE_NODE, "entries/s", CATCH_UP_TARGET),
            Target(shape, OTHER_SIDE, SINGLE_NODE, "entries/s", CATCH_UP_TARGET),
            Target(shape, FLEET_SIDE, SINGLE_NODE, "entries/s", FLEET_TARGET),
        ]
    for side in (OWNER_SIDE, CONSUMER_ELSEWHERE):
        found.append(Target(tail_shape(), side, SINGLE_NODE, "end-to-end p50", TAIL_TARGET))
    return found


def ratio_lines(rows: list[Row], wanted: list[Target]) -> list[str]:
    """A line per target whose two rows ran: the ratio, the target and whether it is met."""
    by_name = {row.name: row for row in rows}
    lines = []
    for t in wanted:
        side = by_name.get(f"{t.shape}, {t.side}")
        baseline = by_name.get(f"{t.shape}, {t.baseline}")
        if side is None or baseline is None:
            continue
        below = _figure(baseline, t.figure)
        ratio = _figure(side, t.figure) / below if below else 0.0
        at_least = t.figure == "entries/s"
        met = ratio >= t.target if at_least else 0 < ratio <= t.target
        lines.append(
            f"- {t.shape}: {t.side} / {t.baseline} {t.figure} = {ratio:.2f}x "
            f"(target {'>=' if at_least else '<='} {t.target}x: {'met' if met else 'MISSED'})"
        )
    return lines


CPU_HEADER = ("server cores", *(f"{role} cores" for role in ROLES))


def append_table(rows: list[Row]) -> list[str]:
    header = ("run", "requests/s", "entries/s", "MB/s", "p50 ms", "p99 ms", "errors", *CPU_HEADER)
    return markdown_table(
        header, [(*row.cells(), str(row.errors), *row.cpu_cells()) for row in rows]
    )


def read_table(rows: list[Row]) -> list[str]:
    header = (
        "run",
        "entries read",
        "misread",
        "entries/s",
        "MB/s",
        "page p50 ms",
        "page p99 ms",
        *CPU_HEADER,
    )
    cells = []
    for row in rows:
        name, _, per_s, mb, p50, p99 = row.cells()
        cells.append(
            (name, f"{row.entries:,}", str(row.misread), per_s, mb, p50, p99, *row.cpu_cells())
        )
    return markdown_table(header, cells)


def tail_table(rows: list[Row]) -> list[str]:
    header = (
        "run",
        "appends/s",
        "append p50 ms",
        "end-to-end p50 ms",
        "end-to-end p99 ms",
        "received / appended",
        "misread",
        *CPU_HEADER,
    )
    cells = [
        (
            row.name,
            f"{row.requests_per_s:,.0f}",
            f"{row.latency_ms(P50):.2f}",
            f"{quantile_ms(row.e2e, P50):.2f}",
            f"{quantile_ms(row.e2e, P99):.2f}",
            f"{row.delivered:,} / {row.appended:,}",
            str(row.misread),
            *row.cpu_cells(),
        )
        for row in rows
    ]
    return markdown_table(header, cells)


TABLES: dict[str, Callable[[list[Row]], list[str]]] = {
    APPENDS: append_table,
    READS: read_table,
    TAIL: tail_table,
    DEDUP: append_table,
}


def main(args: argparse.Namespace) -> int:
    groups = [DEDUP] if args.dedup else parse_groups(args.rows, GROUPS)
    entries, page = args.read_entries, args.read_page
    require_positive(
        seconds=args.seconds, writers=args.writers, read_entries=entries, read_page=page
    )
    with scratch_dir(args.dir, "node-bench-stream-replicated-") as scratch:
        print(
            f"## node bench stream --replicated: {', '.join(groups)}; {args.seconds} s per "
            f"timed run, 1 KiB entries, a single node against etcd and {NODES} nodes on "
            "loopback (E=3 Qw=3 Qa=2), alternating"
        )
        print(short_machine_line(scratch))
        done: dict[str, list[Row]] = {}
        failed: str | None = None
        with serving(scratch / "single") as single:
            cluster = start_cluster(scratch, NODES)
            sides = Sides(single, cluster)
            try:
                for group in groups:
                    if group == APPENDS:
                        done[group] = _appends(sides, args.writers, args.seconds)
                    elif group == READS:
                        done[group] = _reads(sides, entries, page)
                    elif group == DEDUP:
                        done[group] = _dedup_rows(sides, args.writers, args.seconds)
                    else:
                        done[group] = _tail(sides, args.seconds)
            except (ReplicationRefused, LoadFailed) as error:
                failed = f"{type(error).__name__}: {error}"
            finally:
                cluster.close()
        for group, rows in done.items():
            print()
            print("\n".join(TABLES[group](rows)))
        rows = [row for group_rows in done.values() for row in group_rows]
        print()
        print("\n".join(ratio_lines(rows, targets(args.writers, entries, page))))
        if DEDUP in done:
            modes = [mode for _, mode, _ in dedup_runs(args.writers)][: len(done[DEDUP])]
            print("\n".join(dedup_lines(done[DEDUP], modes)))
        failures = [f for f in map(Row.failure, rows) if f is not None]
        if failed is not None:
            failures.append(failed)
        for failure in failures:
            print(f"bench stream --replicated: FAILED: {failure}")
    return 1 if failures else 0
