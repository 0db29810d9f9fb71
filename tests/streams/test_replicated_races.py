"""Races of replicated streams, at the default settings: an owner that crashes and comes
straight back (its old key in etcd still names it, under a lease nobody keeps alive: it takes
the stream back at its first request, without waiting out that lease, and the stream goes on
after the last acknowledged append); one new stream created through every node at once; an
owner killed in the middle of a rollover."""

from __future__ import annotations

import base64
import contextlib
import json
import struct
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

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


def test_an_owner_killed_between_a_rollovers_record_and_its_close_loses_nothing(
    make_cluster: MakeCluster,
) -> None:
    """A rollover writes the record naming the new ledger, then closes the old one in the
    metadata store. The owner SIGKILLed between the two leaves the old ledger OPEN there:
    the takeover must recover it too, or readers stop at its LAC, before the last
    acknowledged appends."""
    cluster = make_cluster(nodes=4)
    cluster.restart("n0", {"NODE_CRASH_POINTS": json.dumps(["stream.rollover.after_record"])})
    body = {
        "replication": {"ensemble": 3, "writeQuorum": 3, "ackQuorum": 2},
        "maxEntriesPerLedger": 5,
        "minLedgerRolloverTimeMinutes": 0,
    }
    url = f"{cluster.url('n0')}/api/v1/streams/{STREAM}"
    assert http(url, "PUT", json.dumps(body).encode(), json_body=True)["owner"] == "n0"
    acknowledged = [append(cluster, "n0", f"entry {n}".encode()) for n in range(5)]
    first_ledger = acknowledged[0].split(":")[0]
    assert {p.split(":")[0] for p in acknowledged} == {first_ledger}
    with contextlib.suppress(urllib.error.URLError, ConnectionError):  # it dies answering
        append(cluster, "n0", b"the append that rolls over")
    deadline = time.monotonic() + 10
    while cluster.node("n0").alive():  # its SIGKILL closed the connection; the exit follows
        assert time.monotonic() < deadline, "the crash point did not fire"
        time.sleep(0.05)

    # Back without the crash point: it takes its stream back at its first request.
    cluster.start("n0", {"NODE_CRASH_POINTS": "[]"})
    read = http(f"{cluster.url('n2')}/api/v1/streams/{STREAM}/entries?limit=100")
    frames, at = [], 0
    while at < len(read):
        ledger_id, entry_id, size = struct.unpack_from(">QQI", read, at)
        frames.append((f"{ledger_id}:{entry_id}", read[at + 20 : at + 20 + size]))
        at += 20 + size
    expected = [(p, f"entry {n}".encode()) for n, p in enumerate(acknowledged)]
    # Every acknowledged append, where it was acknowledged; the one whose answer was lost
    # may follow (its outcome is unknown), nothing else.
    assert frames[: len(expected)] == expected, frames
    assert [payload for _, payload in frames[len(expected) :]] in (
        [],
        [b"the append that rolls over"],
    ), frames


def test_a_name_no_stream_can_have_is_answered_without_touching_the_store(
    make_cluster: MakeCluster,
) -> None:
    """A hostile client asking for names that cannot be streams: the node answers at once
    (404, or 400 for a PUT), and the metadata store gets no owner key for them."""
    cluster = make_cluster(nodes=3)
    before = settled_revision(cluster)
    for name in ("a" * 300, "-leading-dash"):
        url = f"{cluster.url('n1')}/api/v1/streams/{name}"
        with pytest.raises(urllib.error.HTTPError) as got:
            http(url)
        assert got.value.code == 404
        with pytest.raises(urllib.error.HTTPError) as got:
            http(url, "PUT", b"{}", json_body=True)
        assert got.value.code == 400 and json.loads(got.value.read())["code"] == "invalid_name"
    assert store_revision(cluster) == before


def settled_revision(cluster: LocalCluster, quiet_s: float = 1.0, timeout_s: float = 30.0) -> int:
    """The store's revision once the fleet's start-up writes are over (a node's fleet poll
    may note a peer that has not registered yet, and clear the note once it has): the same
    over ``quiet_s``."""
    deadline = time.monotonic() + timeout_s
    revision = store_revision(cluster)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = store_revision(cluster)
        if now == revision:
            return now
        revision = now
    raise AssertionError(f"the store kept changing for {timeout_s} s")


def store_revision(cluster: LocalCluster) -> int:
    """etcd's revision: it moves with every write to the store."""
    request = urllib.request.Request(
        cluster.etcd.client_url + "/v3/kv/range",
        data=json.dumps({"key": base64.b64encode(b"/").decode(), "count_only": True}).encode(),
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        return int(json.loads(reply.read())["header"]["revision"])
