"""A replica is reclaimed only once the metadata store (read linearizably, and the right
cluster) says its ledger is gone: by the sweep after the grace, or by an HTTP delete. With
etcd stopped, or the store of another cluster, nothing is deleted. Real etcd, real nodes."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from node.client.errors import MetadataError
from node.client.metadata.etcd import EtcdStore
from node.client.metadata.store import LEDGER_ID_BASE
from node.client.model import CLUSTER_KEY, ledger_key
from node.client.protocol import (
    ENTRY_ID_HEADER,
    LAC_HEADER,
    OCTET_CONTENT_TYPE,
    REPLICATED_HEADER,
)
from node.replication import cookie
from node.replication.reconcile import StoreGuard, Sweep
from node.settings import Settings
from node.storage import journalformat
from node.storage.ledgers import LedgerStorage
from tests.harness.etcd import EtcdServer
from tests.harness.node import NodeProcess
from tests.replication._identity import fresh_prefix, refused, replicated_node

POLL_S = 0.2
SHORT = {"NODE_REPLICATION_GC_INTERVAL_S": "1", "NODE_REPLICATION_GC_GRACE_S": "2"}
KEPT = LEDGER_ID_BASE + 1  # in the store all along
GONE = LEDGER_ID_BASE + 2  # never in the store (or deleted from it)


def _replica_add(node: NodeProcess, ledger_id: int, payload: bytes = b"entry 0") -> None:
    request = urllib.request.Request(
        f"{node.url}/api/v1/ledgers/{ledger_id}/entries",
        data=payload,
        method="POST",
        headers={
            "Content-Type": OCTET_CONTENT_TYPE,
            REPLICATED_HEADER: "1/1/1",
            ENTRY_ID_HEADER: "0",
            LAC_HEADER: "-1",
        },
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.status == 201


def _held(node: NodeProcess, ledger_id: int) -> bool:
    try:
        node.get_bytes(f"/api/v1/ledgers/{ledger_id}/entries/0")
    except urllib.error.HTTPError as e:
        assert e.code == 404, e.code
        return False
    return True


def _delete(node: NodeProcess, ledger_id: int) -> tuple[int, str]:
    request = urllib.request.Request(f"{node.url}/api/v1/ledgers/{ledger_id}", method="DELETE")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, ""
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["code"]


def _put_ledger(etcd: EtcdServer, prefix: str, ledger_id: int) -> None:
    async def put() -> None:
        store = EtcdStore(etcd.url(prefix))
        try:
            await store.create(ledger_key(ledger_id), b'{"placeholder": true}')
        finally:
            await store.close()

    asyncio.run(put())


def _drop_ledger(etcd: EtcdServer, prefix: str, ledger_id: int) -> None:
    async def drop() -> None:
        store = EtcdStore(etcd.url(prefix))
        try:
            found = await store.get(ledger_key(ledger_id))
            assert found is not None
            await store.delete(ledger_key(ledger_id), found.revision)
        finally:
            await store.close()

    asyncio.run(drop())


def _node_with_replica(
    tmp_path: Path, etcd: EtcdServer, prefix: str, ledger_id: int, **env: str
) -> NodeProcess:
    """A node of ``prefix`` holding a replica of ``ledger_id``, which the store also holds."""
    node = replicated_node(tmp_path / "n1", etcd, prefix, "n1", **env)
    node.start()
    _put_ledger(etcd, prefix, ledger_id)
    _replica_add(node, ledger_id)
    return node


def _replication(node: NodeProcess) -> dict[str, int]:
    found = node.get_json("/api/v1/status/summary")["replication"]
    assert isinstance(found, dict)
    return found


def test_sweep_reclaims_a_replica_after_the_grace_once_the_store_dropped_it(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    prefix = fresh_prefix()
    node = _node_with_replica(tmp_path, etcd, prefix, KEPT, **SHORT)
    _put_ledger(etcd, prefix, GONE)
    _replica_add(node, GONE)
    created = time.monotonic()
    _drop_ledger(etcd, prefix, GONE)  # a client deleted the ledger

    while _held(node, GONE):
        assert time.monotonic() - created < 15, "replica of a deleted ledger never reclaimed"
        time.sleep(POLL_S)
    assert time.monotonic() - created >= 2 - POLL_S, "reclaimed before the grace"
    assert _held(node, KEPT)
    status = _replication(node)
    assert status["gcReclaimed"] == 1 and status["replicatedLedgers"] == 1
    # Reclaimed by the journaled delete: still gone after a crash and a replay.
    node.kill()
    node.start()
    assert not _held(node, GONE) and _held(node, KEPT)


def test_http_delete_of_a_replica_asks_the_store(tmp_path: Path, etcd: EtcdServer) -> None:
    prefix = fresh_prefix()
    node = _node_with_replica(tmp_path, etcd, prefix, KEPT)
    assert _delete(node, KEPT) == (409, "replicated_ledger")
    assert _held(node, KEPT)
    _drop_ledger(etcd, prefix, KEPT)
    assert _delete(node, KEPT) == (204, "")
    assert not _held(node, KEPT)


def test_etcd_stopped_nothing_is_deleted(tmp_path: Path, own_etcd: EtcdServer) -> None:
    prefix = fresh_prefix()
    node = replicated_node(
        tmp_path / "n1", own_etcd, prefix, "n1", NODE_METADATA_TIMEOUT_S="1", **SHORT
    )
    node.start()
    _replica_add(node, GONE)  # never in the store: the sweep would reclaim it if it could ask
    _replica_add(node, KEPT)
    own_etcd.kill()
    deadline = time.monotonic() + 20
    while _replication(node)["gcSkipped"] < 4:
        assert time.monotonic() < deadline, _replication(node)
        time.sleep(POLL_S)
    assert _held(node, GONE) and _held(node, KEPT)
    assert _delete(node, GONE) == (503, "metadata_unavailable")
    assert _held(node, GONE)
    metrics = node.get_bytes("/metrics").decode()
    assert "storage_node_replication_gc_skipped_total" in metrics
    assert "storage_node_replication_gc_reclaimed_total 0.0" in metrics


def test_a_node_pointed_at_an_empty_prefix_refuses_and_deletes_nothing(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    prefix = fresh_prefix()
    node = _node_with_replica(tmp_path, etcd, prefix, KEPT, **SHORT)
    node.kill()

    wrong = replicated_node(node.data_dir, etcd, fresh_prefix(), "n1", **SHORT)
    log = refused(wrong)
    assert "no cluster" in log
    node.start()
    time.sleep(3)  # past the grace, and sweeps of the right store
    assert _held(node, KEPT)


async def test_guard_answers_from_the_store_of_its_own_cluster_only(etcd: EtcdServer) -> None:
    store = EtcdStore(etcd.url(fresh_prefix()))
    cluster = {"value": "c-1"}
    guard = StoreGuard(store, lambda: cluster["value"], timeout_s=5)
    try:
        # No cluster key at all (an empty prefix): it cannot say.
        with pytest.raises(MetadataError, match="absent"):
            await guard.confirm_deleted(KEPT)
        await store.create(CLUSTER_KEY, json.dumps({"clusterId": "c-1"}).encode())
        assert await guard.confirm_deleted(KEPT) is True
        await store.create(ledger_key(KEPT), b"{}")
        assert await guard.confirm_deleted(KEPT) is False
        cluster["value"] = "c-2"  # another cluster's store
        with pytest.raises(MetadataError, match="c-1"):
            await guard.confirm_deleted(GONE)
        assert guard.errors == 2
    finally:
        await store.close()


async def test_sweep_at_default_grace_keeps_a_young_replica(
    storage: LedgerStorage, etcd: EtcdServer
) -> None:
    """The defaults (interval and grace of 600 s): a replica whose ledger is not in the store
    is kept while it is younger than the grace, and reclaimed once it is older."""
    store = EtcdStore(etcd.url(fresh_prefix()))
    try:
        await store.create(CLUSTER_KEY, json.dumps({"clusterId": "c-1"}).encode())
        guard = StoreGuard(store, lambda: "c-1", timeout_s=5)
        await storage.fence_replica(GONE, (1, 1, 1))
        [(ledger_id, created_ms)] = storage.replicated_ledgers()
        grace_s = Settings.model_fields["replication_gc_grace_s"].default
        now = {"ms": created_ms}
        sweep = Sweep(
            storage,
            guard,
            Settings.model_fields["replication_gc_interval_s"].default,
            grace_s,
            lambda: now["ms"],
        )
        now["ms"] = created_ms + grace_s * 1000 - 1
        assert await sweep.sweep() == 0
        assert storage.replicated_ledgers() == [(ledger_id, created_ms)]
        now["ms"] = created_ms + grace_s * 1000
        assert await sweep.sweep() == 1
        assert storage.replicated_ledgers() == []
    finally:
        await store.close()


def test_without_a_cookie_module_import_the_journal_still_writes_zeros(tmp_path: Path) -> None:
    assert cookie.instance_id_bytes(tmp_path) == journalformat.NO_INSTANCE
