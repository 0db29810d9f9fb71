"""Races of replicated streams, at the default settings: an owner that crashes and comes
straight back (its old key in etcd still names it, under a lease nobody keeps alive: it takes
the stream back at its first request, without waiting out that lease, and the stream goes on
after the last acknowledged append); one new stream created through every node at once."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from node.localcluster import LocalCluster
from node.settings import Settings
from tests.harness.cluster import MakeCluster, make_cluster

__all__ = ["make_cluster"]

TTL_S = Settings.model_fields["stream_owner_ttl_s"].default
STREAM = "restarted"


def http(url: str, method: str = "GET", body: bytes = b"", json_body: bool = False) -> Any:
    request = urllib.request.Request(
        url,
        data=body or None,
        method=method,
        headers={"Content-Type": "application/json" if json_body else "application/octet-stream"},
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        raw = reply.read()
    return json.loads(raw) if raw[:1] == b"{" else raw


def append(cluster: LocalCluster, node_id: str, payload: bytes) -> str:
    url = f"{cluster.url(node_id)}/api/v1/streams/{STREAM}/entries"
    return str(http(url, "POST", payload)["position"])


def test_a_restarted_owner_takes_its_stream_back_before_its_old_lease_ends(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(nodes=4)
    body = json.dumps({"replication": {"ensemble": 3, "writeQuorum": 3, "ackQuorum": 2}})
    created = http(
        f"{cluster.url('n0')}/api/v1/streams/{STREAM}", "PUT", body.encode(), json_body=True
    )
    assert created["owner"] == "n0"
    before = [append(cluster, "n0", f"before {n}".encode()) for n in range(5)]

    killed = time.monotonic()
    cluster.restart("n0")
    after = None
    while after is None:
        try:
            after = append(cluster, "n0", b"after the restart")
        except urllib.error.HTTPError as error:  # 503 while it recovers: retry
            assert error.code == 503, error.read()
            time.sleep(0.1)
    took = time.monotonic() - killed
    assert took < TTL_S, f"{took:.1f} s: it waited for its old lease ({TTL_S} s) to end"

    old_ledger = int(before[0].split(":")[0])
    new_ledger, entry = map(int, after.split(":"))
    assert new_ledger > old_ledger and entry == 0, (before, after)
    stream = http(f"{cluster.url('n2')}/api/v1/streams/{STREAM}")
    assert stream["owner"] == "n0"
    ledgers = {item["ledgerId"]: item for item in stream["ledgers"]}
    # The old ledger ends at its last acknowledged append: nothing lost, nothing added.
    assert ledgers[old_ledger]["entries"] == len(before) and ledgers[old_ledger]["closedTime"]


def test_a_stream_created_through_every_node_at_once_has_one_owner_and_one_record(
    make_cluster: MakeCluster,
) -> None:
    """Four PUTs of one new stream, one per node, at the same moment, then appends through
    every node at once: one 201 (the creator is the owner), three 200, and every append lands
    in one ledger at distinct, consecutive positions."""
    cluster = make_cluster(nodes=4)
    body = json.dumps({"replication": {"ensemble": 3, "writeQuorum": 3, "ackQuorum": 2}})
    url = "{}/api/v1/streams/" + STREAM

    def put(node_id: str) -> tuple[int, Any]:
        request = urllib.request.Request(
            url.format(cluster.url(node_id)),
            data=body.encode(),
            method="PUT",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())

    with ThreadPoolExecutor(len(cluster.node_ids)) as pool:
        answers = list(pool.map(put, cluster.node_ids))
        statuses = sorted(status for status, _ in answers)
        assert statuses == [200, 200, 200, 201], answers
        assert len({answer["owner"] for _, answer in answers}) == 1, answers
        positions = list(
            pool.map(
                lambda n: append(cluster, cluster.node_ids[n % 4], f"append {n}".encode()),
                range(40),
            )
        )
    ledger_ids = {p.split(":")[0] for p in positions}
    entries = sorted(int(p.split(":")[1]) for p in positions)
    assert len(ledger_ids) == 1 and entries == list(range(40)), positions
