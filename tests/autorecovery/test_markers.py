"""The values autorecovery keeps in the metadata store: each round-trips, and a value of
another version or shape is refused, never guessed at."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable

import pytest

from node.autorecovery import markers
from node.autorecovery.markers import AuditReport, Lock, Marker, Reason, Totals
from node.client.metadata.etcd import EtcdStore
from node.client.metadata.memory import MemoryStore
from node.client.metadata.store import MetadataStore
from node.client.model import MetadataFormatError
from tests.harness.etcd import EtcdServer


def test_every_value_round_trips_with_version_1() -> None:
    marker = Marker(2**62 + 5, {"n1": Reason.LOST, "n0": Reason.REPLICAS}, 1234)
    assert Marker.decode(marker.encode()) == marker
    assert json.loads(marker.encode())["version"] == 1
    assert Lock.decode(Lock("w", 5).encode()) == Lock("w", 5)
    assert Totals.decode(Totals(1, 2, 3).encode()) == Totals(1, 2, 3)
    assert json.loads(Totals(1, 2, 3).encode()) == {
        "version": 1, "fragments": 1, "entries": 2, "bytes": 3,
    }  # fmt: skip
    assert markers.decode_since(markers.encode_since(77)) == 77
    report = AuditReport(9, 1, 2, ["n1"], ["n2"], 3, 4, 5, 6)
    assert AuditReport.decode(report.encode()) == report
    checked = AuditReport(9, 1, 2, [], [], 3, 0, 5, 6, [], 60, 7, 8)
    assert AuditReport.decode(checked.encode()) == checked
    # A report written before the ledger check has none of its fields.
    older = {k: v for k, v in json.loads(checked.encode()).items() if k not in _NEW_FIELDS}
    assert AuditReport.decode(json.dumps(older).encode()) == AuditReport(
        9, 1, 2, [], [], 3, 0, 5, 6
    )
    assert markers.marker_key(7) == "underreplicated/0000000000000000007"


_NEW_FIELDS = ("fragmentsChecked", "entriesMissing", "lastReplicasCheckMs")


def test_a_move_supersedes_a_fill_and_nothing_else_changes_a_reason() -> None:
    old = {"n0": Reason.MISSING, "n1": Reason.REPLICAS, "n2": Reason.MISSING}
    wanted = {"n0": Reason.LOST, "n1": Reason.MISSING, "n2": Reason.MISSING, "n3": Reason.MISSING}
    assert markers.merged(old, wanted) == {
        "n0": Reason.LOST,  # it moves now: the fill would copy onto a node that is gone
        "n1": Reason.REPLICAS,  # a move stays a move
        "n2": Reason.MISSING,
        "n3": Reason.MISSING,
    }
    assert markers.merged(old, {}) == old


@pytest.mark.parametrize(
    "raw",
    [
        b'{"version": 2, "ledgerId": 1, "nodes": {}, "createdMs": 0}',
        b'{"ledgerId": 1, "nodes": {}, "createdMs": 0}',
        b'{"version": 1, "ledgerId": 1, "nodes": {"n0": "gone"}, "createdMs": 0}',
        b'{"version": 1, "ledgerId": 1, "createdMs": 0}',
        b"[1]",
        b"not json",
    ],
)
def test_a_marker_of_another_version_or_shape_is_refused(raw: bytes) -> None:
    with pytest.raises(MetadataFormatError):
        Marker.decode(raw)


@pytest.mark.parametrize("kind", ["etcd", "memory"])
async def test_totals_add_up_under_concurrent_workers(etcd: EtcdServer, kind: str) -> None:
    """Twenty swaps at once, each of its own key and each counted in the totals in the same
    commit (on etcd they interleave: conflicts on the totals and retries); none is lost. A
    swap of a key already changed counts nothing. ``put`` creates, then replaces."""
    store: MetadataStore = (
        EtcdStore(etcd.url(f"t-{uuid.uuid4().hex[:12]}")) if kind == "etcd" else MemoryStore()
    )
    try:
        for n in range(20):
            await store.create(f"k/{n}", b"old")

        def swap(n: int) -> Awaitable[bytes | None]:
            return markers.swap_counted(
                store, f"k/{n}", lambda v: v == b"old", lambda _v: b"new", Totals(1, 10, 100)
            )

        assert await asyncio.gather(*(swap(n) for n in range(20))) == [b"new"] * 20
        assert await markers.read_totals(store) == Totals(20, 200, 2000)
        assert await swap(0) == b"new"  # already swapped: not counted again
        assert await markers.read_totals(store) == Totals(20, 200, 2000)
        await markers.put(store, markers.AUDITOR_KEY, b"a")
        await markers.put(store, markers.AUDITOR_KEY, b"b")
        found = await store.get(markers.AUDITOR_KEY)
        assert found is not None and found.value == b"b"
    finally:
        await store.close()


def test_the_shell_s_auditor_wants_once_and_a_number() -> None:
    """Usage errors exit 2 (an auditor loop is the DAG's schedule, not the shell's)."""
    from node.shell import main

    url = "etcd://127.0.0.1:1/x"
    for argv in (["auditor"], ["auditor", "--once", "--lost-node-delay", "soon"]):
        with pytest.raises(SystemExit) as exited:
            main(["--metadata-url", url, *argv])
        assert exited.value.code == 2


async def test_a_marker_of_a_deleted_ledger_is_dropped_by_the_worker_and_the_auditor() -> None:
    from node.autorecovery.auditor import audit
    from node.autorecovery.worker import GONE, rereplicate
    from node.client import Client

    store = MemoryStore()
    async with Client(store) as client:
        for ledger_id in (2**62 + 1, 2**62 + 2):
            marker = Marker(ledger_id, {"n0": Reason.LOST}, 0)
            await store.create(markers.marker_key(ledger_id), marker.encode())
        result = await rereplicate(
            client, 2**62 + 1, worker_id="w", open_ledger_grace_s=0, lock_ttl_s=5
        )
        assert result.outcome == GONE
        assert await store.get(markers.lock_key(2**62 + 1)) is None
        report = await audit(client, lost_node_delay_s=0)
        assert report.markers_removed == 1 and report.markers == []
        assert await markers.read_markers(store) == []


async def test_a_worker_whose_lease_ends_mid_copy_stops_before_its_cas() -> None:
    """In-memory nodes and store, the store's clock in the test's hands: the replacement's add
    is held, the lease's time passes, the keeper finds it expired: LockLost, the metadata
    untouched, and the add let through afterwards changes nothing of it either."""
    from node.autorecovery.worker import LockLost, rereplicate
    from node.client import Client
    from node.client.model import ledger_key
    from tests.client.fakes import FakeNode, FakeTransport, Network, register
    from tests.harness.cluster import until

    now = [0.0]
    store = MemoryStore(monotonic=lambda: now[0])
    await register(store, ["n0", "n1", "n2", "n3"])
    net = Network([FakeNode(n) for n in ("n0", "n1", "n2", "n3")])
    async with Client(store, transport=FakeTransport(net, "w")) as client:  # type: ignore[arg-type]
        ledger = await client.create_ledger(3, 3, 2)
        await ledger.add_batch([b"a", b"b", b"c"])
        meta = await ledger.close()
        lost = meta.segments[0].ensemble[0]
        (spare,) = {"n0", "n1", "n2", "n3"} - set(meta.segments[0].ensemble)
        net.nodes[lost].down = True
        await store.create(
            markers.marker_key(ledger.id), Marker(ledger.id, {lost: Reason.LOST}, 0).encode()
        )
        before = await store.get(ledger_key(ledger.id))
        gate = net.hold(lambda _c, node, kind, _d: node == spare and kind == "add")
        worker = asyncio.create_task(
            rereplicate(client, ledger.id, worker_id="w", open_ledger_grace_s=0, lock_ttl_s=1)
        )
        await until(lambda: gate.waiting > 0, "the replacement's add is held")
        now[0] += 5  # the lease's TTL is long past
        with pytest.raises(LockLost):
            await asyncio.wait_for(worker, timeout=5)
        gate.release()
        await asyncio.sleep(0.05)
        assert await store.get(ledger_key(ledger.id)) == before
        assert await markers.read_totals(store) == Totals()
        assert await store.get(markers.marker_key(ledger.id)) is not None
