"""Autorecovery on real processes (etcd and four nodes on loopback): a node lost with its data,
a worker killed mid-copy, a live node decommissioned under readers, a node back within the
delay, the replicas check, and two workers on one marker."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from node import autorecovery
from node.autorecovery import markers
from node.autorecovery.auditor import audit
from node.autorecovery.decommission import still_needed
from node.autorecovery.markers import Marker, Reason
from node.autorecovery.worker import DONE, GONE, LOCKED, WAITING, LockLost, rereplicate
from node.client import Client
from node.client.errors import ClientError
from node.client.metadata.store import Versioned
from node.client.model import (
    LedgerMetadata,
    LedgerState,
    Segment,
    decode,
    encode,
    ledger_key,
    node_key,
)
from node.http.app import build_app
from node.localcluster import LocalCluster
from node.settings import Settings
from tests.harness.cluster import MakeCluster, until
from tests.harness.ports import free_port
from tests.harness.settings import make_settings

REPO = Path(__file__).resolve().parents[2]
# A killed node's registration ends with its lease: short, so the tests do not wait 10 s.
FAST_ENV = {"NODE_REGISTRATION_TTL_S": "2"}
SHAPE = (3, 3, 2)
NOT_YET_S = 3600  # a lost-node delay no test waits out: the node is noted, not lost


def payloads(rng: random.Random, count: int) -> list[bytes]:
    return [rng.randbytes(rng.randint(1, 600)) for _ in range(count)]


async def write_ledger(client: Client, data: list[bytes], *, close: bool = True) -> int:
    ledger = await client.create_ledger(*SHAPE)
    for start in range(0, len(data), 10):
        await ledger.add_batch(data[start : start + 10])
    if close:
        await ledger.close()
    return ledger.id


async def metadata(client: Client, ledger_id: int) -> LedgerMetadata:
    found = await client.store.get(ledger_key(ledger_id))
    assert found is not None
    return decode(found.value)


# A writer process: writes ``count`` payloads of ``payloads(Random(seed), count)`` to a new
# ledger, prints its id once all are acknowledged, and waits to be killed.
WRITER = """
import asyncio, random, sys
from node.client import Client
from tests.autorecovery.test_autorecovery import payloads, write_ledger

