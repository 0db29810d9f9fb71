"""The autorecovery figures of a node with a metadata store: a real node process reads
``autorecovery/auditor``, ``autorecovery/totals`` and ``nodes/`` from a real etcd (the keys
written here directly, as the auditor and the workers write them) every autorecovery_poll_s,
and shows them in /metrics and in the status JSON. Absent keys and fields keep what was
there; a value that does not decode and a store that does not answer count an error and keep
the last values."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from node.autorecovery.markers import AUDITOR_KEY, TOTALS_KEY
from node.settings import Settings
from tests.harness.etcd import EtcdServer, store_write
from tests.harness.node import NodeProcess
from tests.replication._identity import fresh_prefix, replicated_node

POLL = {"NODE_AUTORECOVERY_POLL_S": "0.2", "NODE_METADATA_TIMEOUT_S": "1"}


def metrics(node: NodeProcess) -> dict[str, tuple[str, float]]:
    """Sample name -> (family type, value) of the node's unlabelled samples."""
    found = {}
    for family in text_string_to_metric_families(node.get_bytes("/metrics").decode()):
        for sample in family.samples:
            if not sample.labels:
                found[sample.name] = (family.type, sample.value)
    return found


def replication(node: NodeProcess) -> dict[str, Any]:
    block = node.get_json("/api/v1/status/summary")["replication"]
    assert isinstance(block, dict)
    return block


def wait(check: Callable[[], bool], what: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)


def test_the_poll_defaults_to_30_s() -> None:
    assert Settings().autorecovery_poll_s == 30


def test_figures_follow_the_store_and_survive_bad_values(tmp_path: Path, etcd: EtcdServer) -> None:
    prefix = fresh_prefix()
    node = replicated_node(tmp_path / "n1", etcd, prefix, "n1", NODE_ZONE="zone-a", **POLL)
    node.start()
    wait(lambda: replication(node)["lastAutorecoveryPollMs"] is not None, "a first poll")
    wait(lambda: replication(node)["nodes"], "nodes/n1 read back")
    # No audit yet: zeros, and no last-run timestamp at all (an alert on its age or absence
    # sees an auditor that never ran).
    before = metrics(node)
    for name in ("under_replicated_ledgers", "under_replicated_fragments", "lost_nodes"):
        assert before[f"storage_node_{name}"] == ("gauge", 0), name
    for name in ("fragments", "entries", "bytes"):
        assert before[f"storage_node_rereplicated_{name}_total"] == ("counter", 0), name
    assert "storage_node_autorecovery_last_run_timestamp_seconds" not in before
    block = replication(node)
    assert block["lastAuditorRunMs"] is None and block["underReplicatedLedgers"] == 0
    assert block["nodes"] == [{"id": "n1", "zone": "zone-a", "state": "writable", "url": node.url}]

    finished_ms = int(time.time() * 1000) - 5000
    report = {
        "version": 1,
        "finishedMs": finished_ms,
        "underReplicatedLedgers": 3,
        "underReplicatedFragments": 5,
        "lostNodes": ["n7", "n9"],  # a list or a count: both read as a count
        "decommissioningNodes": 1,
        "checkedLedgers": 12,
    }
    store_write(etcd, prefix, AUDITOR_KEY, report)
    store_write(
        etcd, prefix, TOTALS_KEY, {"version": 1, "fragments": 4, "entries": 40, "bytes": 4000}
    )
    wait(lambda: metrics(node)["storage_node_under_replicated_ledgers"][1] == 3, "the report")
    wait(lambda: metrics(node)["storage_node_rereplicated_bytes_total"][1] == 4000, "the totals")
    after = metrics(node)
    assert after["storage_node_under_replicated_fragments"] == ("gauge", 5)
    assert after["storage_node_lost_nodes"] == ("gauge", 2)
    assert after["storage_node_autorecovery_last_run_timestamp_seconds"] == (
        "gauge",
        finished_ms / 1000,
    )
    assert after["storage_node_rereplicated_fragments_total"] == ("counter", 4)
    assert after["storage_node_rereplicated_entries_total"] == ("counter", 40)
    block = replication(node)
    assert (block["underReplicatedLedgers"], block["underReplicatedFragments"]) == (3, 5)
    assert (block["lostNodes"], block["decommissioningNodes"]) == (2, 1)
    # Listed ids are kept (sorted); a count gives none.
    assert block["lostNodeIds"] == ["n7", "n9"] and block["decommissioningNodeIds"] is None
    assert block["lastAuditorRunMs"] == finished_ms
    assert (block["rereplicatedFragments"], block["rereplicatedEntries"]) == (4, 40)
    assert block["rereplicatedBytes"] == 4000 and block["autorecoveryPollErrors"] == 0

    # A report without some fields (another version): those figures keep their values.
    later_ms = finished_ms + 1000
    store_write(etcd, prefix, AUDITOR_KEY, {"finishedMs": later_ms, "underReplicatedLedgers": 0})
    wait(lambda: replication(node)["lastAuditorRunMs"] == later_ms, "the partial report")
    block = replication(node)
    assert block["underReplicatedLedgers"] == 0 and block["underReplicatedFragments"] == 5
    assert block["lostNodes"] == 2 and block["autorecoveryPollErrors"] == 0
    assert block["lostNodeIds"] == ["n7", "n9"]

    # A value that does not decode: an error counted, every figure kept.
    store_write(etcd, prefix, AUDITOR_KEY, b"{not json")
    wait(lambda: replication(node)["autorecoveryPollErrors"] > 0, "the bad value counted")
    block = replication(node)
    assert block["lastAutorecoveryPollError"] and block["lastAuditorRunMs"] == later_ms
    assert block["underReplicatedFragments"] == 5 and block["rereplicatedBytes"] == 4000
    errors = metrics(node)["storage_node_autorecovery_poll_errors_total"]
    assert errors[0] == "counter" and errors[1] >= 1
    store_write(etcd, prefix, AUDITOR_KEY, report)
    wait(lambda: replication(node)["lastAutorecoveryPollError"] is None, "a good read again")
    assert replication(node)["underReplicatedLedgers"] == 3
    node.terminate()


