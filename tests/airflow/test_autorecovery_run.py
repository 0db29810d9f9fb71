"""dag.test() runs of storage_node_autorecovery against a real fleet: etcd and four node
processes (node/localcluster.py), 3-replica ledgers written through the client and a
replicated stream written over HTTP, one node killed and its data directory deleted. The
DAG's audit marks the ledgers it held, its mapped tasks re-replicate them through the live
nodes, and afterwards every entry is on the Qw nodes of its segment (read from each
replica's ledger API directly) and no segment names the lost node; the stream goes on; a
second run finds nothing to do; the nodes' metrics say so from the store. The
``decommission`` param moves a live node's ledgers away while a reader reads them all.

The nodes have an admin token, as deployed: the DAG's calls carry it (the Airflow connection
storage_node), and so must the copies a node makes to other nodes."""

from __future__ import annotations

import asyncio
import json
import signal
import struct
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from node.client import Client
from node.client.metadata.etcd import EtcdStore
from node.client.model import LEDGERS_PREFIX, LedgerMetadata, NodeInfo, decode, node_key
from node.client.sync import SyncClient
from node.localcluster import LocalCluster
from tests.airflow.conftest import Airflow
from tests.autorecovery.test_ledger_check import BEFORE, short_replica
from tests.harness.cluster import MakeCluster, held_by, make_cluster

__all__ = ["make_cluster"]  # the fixture: etcd and node processes under the test's tmp_path

ENTRIES = 12
LEDGERS = 6
LOST = "n1"
TOKEN = "autorecovery-test-token"
FAST = {
    "NODE_REGISTRATION_TTL_S": "2",  # the killed node's registration goes within 2 s
    "NODE_AUTORECOVERY_POLL_S": "0.5",
    "NODE_ADMIN_TOKEN": TOKEN,
    # The stream's open ledger is fenced and recovered at once, not after 30 s: its owner
    # rolls over to a new ledger at its next append.
    "NODE_OPEN_LEDGER_REREPLICATION_GRACE_S": "0",
}
STREAM = "orders"
STREAM_APPENDS = 14  # ledgers of 5 (maxEntriesPerLedger): 5, 5 and an open one of 4
STREAM_OWNER = "n0"


