"""Registration: ``nodes/<id>`` with a real etcd and real node processes. It appears at start
with what clients need, vanishes within the lease after a SIGKILL (at once after SIGTERM),
comes back by itself when etcd loses it, and follows the node's read-only state."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

from node.client.metadata.etcd import EtcdStore
from node.client.model import NodeInfo, NodeState, node_key
from node.replication import cookie
from node.settings import Settings
from tests.harness.etcd import EtcdServer
from tests.harness.node import NodeProcess
from tests.replication._identity import (
    fresh_prefix,
    registration,
    replicated_node,
)

POLL_S = 0.1
SHORT_TTL = "2"  # lease of the tests that wait for one to run out


def _info(etcd: EtcdServer, prefix: str, node_id: str) -> NodeInfo | None:
    value = registration(etcd, prefix, node_id)
    return None if value is None else NodeInfo.decode(value)


def _wait(check: object, timeout_s: float, what: str) -> float:
    """Seconds until ``check()`` is true; fails after ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if check():  # type: ignore[operator]
            return time.monotonic() - start
        time.sleep(POLL_S)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def _status(node: NodeProcess) -> dict[str, object]:
    replication = node.get_json("/api/v1/status/summary")["replication"]
    assert isinstance(replication, dict)
    return replication


def _metric(node: NodeProcess, name: str) -> float | None:
    text = node.get_bytes("/metrics").decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_registered_at_start_with_its_url_and_instance(tmp_path: Path, etcd: EtcdServer) -> None:
    prefix = fresh_prefix()
    node = replicated_node(tmp_path / "n1", etcd, prefix, "n1", NODE_ZONE="zone-a")
    node.start()
    _wait(lambda: _info(etcd, prefix, "n1") is not None, 5, "nodes/n1 after start")
    info = _info(etcd, prefix, "n1")
    local = cookie.read_local(node.data_dir)
    assert info is not None and local is not None
    assert info.url == node.url  # the port it listens on
    assert info.zone == "zone-a" and info.state == NodeState.WRITABLE
    assert info.instance_id == local.instance_id and info.started_ms > 0
    # The registered URL answers, as that node.
    with urllib.request.urlopen(f"{info.url}/api/v1/status/summary", timeout=5) as r:
        assert r.status == 200
    status = _status(node)
    assert status["enabled"] is True and status["registered"] is True
    assert status["instanceId"] == local.instance_id and status["clusterId"] == local.cluster_id
    assert status["zone"] == "zone-a" and status["lastRegistrationError"] is None
    assert _metric(node, "storage_node_registration_up") == 1.0


def test_advertised_url_is_registered_as_given(tmp_path: Path, etcd: EtcdServer) -> None:
    prefix = fresh_prefix()
    advertised = "http://n1.nodes.storage.svc.cluster.local:8080"
    node = replicated_node(tmp_path / "n1", etcd, prefix, "n1", NODE_ADVERTISED_URL=advertised)
    node.start()
    _wait(lambda: _info(etcd, prefix, "n1") is not None, 5, "nodes/n1 after start")
    assert _info(etcd, prefix, "n1").url == advertised  # type: ignore[union-attr]


def test_gone_within_the_lease_after_sigkill_at_once_after_sigterm(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    """At the default lease (10 s): a killed node leaves nodes/ when its lease runs out,
    never before a TTL has passed since its last keepalive (TTL/3 ago at most)."""
    prefix = fresh_prefix()
    ttl = Settings.model_fields["registration_ttl_s"].default
    node = replicated_node(tmp_path / "n1", etcd, prefix, "n1")
    node.start()
    _wait(lambda: _info(etcd, prefix, "n1") is not None, 5, "nodes/n1 after start")
    node.kill()
    killed = time.monotonic()
    _wait(lambda: _info(etcd, prefix, "n1") is None, ttl + 2, "nodes/n1 gone after SIGKILL")
    gone_after = time.monotonic() - killed
    assert gone_after > ttl * (1 - 1 / 3) - 1, gone_after  # the lease, not something sooner

    node.start()
    _wait(lambda: _info(etcd, prefix, "n1") is not None, 5, "nodes/n1 after restart")
    assert node.terminate() == 0
    assert _info(etcd, prefix, "n1") is None  # revoked on the way out


def test_registers_again_when_the_store_loses_the_lease(
    tmp_path: Path, own_etcd: EtcdServer
) -> None:
    prefix = fresh_prefix()
    node = replicated_node(
        tmp_path / "n1", own_etcd, prefix, "n1", NODE_REGISTRATION_TTL_S=SHORT_TTL
    )
    node.start()
    _wait(lambda: _info(own_etcd, prefix, "n1") is not None, 5, "nodes/n1 after start")

    async def revoke() -> None:  # what an etcd restored from an older snapshot does
        store = EtcdStore(own_etcd.url(prefix))
        try:
            answer = await store._call(
                "/v3/kv/range", {"key": _b64(store._key(node_key("n1")))}, change=False
            )
            lease = int(answer["kvs"][0]["lease"])
            await store.revoke(lease)
        finally:
            await store.close()

    asyncio.run(revoke())
    assert _info(own_etcd, prefix, "n1") is None
    _wait(lambda: _info(own_etcd, prefix, "n1") is not None, 5, "nodes/n1 registered again")
    _wait(lambda: _status(node)["registered"] is True, 5, "status: registered again")
    assert (_metric(node, "storage_node_registrations_total") or 0) >= 2

    # etcd down longer than the lease: the node says so, and is back once etcd is.
    own_etcd.kill()
    _wait(lambda: _status(node)["registered"] is False, 10, "status: not registered")
    assert _status(node)["lastRegistrationError"]
    assert _metric(node, "storage_node_registration_up") == 0.0
    own_etcd.start()
    _wait(lambda: _info(own_etcd, prefix, "n1") is not None, 15, "nodes/n1 after etcd restart")
    _wait(lambda: _status(node)["registered"] is True, 5, "status: registered after restart")
    assert _metric(node, "storage_node_registration_up") == 1.0
    assert node.alive()


def test_read_only_changes_the_registered_state(tmp_path: Path, etcd: EtcdServer) -> None:
    prefix = fresh_prefix()
    node = replicated_node(tmp_path / "n1", etcd, prefix, "n1")
    node.start()
    _wait(lambda: _info(etcd, prefix, "n1") is not None, 5, "nodes/n1 after start")

    def set_read_only(on: bool) -> None:
        request = urllib.request.Request(
            f"{node.url}/api/v1/bookie/state/readonly",
            data=f'{{"readOnly": {str(on).lower()}}}'.encode(),
            method="PUT",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5):
            pass

    def state() -> NodeState | None:
        info = _info(etcd, prefix, "n1")
        return None if info is None else info.state

    set_read_only(True)
    _wait(lambda: state() == NodeState.READONLY, 3, "nodes/n1 read-only")
    set_read_only(False)
    _wait(lambda: state() == NodeState.WRITABLE, 3, "nodes/n1 writable again")


def _b64(raw: bytes) -> str:
    import base64

    return base64.b64encode(raw).decode()