def test_an_unreachable_store_keeps_the_last_figures(tmp_path: Path, own_etcd: EtcdServer) -> None:
    prefix = fresh_prefix()
    node = replicated_node(tmp_path / "n1", own_etcd, prefix, "n1", **POLL)
    node.start()
    store_write(
        own_etcd, prefix, AUDITOR_KEY, {"finishedMs": 1_000_000, "underReplicatedLedgers": 7}
    )
    store_write(own_etcd, prefix, TOTALS_KEY, {"fragments": 1, "entries": 2, "bytes": 3})
    wait(lambda: replication(node)["underReplicatedLedgers"] == 7, "the report")
    wait(lambda: replication(node)["rereplicatedBytes"] == 3, "the totals")
    own_etcd.pause()  # accepts connections, answers nothing: every read times out
    try:
        wait(lambda: replication(node)["autorecoveryPollErrors"] >= 2, "errors while paused")
        block = replication(node)
        assert block["underReplicatedLedgers"] == 7 and block["rereplicatedBytes"] == 3
        assert block["lastAutorecoveryPollError"]
        figures = metrics(node)
        assert figures["storage_node_under_replicated_ledgers"] == ("gauge", 7)
        assert figures["storage_node_autorecovery_last_run_timestamp_seconds"][1] == 1000
        assert figures["storage_node_autorecovery_poll_errors_total"][1] >= 2
    finally:
        own_etcd.resume()
    wait(lambda: replication(node)["lastAutorecoveryPollError"] is None, "reads again")
    node.terminate()


def test_a_node_without_a_store_has_no_autorecovery_figures(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path / "local")
    node.start()
    names = metrics(node)
    assert not [n for n in names if "replicat" in n or "autorecovery" in n or "lost" in n]
    block = replication(node)
    assert block["enabled"] is False
    assert block["underReplicatedLedgers"] is None and block["nodes"] is None
    node.terminate()