def http(cluster: LocalCluster, node_id: str, method: str, path: str, body: bytes = b"") -> Any:
    request = urllib.request.Request(
        cluster.url(node_id) + path,
        data=body or None,
        method=method,
        headers={
            "Authorization": f"Bearer {TOKEN}",
            "Content-Type": "application/json" if body[:1] == b"{" else "application/octet-stream",
        },
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        raw = reply.read()
    return json.loads(raw) if raw[:1] == b"{" else raw


def write_stream(cluster: LocalCluster) -> dict[int, dict[int, bytes]]:
    """A 3/3/2 stream owned by STREAM_OWNER, several ledgers: ledger -> entry -> payload."""
    policies = {"maxEntriesPerLedger": 5, "minLedgerRolloverTimeMinutes": 0}
    replication = {"ensemble": 3, "writeQuorum": 3, "ackQuorum": 2}
    body = json.dumps({**policies, "replication": replication}).encode()
    assert http(cluster, STREAM_OWNER, "PUT", f"/api/v1/streams/{STREAM}", body)["owner"] == (
        STREAM_OWNER
    )
    written: dict[int, dict[int, bytes]] = {}
    for n in range(STREAM_APPENDS):
        payload = f"stream append {n} ".encode() * 30
        reply = http(cluster, STREAM_OWNER, "POST", f"/api/v1/streams/{STREAM}/entries", payload)
        ledger_id, entry_id = map(int, reply["position"].split(":"))
        written.setdefault(ledger_id, {})[entry_id] = payload
    assert len(written) == 3, written.keys()
    return written


def read_stream(cluster: LocalCluster, node_id: str) -> list[tuple[str, bytes]]:
    """Every entry of the stream, read through ``node_id`` (frames: ledger, entry, payload)."""
    raw = http(cluster, node_id, "GET", f"/api/v1/streams/{STREAM}/entries?limit=1000")
    found, at = [], 0
    while at < len(raw):
        ledger_id, entry_id, size = struct.unpack_from(">QQI", raw, at)
        at += 20
        found.append((f"{ledger_id}:{entry_id}", raw[at : at + size]))
        at += size
    return found


def run(
    airflow: Airflow,
    cluster: LocalCluster,
    urls: list[str],
    allow_failure: bool = False,
    **conf: Any,
) -> dict[str, Any]:
    done = airflow.run(
        "test",
        "storage_node_autorecovery",
        json.dumps(conf),
        variables={
            "storage_node_discovery": {"kind": "static", "urls": urls},
            "storage_node_metadata": cluster.metadata_url,
        },
        connections={"storage_node": {"conn_type": "http", "password": TOKEN}},
    )
    result: dict[str, Any] = done.result
    assert allow_failure or result["state"] == "success", done.output[-6000:]
    return result


def xcom(result: dict[str, Any], task_id: str) -> list[Any]:
    return [t["xcom"] for t in result["tasks"] if t["taskId"] == task_id and t["xcom"] is not None]


async def _ledgers(url: str) -> dict[int, LedgerMetadata]:
    store = EtcdStore(url)
    try:
        found = await store.range(LEDGERS_PREFIX)
    finally:
        await store.close()
    metas = [decode(versioned.value) for _key, versioned in found]
    return {m.ledger_id: m for m in metas}


def ledgers(cluster: LocalCluster) -> dict[int, LedgerMetadata]:
    return asyncio.run(_ledgers(cluster.metadata_url))


def replica_entry(cluster: LocalCluster, node_id: str, ledger_id: int, entry_id: int) -> bytes:
    url = f"{cluster.url(node_id)}/api/v1/ledgers/{ledger_id}/entries/{entry_id}"
    with urllib.request.urlopen(url, timeout=10) as reply:
        body: bytes = reply.read()
    return body


def metric(cluster: LocalCluster, node_id: str, name: str) -> float | None:
    with urllib.request.urlopen(f"{cluster.url(node_id)}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


def write_ledgers(cluster: LocalCluster, write_quorum: int) -> dict[int, list[bytes]]:
    """LEDGERS closed ledgers (E=3, Qa=2) of ENTRIES entries each: id -> payloads. Returns
    once every copy is on its node: an add is acknowledged at Qa, and a copy still on its way
    when the client closes is never sent (as with BookKeeper's client), which leaves a node
    short that the audit then finds besides the lost one (the copies counted are then more
    than the lost node's)."""
    written = {}
    with SyncClient(cluster.metadata_url, token=TOKEN) as client:
        for n in range(LEDGERS):
            ledger = client.create_ledger(ensemble=3, write_quorum=write_quorum, ack_quorum=2)
            payloads = [f"ledger {n} entry {e} ".encode() * 40 for e in range(ENTRIES)]
            for payload in payloads:
                ledger.add(payload)
            ledger.close()
            written[ledger.id] = payloads
        for ledger_id, meta in ledgers(cluster).items():
            if ledger_id in written:
                for entry in range(ENTRIES):
                    asyncio.run(held_by(cluster, ledger_id, entry, meta.write_set(entry)))
    return written


def test_a_lost_node_is_rereplicated_by_the_dag(
    airflow: Airflow, make_cluster: MakeCluster
) -> None:
    cluster = make_cluster(nodes=4, env=FAST)
    written = {
        ledger_id: dict(enumerate(payloads))
        for ledger_id, payloads in write_ledgers(cluster, write_quorum=3).items()
    }
    in_stream = write_stream(cluster)
    written.update(in_stream)
    held = [i for i, m in ledgers(cluster).items() if LOST in m.segments[0].ensemble]
    assert held, "no ledger has the node to lose: the test would prove nothing"
    urls = [cluster.url(node_id) for node_id in cluster.node_ids]  # the lost one's too
    # The stream's last append was acknowledged at Qa = 2: its third copy lands first, or a
    # failure of it to the wiped node would change the open ledger's ensemble before the
    # audit does anything (a new segment without LOST, the ledger left open).
    open_ledger = max(in_stream)  # the stream's last ledger: open when the node is lost
    last = max(in_stream[open_ledger])
    write_set = ledgers(cluster)[open_ledger].write_set(last)
    asyncio.run(held_by(cluster, open_ledger, last, write_set))

    cluster.wipe(LOST)
    time.sleep(3)  # its registration's lease runs out
    first = run(airflow, cluster, urls, lost_node_recovery_delay_s=0)
    (markers,) = xcom(first, "audit")
    assert sorted(markers) == sorted(held)
    outcomes = xcom(first, "rereplicate")
    assert len(outcomes) == len(held)
    assert {o["outcome"] for o in outcomes} == {"done"}, outcomes
    assert LOST not in {o["node"] for o in outcomes}  # left out: it does not answer
    counted = {o["ledgerId"]: o["entries"] for o in outcomes}
    for ledger_id in held:
        if ledger_id == open_ledger:
            # Its recovery re-adds the entries past the LAC the replicas knew, on an ensemble
            # without the lost node (a new segment): only the ones before need a copy.
            assert counted[ledger_id] <= len(written[ledger_id]), counted
        else:
            assert counted[ledger_id] == len(written[ledger_id]), counted
    copied = sum(counted.values())

    # Every entry on the Qw nodes of its segment, none of them the lost node, and equal to
    # what was written (each replica read directly, not through the client). The stream's
    # open ledger, when the lost node held it, was fenced and closed at its last entry (the
    # grace is 0 here); otherwise it is still open, its owner writing it.
    after = ledgers(cluster)
    fenced = open_ledger in held
    for ledger_id, entries in written.items():
        meta = after[ledger_id]
        assert all(LOST not in s.ensemble for s in meta.segments), meta
        if ledger_id != open_ledger or fenced:
            assert meta.closed and meta.last_entry_id == len(entries) - 1, meta
        for entry_id, payload in entries.items():
            for node_id in meta.write_set(entry_id):
                assert replica_entry(cluster, node_id, ledger_id, entry_id) == payload
    with SyncClient(cluster.metadata_url, token=TOKEN) as client:
        for ledger_id, entries in written.items():
            reader = client.open_ledger(ledger_id)
            last = len(entries) - 1
            got = [p for _, p in reader.read(0, last, past_lac=not reader.metadata.closed)]
            assert got == [entries[e] for e in range(len(entries))]

    # The stream goes on (an append sent to another node, forwarded): when its open ledger
    # was closed under its owner it lands in a new ledger, else after the last entry; every
    # node reads the stream whole.
    reply = http(cluster, "n2", "POST", f"/api/v1/streams/{STREAM}/entries", b"after recovery")
    ledger_id, entry_id = map(int, reply["position"].split(":"))
    if fenced:
        assert ledger_id > open_ledger and entry_id == 0, reply
    else:
        assert (ledger_id, entry_id) == (open_ledger, len(in_stream[open_ledger])), reply
    expected = [
        (f"{ledger_id}:{entry_id}", payload)
        for ledger_id in sorted(in_stream)
        for entry_id, payload in sorted(in_stream[ledger_id].items())
    ] + [(reply["position"], b"after recovery")]
    for node_id in ("n0", "n2", "n3"):
        assert read_stream(cluster, node_id) == expected, node_id

    # A second run: nothing under-replicated, nothing to copy; every node's metrics say so.
    second = run(airflow, cluster, urls, lost_node_recovery_delay_s=0)
    assert xcom(second, "audit") == [[]] and xcom(second, "rereplicate") == []
    deadline = time.monotonic() + 10
    for node_id in ("n0", "n2", "n3"):
        while metric(cluster, node_id, "storage_node_under_replicated_ledgers") != 0:
            assert time.monotonic() < deadline, f"{node_id} still reports under-replication"
            time.sleep(0.2)
        total = metric(cluster, node_id, "storage_node_rereplicated_entries_total")
        assert total == copied, (node_id, total)


def test_the_decommission_param_moves_a_live_nodes_ledgers_away(
    airflow: Airflow, make_cluster: MakeCluster
) -> None:
    cluster = make_cluster(nodes=4, env=FAST)
    leaving = "n3"
    written = write_ledgers(cluster, write_quorum=2)
    held = [i for i, m in ledgers(cluster).items() if leaving in m.segments[0].ensemble]
    assert held, "no ledger names the node to decommission: the test would prove nothing"
    urls = [cluster.url(node_id) for node_id in cluster.node_ids]

    # A reader reads every ledger whole, over and over, while the DAG moves them: no read may
    # fail (the old ensemble serves until the CAS, the new one after).
    reads, failures, stop = [0], [], threading.Event()

    def reader() -> None:
        with SyncClient(cluster.metadata_url, token=TOKEN) as client:
            while not stop.is_set():
                for ledger_id, payloads in written.items():
                    try:
                        got = [p for _, p in client.open_ledger(ledger_id).read(0, ENTRIES - 1)]
                    except Exception as error:  # any failure is the finding
                        failures.append(f"ledger {ledger_id}: {error!r}")
                        continue
                    if got != payloads:
                        failures.append(f"ledger {ledger_id}: other bytes")
                    reads[0] += 1

    thread = threading.Thread(target=reader, name="reader", daemon=True)
    thread.start()
    try:
        result = run(airflow, cluster, urls, decommission=leaving)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not failures, failures[:5]
    assert reads[0] >= LEDGERS, reads  # it read during the run, not only before
    assert xcom(result, "decommission") == [leaving]
    (markers,) = xcom(result, "audit")
    assert sorted(markers) == sorted(held)
    assert {o["outcome"] for o in xcom(result, "rereplicate")} == {"done"}
    # It holds nothing needed now; it still runs (the scale-down comes next), and every
    # ledger reads whole from the others.
    for ledger_id, meta in ledgers(cluster).items():
        assert all(leaving not in s.ensemble for s in meta.segments), meta
        for entry_id, payload in enumerate(written[ledger_id]):
            for node_id in meta.write_set(entry_id):
                assert replica_entry(cluster, node_id, ledger_id, entry_id) == payload
    assert cluster.node(leaving).alive()


# The killed copy's orphan is reclaimed within seconds, not a day; its tombstone is purged
# soon after (checkpoints and GC twice a second), so that the rerun may copy to that node.
ORPHANS = {
    **FAST,
    "NODE_AUTORECOVERY_LOCK_TTL_S": "3",
    "NODE_REPLICATION_GC_INTERVAL_S": "1",
    "NODE_REPLICATION_GC_GRACE_S": "1",
    "NODE_REPLICATION_OVERREPLICATED_GRACE_S": "1",
    "NODE_FLUSH_INTERVAL_MS": "500",
    "NODE_GC_WAIT_TIME_MS": "500",
}


def summary(cluster: LocalCluster, node_id: str) -> dict[str, Any]:
    found: dict[str, Any] = http(cluster, node_id, "GET", "/api/v1/status/summary")
    return found


def registered_anew(cluster: LocalCluster, node_id: str) -> None:
    """Until ``nodes/<id>`` is the running process's (a killed one's outlives it by a lease)."""
    started_ms = summary(cluster, node_id)["startedMs"]

    def registered() -> bool:
        found = asyncio.run(_get(cluster.metadata_url, node_key(node_id)))
        return found is not None and NodeInfo.decode(found).started_ms >= started_ms - 1000

    until(f"{node_id} registered again", registered)


def until(what: str, condition: Any, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.2)


def test_a_rereplicate_task_killed_mid_copy_and_the_dag_run_again(
    airflow: Airflow, make_cluster: MakeCluster
) -> None:
    """The node that a rereplicate task asked SIGKILLs itself at its worker's crash point, the
    fragment copied to the replacement and its CAS not sent: the task goes on to the next node,
    which finds the dead worker's lock (``locked``, left to the next run); tasks whose copy
    went to, or read from, the dying node fail (503, as with retries off here). The killed
    copy's orphan replica is reclaimed on its replacement; the node comes back; the DAG run
    again re-replicates the rest: the markers end at 0, every fragment counted once in
    ``autorecovery/totals``, every entry on the Qw nodes of its segment."""
    cluster = make_cluster(nodes=4, env=ORPHANS)
    written = write_ledgers(cluster, write_quorum=3)
    before = ledgers(cluster)
    held = sorted(i for i, m in before.items() if LOST in m.segments[0].ensemble)
    assert held, "no ledger has the node to lose: the test would prove nothing"
    urls = [cluster.url(node_id) for node_id in cluster.node_ids]
    # The DAG's order of the live nodes (sorted URLs): a marker's task asks live[id % 3] first.
    live = sorted((n for n in cluster.node_ids if n != LOST), key=cluster.url)
    killer = live[held[0] % len(live)]  # the first node the first marker's task asks
    cluster.restart(killer, {"NODE_CRASH_POINTS": json.dumps(["autorecovery.after_copy"])})
    registered_anew(cluster, killer)
    cluster.wipe(LOST)
    until(
        f"{LOST}'s registration gone with its lease",
        lambda: asyncio.run(_get(cluster.metadata_url, node_key(LOST))) is None,
    )

    first = run(airflow, cluster, urls, allow_failure=True, lost_node_recovery_delay_s=0)
    assert xcom(first, "live_nodes") == [[cluster.url(n) for n in live]]
    assert sorted(xcom(first, "audit")[0]) == held
    process = cluster.node(killer).proc
    assert process is not None and process.wait(timeout=10) == -signal.SIGKILL
    outcomes = {o["ledgerId"]: o for o in xcom(first, "rereplicate")}
    assert {o["outcome"] for o in outcomes.values()} <= {"done", "locked"}, outcomes
    killed = sorted(i for i, o in outcomes.items() if o["outcome"] == "locked")
    # A task whose node died under it moved on and found the dead worker's lock.
    assert killed and all(live[i % len(live)] == killer for i in killed), outcomes
    done = {i for i, o in outcomes.items() if o["outcome"] == "done"}
    marked = [i for i in held if i not in done]
    after_first = ledgers(cluster)
    for ledger_id in marked:
        assert after_first[ledger_id] == before[ledger_id], "an unfinished copy changed metadata"

    # The killed copies' orphans, on their replacements (the node outside the ensemble, the
    # killed node itself when it was that one), are reclaimed once the dead worker's locks
    # are gone, and forgotten by GC, so that the next copy may go there afresh.
    cluster.start(killer, {"NODE_CRASH_POINTS": "[]"})
    registered_anew(cluster, killer)
    replacements = {
        i: next(n for n in live if n not in before[i].segments[0].ensemble) for i in marked
    }
    expected = {n: sum(replacements[i] == n for i in killed) for n in live}

    def reclaimed() -> bool:
        for node_id, count in expected.items():
            state = summary(cluster, node_id)
            orphans = state["replication"]["gcOverreplicatedReclaimed"]
            if orphans < count or state["gc"]["deletedLedgers"] < orphans:
                return False
        return not any(holds(cluster, n, i) for i, n in replacements.items())

    until("the killed copies' orphans reclaimed and purged", reclaimed)

    second = run(airflow, cluster, urls, lost_node_recovery_delay_s=0)
    assert sorted(xcom(second, "audit")[0]) == marked
    assert {o["outcome"] for o in xcom(second, "rereplicate")} == {"done"}
    assert asyncio.run(_keys(cluster.metadata_url, "underreplicated")) == []
    totals = json.loads(asyncio.run(_get(cluster.metadata_url, "autorecovery/totals")) or b"")
    assert totals["fragments"] == len(held)  # one fragment each (one segment, E=Qw=3)
    assert totals["entries"] == len(held) * ENTRIES  # none counted twice
    assert totals["bytes"] == sum(len(p) for i in held for p in written[i])
    for ledger_id, payloads in written.items():
        meta = ledgers(cluster)[ledger_id]
        assert all(LOST not in s.ensemble for s in meta.segments), meta
        for entry_id, payload in enumerate(payloads):
            for node_id in meta.write_set(entry_id):
                assert replica_entry(cluster, node_id, ledger_id, entry_id) == payload


def holds(cluster: LocalCluster, node_id: str, ledger_id: int, entry_id: int = 0) -> bool:
    """Whether the node serves the entry of the ledger (entry 0: a copy starts there)."""
    try:
        replica_entry(cluster, node_id, ledger_id, entry_id)
    except urllib.error.HTTPError as error:
        assert error.code == 404, error
        return False
    return True


async def _keys(url: str, prefix: str) -> list[str]:
    store = EtcdStore(url)
    try:
        return [key for key, _v in await store.range(prefix)]
    finally:
        await store.close()


async def _get(url: str, key: str) -> bytes | None:
    store = EtcdStore(url)
    try:
        found = await store.get(key)
    finally:
        await store.close()
    return None if found is None else found.value


def test_every_run_finds_a_replica_left_short_and_fills_it(
    airflow: Airflow, make_cluster: MakeCluster
) -> None:
    """Default settings and params. The first run has never read the fleet's entries: it runs
    the replicas check. Then a replica is paused during a writer's adds and crashed once the
    writer closed its ledger at Qa: the next run (the ledger check, each replica's index asked)
    finds it short, marks it, and its rereplicate task copies onto it what it lacks."""
    cluster = make_cluster(nodes=3, env={"NODE_ADMIN_TOKEN": TOKEN})
    urls = [cluster.url(node_id) for node_id in cluster.node_ids]
    first = run(airflow, cluster, urls)
    assert xcom(first, "audit") == [[]]
    full = http(cluster, "n0", "GET", "/api/v1/autorecovery/status")["lastAudit"]
    assert full["lastReplicasCheckMs"] == full["finishedMs"] > 0

    async def write() -> tuple[int, str, list[bytes]]:
        async with Client(cluster.metadata_url, token=TOKEN) as client:
            return await short_replica(cluster, client)

    ledger_id, slow, data = asyncio.run(write())
    short = [e for e in range(len(data)) if not holds(cluster, slow, ledger_id, e)]
    assert short == list(range(BEFORE, len(data)))

    second = run(airflow, cluster, urls)
    assert xcom(second, "audit") == [[ledger_id]]
    [outcome] = xcom(second, "rereplicate")
    assert (outcome["outcome"], outcome["fragments"], outcome["entries"]) == (
        "done",
        1,
        len(data) - BEFORE,
    )
    checked = http(cluster, "n0", "GET", "/api/v1/autorecovery/status")["lastAudit"]
    assert checked["fragmentsChecked"] == 3 and checked["replicasChecked"] == 0
    assert checked["lastReplicasCheckMs"] == full["lastReplicasCheckMs"]  # daily, not now
    assert all(slow in s.ensemble for s in ledgers(cluster)[ledger_id].segments)
    for entry_id, payload in enumerate(data):
        assert replica_entry(cluster, slow, ledger_id, entry_id) == payload