async def main():
    async with Client(sys.argv[1]) as client:
        data = payloads(random.Random(int(sys.argv[2])), int(sys.argv[3]))
        print(await write_ledger(client, data, close=False), flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


async def killed_writer(cluster: LocalCluster, seed: int, count: int) -> tuple[int, list[bytes]]:
    """An OPEN ledger whose writer process was SIGKILLed after its last acknowledgement."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WRITER, cluster.metadata_url, str(seed), str(count),
        env=shell_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        assert line.strip().isdigit(), (line, await proc.communicate())
    finally:
        proc.kill()
        await proc.communicate()
    return int(line), payloads(random.Random(seed), count)


async def assert_fully_replicated(
    client: Client, written: dict[int, list[bytes]], gone: str | None = None
) -> None:
    """Every entry of every ledger is on each node of its write set, byte for byte (each
    replica read directly), no segment names ``gone``, and a reader sees everything."""
    for ledger_id, data in written.items():
        meta = await metadata(client, ledger_id)
        assert meta.closed, f"ledger {ledger_id} is {meta.state}"
        assert meta.last_entry_id >= len(data) - 1
        assert all(gone not in s.ensemble for s in meta.segments), meta.segments
        for entry_id, payload in enumerate(data):
            for node in meta.write_set(entry_id):
                stored = await client.transport.read_entry(node, ledger_id, entry_id, fence=False)
                assert stored == payload, f"ledger {ledger_id} entry {entry_id} on {node}"
        reader = await client.open_ledger(ledger_id)
        seen = [bytes(p) async for _e, p in reader.read(0, len(data) - 1)]
        assert seen == data


async def gone_from_registry(client: Client, node: str) -> None:
    deadline = time.monotonic() + 15
    while await client.store.get(node_key(node)) is not None:
        assert time.monotonic() < deadline, f"{node} still registered"
        await asyncio.sleep(0.1)


async def rereplicate_all(client: Client, ledger_ids: list[int], grace_s: float = 0) -> list[str]:
    outcomes = []
    for ledger_id in ledger_ids:
        result = await rereplicate(
            client, ledger_id, worker_id="test", open_ledger_grace_s=grace_s, lock_ttl_s=5
        )
        outcomes.append(result.outcome)
    return outcomes


async def test_a_lost_node_s_fragments_are_re_replicated_and_every_entry_is_on_qw_nodes(
    make_cluster: MakeCluster,
) -> None:
    """Three closed ledgers and one left OPEN by its SIGKILLed writer process; a node of the
    open ledger's ensemble is SIGKILLed and its data directory deleted. The first audit only
    notes it; once the lost-node delay has passed, markers name it; the workers copy, recover
    the open ledger and end with no marker; every replica then holds every entry of its write
    sets."""
    rng = random.Random(32)
    cluster = await asyncio.to_thread(make_cluster, 4, None, FAST_ENV)
    written: dict[int, list[bytes]] = {}
    async with Client(cluster.metadata_url, rng=random.Random(1)) as client:
        for _ in range(3):
            data = payloads(rng, 40)
            written[await write_ledger(client, data)] = data
        open_id, data = await killed_writer(cluster, seed=5, count=25)
        written[open_id] = data
        victim = (await metadata(client, open_id)).segments[0].ensemble[0]
        await asyncio.to_thread(cluster.wipe, victim)
        await gone_from_registry(client, victim)

        # Within the delay the node is only noted (by this audit, or by a node's fleet poll
        # before it: the first one writes the mark, and the delay counts from there).
        first = await audit(client, lost_node_delay_s=NOT_YET_S)
        assert first.lost_nodes == [] and first.markers == []
        assert await client.store.get(markers.lost_key(victim)) is not None
        await asyncio.sleep(1.1)
        report = await audit(client, lost_node_delay_s=1)
        assert report.lost_nodes == [victim]
        naming = [
            lid
            for lid in written
            if any(victim in s.ensemble for s in (await metadata(client, lid)).segments)
        ]
        assert sorted(report.markers) == sorted(naming) and open_id in naming
        assert report.under_replicated_ledgers == len(naming)
        for lid in report.markers:
            marker = Marker.decode((await client.store.get(markers.marker_key(lid))).value)  # type: ignore[union-attr]
            assert marker.nodes == {victim: Reason.LOST}

        # Within its grace the open ledger is left to its writer (here: told, not slept).
        waiting = await rereplicate(
            client, open_id, worker_id="w", open_ledger_grace_s=600, lock_ttl_s=5, wait=False
        )
        assert waiting.outcome == WAITING
        assert not (await metadata(client, open_id)).closed
        assert await client.store.get(markers.lock_key(open_id)) is None, "lock left behind"
        assert await rereplicate_all(client, report.markers) == [DONE] * len(naming)
        assert await markers.read_markers(client.store) == []
        after = await audit(client, lost_node_delay_s=1)
        assert after.markers == [] and after.under_replicated_ledgers == 0
        stored = await markers.read_report(client.store)
        assert stored is not None and stored.under_replicated_ledgers == 0
        totals = await markers.read_totals(client.store)
        assert totals.fragments >= len(naming)
        assert totals.size > 0 and totals.entries > 0
        await assert_fully_replicated(client, written, gone=victim)
        # A rerun finds nothing to do.
        assert await rereplicate_all(client, naming) == [GONE] * len(naming)
        assert await markers.read_totals(client.store) == totals


def shell_command(cluster: LocalCluster, *argv: str) -> list[str]:
    return [
        sys.executable, "-m", "node", "shell", "--json",
        "--metadata-url", cluster.metadata_url, *argv,
    ]  # fmt: skip


def shell_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


async def holds(client: Client, node: str, ledger_id: int) -> int:
    """The highest entry id ``node`` stores of the ledger (-1: none, or no such ledger)."""
    try:
        answer = await client.transport.read_lac(node, ledger_id, fence=False, replication=SHAPE)
    except ClientError:
        return -1
    return answer.last_entry_id


@dataclass
class LostFragment:
    ledger_id: int
    data: list[bytes]
    before: Versioned  # the ledger's metadata before any worker ran
    victim: str
    replacement: str  # the one node outside the ensemble: where the fragment must go


async def lose_a_fragment(
    cluster: LocalCluster, client: Client, seed: int, position: int
) -> LostFragment:
    """A closed ledger of 400 entries (a copy long enough to interrupt), the node at
    ``position`` of its ensemble wiped, unregistered, and marked by an audit."""
    rng = random.Random(seed)
    data = [rng.randbytes(rng.randint(50, 300)) for _ in range(400)]
    ledger_id = await write_ledger(client, data)
    before = await client.store.get(ledger_key(ledger_id))
    assert before is not None
    ensemble = decode(before.value).segments[0].ensemble
    victim = ensemble[position]
    (replacement,) = set(cluster.node_ids) - set(ensemble)
    await asyncio.to_thread(cluster.wipe, victim)
    await gone_from_registry(client, victim)
    assert (await audit(client, lost_node_delay_s=0)).markers == [ledger_id]
    return LostFragment(ledger_id, data, before, victim, replacement)


async def test_a_worker_killed_mid_copy_and_run_again_counts_each_fragment_once(
    make_cluster: MakeCluster,
) -> None:
    """``shell rereplicate`` is SIGKILLed once its replacement holds part of the fragment: the
    metadata is untouched and nothing is counted. Once its lock's lease ends, a second run
    copies it again (the same bytes again are accepted), CASes once and counts it once."""
    cluster = await asyncio.to_thread(make_cluster, 4, None, FAST_ENV)
    async with Client(cluster.metadata_url) as client:
        lost = await lose_a_fragment(cluster, client, 7, 1)
        ledger_id, data, before = lost.ledger_id, lost.data, lost.before
        victim, replacement = lost.victim, lost.replacement
        ensemble = decode(before.value).segments[0].ensemble

        proc = await asyncio.create_subprocess_exec(
            *shell_command(cluster, "rereplicate", str(ledger_id), "--lock-ttl", "2"),
            env=shell_env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 30
            while (copied := await holds(client, replacement, ledger_id)) < 0:
                assert proc.returncode is None, await proc.communicate()
                assert time.monotonic() < deadline, "the copy never started"
                await asyncio.sleep(0.01)
        finally:
            proc.kill()
            await proc.communicate()
        assert copied < len(data) - 1, "killed after the whole copy: not mid-copy"
        assert await client.store.get(ledger_key(ledger_id)) == before, "metadata changed"
        assert await markers.read_totals(client.store) == markers.Totals()
        assert await client.store.get(markers.marker_key(ledger_id)) is not None

        # The dead worker's lock lasts until its lease ends; meanwhile a run is refused.
        locked = await rereplicate(
            client, ledger_id, worker_id="second", open_ledger_grace_s=0, lock_ttl_s=5
        )
        assert locked.outcome == LOCKED
        deadline = time.monotonic() + 10
        while await client.store.get(markers.lock_key(ledger_id)) is not None:
            assert time.monotonic() < deadline, "the dead worker's lock outlived its lease"
            await asyncio.sleep(0.1)
        rerun = await asyncio.to_thread(
            subprocess.run,
            shell_command(cluster, "rereplicate", str(ledger_id)),
            env=shell_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert rerun.returncode == 0, rerun.stderr
        assert json.loads(rerun.stdout)["outcome"] == DONE
        assert await markers.read_markers(client.store) == []
        totals = await markers.read_totals(client.store)
        size = sum(len(p) for p in data)
        assert totals == markers.Totals(fragments=1, entries=len(data), size=size)
        meta = await metadata(client, ledger_id)
        assert meta.segments[0].ensemble == tuple(
            replacement if n == victim else n for n in ensemble
        )
        await assert_fully_replicated(client, {ledger_id: data}, gone=victim)


async def test_a_live_node_is_decommissioned_while_readers_read_and_no_read_fails(
    make_cluster: MakeCluster,
) -> None:
    """``shell decommission NODE --wait`` on a live node, readers reading all along: it exits 0
    once no ledger names the node, and not one read failed."""
    rng = random.Random(3)
    cluster = await asyncio.to_thread(make_cluster, 4)
    written: dict[int, list[bytes]] = {}
    async with Client(cluster.metadata_url) as client:
        for _ in range(3):
            data = payloads(rng, 60)
            written[await write_ledger(client, data)] = data
        counts = {n: len(await still_needed(client, n)) for n in cluster.node_ids}
        node = max(counts, key=lambda n: counts[n])
        reads, failures = 0, []
        stop = asyncio.Event()

        async def reader() -> None:
            nonlocal reads
            async with Client(cluster.metadata_url) as own:
                while not stop.is_set():
                    for ledger_id, data in written.items():
                        try:
                            handle = await own.open_ledger(ledger_id)
                            seen = [bytes(p) async for _e, p in handle.read(0, len(data) - 1)]
                            assert seen == data
                            reads += 1
                        except Exception as error:  # every failure is the test's finding
                            failures.append(repr(error))

        task = asyncio.create_task(reader())
        await until(lambda: reads >= 3, "the readers read")
        done = await asyncio.to_thread(
            subprocess.run,
            shell_command(cluster, "decommission", node, "--wait", "--grace", "0"),
            env=shell_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        before_stop = reads
        await until(lambda: reads >= before_stop + 3, "reads after the decommission")
        stop.set()
        await task
        assert done.returncode == 0, done.stderr + done.stdout
        assert json.loads(done.stdout) == {"node": node, "stillNeeded": []}
        assert failures == []
        assert await still_needed(client, node) == []
        assert await client.store.get(markers.decommissioning_key(node)) is not None
        assert await markers.read_markers(client.store) == []
        await assert_fully_replicated(client, written, gone=node)
        # Placement skips it from now on: a new ledger takes the three others.
        for _ in range(5):  # by chance each would name it 3 times in 4
            fresh = await client.create_ledger(*SHAPE)
            assert node not in fresh.metadata.last_segment.ensemble
            await fresh.close()


async def test_a_node_back_before_the_delay_triggers_nothing(make_cluster: MakeCluster) -> None:
    """Killed, unregistered, audited at the default delay and at a short one not yet over,
    restarted: no marker, and its lost mark is gone once it is back. Killed again and marked,
    then back before any worker ran: the next audit removes the marker."""
    assert Settings().lost_node_recovery_delay_s == autorecovery.DEFAULT_LOST_NODE_DELAY_S
    assert Settings().open_ledger_rereplication_grace_s == autorecovery.DEFAULT_OPEN_LEDGER_GRACE_S
    assert Settings().autorecovery_lock_ttl_s == autorecovery.DEFAULT_LOCK_TTL_S
    cluster = await asyncio.to_thread(make_cluster, 4, None, FAST_ENV)
    async with Client(cluster.metadata_url) as client:
        ledger_id = await write_ledger(client, payloads(random.Random(5), 20))
        node = (await metadata(client, ledger_id)).segments[0].ensemble[0]
        await asyncio.to_thread(cluster.kill, node)
        await gone_from_registry(client, node)
        default = await audit(client, lost_node_delay_s=Settings().lost_node_recovery_delay_s)
        assert default.markers == [] and default.lost_nodes == []
        short = await audit(client, lost_node_delay_s=30)
        assert short.markers == [] and short.lost_nodes == []
        assert await client.store.get(markers.lost_key(node)) is not None
        await asyncio.to_thread(cluster.start, node)
        back = await audit(client, lost_node_delay_s=0)
        assert back.markers == [] and back.lost_nodes == []
        assert await client.store.get(markers.lost_key(node)) is None
        assert await markers.read_markers(client.store) == []
        # Marked once its delay passed, then back before a worker ran: the marker goes.
        await asyncio.to_thread(cluster.kill, node)
        await gone_from_registry(client, node)
        marked = await audit(client, lost_node_delay_s=0)
        assert marked.markers == [ledger_id] and marked.lost_nodes == [node]
        await asyncio.to_thread(cluster.start, node)
        pruned = await audit(client, lost_node_delay_s=0)
        assert pruned.markers == [] and pruned.markers_removed == 1


async def test_the_replicas_check_finds_a_flipped_byte_and_a_missing_entry_only(
    make_cluster: MakeCluster,
) -> None:
    """Two test ledgers put on n0, n1, n2 through the replica API: one where n2 holds other
    bytes at entry 1, one where n1 lacks entry 2. The replicas check marks exactly those
    nodes (and nothing on clean data): n2 to move ("replicas"), n1 to fill ("missing"); the
    workers move n2's fragment to n3 and copy entry 2 onto n1; the check is then clean.
    Two workers race on one marker: one copies, the other is refused."""
    rng = random.Random(11)
    cluster = await asyncio.to_thread(make_cluster, 4)
    async with Client(cluster.metadata_url) as client:
        clean = {await write_ledger(client, data := payloads(rng, 30)): data}
        assert (await audit(client, lost_node_delay_s=600, check_replicas=True)).markers == []

        async def planted(skip: dict[str, int], flip: dict[str, int]) -> tuple[int, list[bytes]]:
            ledger_id = await client.store.next_id()
            data = payloads(rng, 4)
            for node in ("n0", "n1", "n2"):
                for entry_id, payload in enumerate(data):
                    if skip.get(node) == entry_id:
                        continue
                    if flip.get(node) == entry_id:
                        payload = bytes([payload[0] ^ 0x01]) + payload[1:]
                    await client.transport.add(
                        node, ledger_id, [(entry_id, payload)], lac=-1, lac_length=0,
                        replication=SHAPE,
                    )  # fmt: skip
            meta = LedgerMetadata(
                ledger_id=ledger_id,
                ensemble_size=3,
                write_quorum=3,
                ack_quorum=2,
                segments=(Segment(0, ("n0", "n1", "n2")),),
                state=LedgerState.CLOSED,
                last_entry_id=len(data) - 1,
                length=sum(len(p) for p in data),
            )
            await client.store.create(ledger_key(ledger_id), encode(meta))
            return ledger_id, data

        flipped, flipped_data = await planted({}, {"n2": 1})
        missing, missing_data = await planted({"n1": 2}, {})
        report = await audit(client, lost_node_delay_s=600, check_replicas=True)
        assert sorted(report.markers) == sorted([flipped, missing])
        assert report.replicas_checked == 30 + 4 + 4
        found = {m.ledger_id: m.nodes for m, _v in await markers.read_markers(client.store)}
        assert found == {flipped: {"n2": Reason.REPLICAS}, missing: {"n1": Reason.MISSING}}
        listed = await asyncio.to_thread(
            subprocess.run,
            shell_command(cluster, "underreplicated"),
            env=shell_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listed.returncode == 0, listed.stderr
        assert [
            (m["ledgerId"], m["nodes"], m["lockedBy"]) for m in json.loads(listed.stdout)["markers"]
        ] == sorted([(flipped, {"n2": "replicas"}, None), (missing, {"n1": "missing"}, None)])

        # Two workers at once on one marker: one copies, the other is told it is locked.
        racing = await asyncio.gather(
            *(
                rereplicate(client, flipped, worker_id=w, open_ledger_grace_s=0, lock_ttl_s=5)
                for w in ("a", "b")
            )
        )
        assert sorted(r.outcome for r in racing) == [DONE, LOCKED]
        assert sum(r.fragments for r in racing) == 1
        assert await rereplicate_all(client, [missing]) == [DONE]
        after = await asyncio.to_thread(
            subprocess.run,
            shell_command(cluster, "auditor", "--once", "--check-replicas"),
            env=shell_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert after.returncode == 0, after.stderr
        assert json.loads(after.stdout)["markers"] == []
        assert json.loads(after.stdout)["replicasChecked"] == 38
        totals = await markers.read_totals(client.store)
        assert (totals.fragments, totals.entries) == (2, 4 + 1)  # a move of 4, a fill of 1
        assert "n1" in (await metadata(client, missing)).segments[0].ensemble  # filled in place
        await assert_fully_replicated(
            client, {**clean, flipped: flipped_data, missing: missing_data}
        )


async def test_the_admin_routes_audit_rereplicate_decommission_and_report(
    make_cluster: MakeCluster,
) -> None:
    """The DAG's view: a node's routes refuse another fleet's store (another prefix, or other
    endpoints whose cluster differs) and act on their own one (the same cluster under another
    endpoint spelling is the same store). The fleet has an admin token: the routes need it, and
    the node's own copies (replica adds) send it."""
    token = "autorecovery-secret"
    cluster = await asyncio.to_thread(
        make_cluster, 4, None, {**FAST_ENV, "NODE_ADMIN_TOKEN": token}
    )
    url = cluster.metadata_url
    port = cluster.etcd.client_port
    auth = {"Authorization": f"Bearer {token}"}
    async with (
        Client(url, token=token) as client,
        aiohttp.ClientSession(headers=auth) as http,
    ):
        ledger_id = await write_ledger(client, payloads(random.Random(9), 30))
        ensemble = (await metadata(client, ledger_id)).segments[0].ensemble
        leaving = ensemble[0]
        caller = next(n for n in cluster.node_ids if n != leaving)
        base = f"{cluster.url(caller)}/api/v1/autorecovery"

        async def post(route: str, body: object) -> tuple[int, Any]:
            async with http.post(f"{base}/{route}", json=body) as resp:
                return resp.status, await resp.json()

        status, answer = await post("audit", {"metadataUrl": url.rsplit("/", 1)[0] + "/other"})
        assert (status, answer["code"]) == (409, "metadata_mismatch")
        elsewhere = f"etcd://127.0.0.1:{free_port()}/{cluster.prefix}"
        status, answer = await post("audit", {"metadataUrl": elsewhere})
        assert (status, answer["code"]) == (409, "metadata_mismatch")
        status, answer = await post("audit", {"metadataUrl": url, "checkReplicas": "yes"})
        assert (status, answer["code"]) == (400, "invalid_body")

        spelled = f"etcd://localhost:{port}/{cluster.prefix}"  # the same cluster
        status, answer = await post("audit", {"metadataUrl": spelled, "checkReplicas": True})
        assert status == 200 and answer["markers"] == [] and answer["replicasChecked"] == 30
        status, answer = await post("decommission", {"metadataUrl": url, "nodeId": leaving})
        assert (status, answer) == (200, {"nodeId": leaving, "stillNeeded": [ledger_id]})
        status, answer = await post("audit", {"metadataUrl": url})
        assert status == 200 and answer["markers"] == [ledger_id]
        assert answer["decommissioningNodes"] == [leaving]
        status, answer = await post("rereplicate", {"metadataUrl": url, "ledgerId": ledger_id})
        assert status == 200, answer
        assert answer["outcome"] == DONE and answer["fragments"] == 1
        assert answer["entries"] == 30 and answer["bytes"] > 0
        async with http.get(f"{base}/status") as resp:
            assert resp.status == 200
            state = await resp.json()
        assert state["markers"] == 0 and state["totals"]["fragments"] == 1
        assert state["lastAudit"]["underReplicatedLedgers"] == 1  # as the last audit saw it
        status, answer = await post(
            "audit", {"metadataUrl": url, "lostNodeRecoveryDelaySeconds": 0}
        )
        assert status == 200 and answer["markers"] == []
        async with http.get(f"{base}/status") as resp:
            assert (await resp.json())["lastAudit"]["underReplicatedLedgers"] == 0
        assert await still_needed(client, leaving) == []


async def test_a_node_without_a_metadata_store_answers_replication_off(
    client: Any, aiohttp_client: Any, tmp_path: Path
) -> None:
    guarded = await aiohttp_client(build_app(make_settings(tmp_path / "t", admin_token="s3")))
    resp = await guarded.post("/api/v1/autorecovery/audit", json={"metadataUrl": "etcd://h:1/x"})
    assert resp.status == 401, "the routes are admin routes"
    for route, body in [
        ("audit", {"metadataUrl": "etcd://127.0.0.1:2379/x"}),
        ("rereplicate", {"metadataUrl": "etcd://127.0.0.1:2379/x", "ledgerId": 1}),
        ("decommission", {"metadataUrl": "etcd://127.0.0.1:2379/x", "nodeId": "n0"}),
    ]:
        resp = await client.post(f"/api/v1/autorecovery/{route}", json=body)
        assert resp.status == 404 and (await resp.json())["code"] == "replication_off"
    resp = await client.get("/api/v1/autorecovery/status")
    assert resp.status == 404 and (await resp.json())["code"] == "replication_off"


async def test_a_worker_whose_lock_is_gone_stops_without_changing_the_metadata(
    make_cluster: MakeCluster,
) -> None:
    """The lock's key deleted mid-copy (as a lease that ends deletes it): the worker raises
    LockLost within a third of its TTL, the metadata and the totals are untouched, and the
    marker is still there for the next worker, which finishes it."""
    cluster = await asyncio.to_thread(make_cluster, 4, None, FAST_ENV)
    async with Client(cluster.metadata_url) as client:
        lost = await lose_a_fragment(cluster, client, 21, 2)
        ledger_id, data, before, replacement = (
            lost.ledger_id, lost.data, lost.before, lost.replacement,
        )  # fmt: skip
        worker = asyncio.create_task(
            rereplicate(client, ledger_id, worker_id="w", open_ledger_grace_s=0, lock_ttl_s=3)
        )
        deadline = time.monotonic() + 30
        while await holds(client, replacement, ledger_id) < 0:
            assert not worker.done(), worker.result()
            assert time.monotonic() < deadline, "the copy never started"
            await asyncio.sleep(0.01)
        lock = await client.store.get(markers.lock_key(ledger_id))
        assert lock is not None
        await client.store.delete(markers.lock_key(ledger_id), lock.revision)
        with pytest.raises(LockLost):
            await asyncio.wait_for(worker, timeout=5)
        assert await client.store.get(ledger_key(ledger_id)) == before
        assert await markers.read_totals(client.store) == markers.Totals()
        assert await client.store.get(markers.marker_key(ledger_id)) is not None
        assert await rereplicate_all(client, [ledger_id]) == [DONE]
        await assert_fully_replicated(client, {ledger_id: data}, gone=lost.victim)
