"""Every dashboard query and alert expression, evaluated by a real Prometheus scraping a live
node (raw-device WAL on a file, so the ring's panels have data too) after a small workload
with a forced GC, a retention run and an offload; promtool on the rule file.

The node has a metadata store (a real etcd), as every replicated fleet's nodes do, so the
replication series are its own: registration, and the autorecovery figures it reads from the
store. The workload ends with an autorecovery audit through the node's route, as the DAG runs
it (a clean fleet: nothing under-replicated); the node exports what it then reads back.

The point is the usual failure of hand-written dashboards: queries naming metrics the node
does not export, or that do not parse, found only when someone looks at an empty panel."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from grafana import generate
from node.audit import CHECKS
from tests.client.conftest import etcd
from tests.harness.etcd import EtcdServer
from tests.harness.node import NodeProcess
from tests.monitoring.prometheus import JOB, Prometheus

ALERTS = generate.RULES_FILE
ALERT_TESTS = ALERTS.with_name("storage-node.rules.test.yml")
RUNBOOKS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
METRIC = re.compile(r"\b(storage_node_[a-z0-9_]+|up)\b")
# What Grafana puts in place of the variables; a short rate window, as scrapes come every 1 s.
VARIABLES = {"$instance": ".*", "$__rate_interval": "10s"}
OCTET = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}
MiB = 1024 * 1024
# Alerts on this machine's disk speed, not the node's health: on 2 shared cores a few slow
# syncs of the workload can pass 100 ms at p99. promtool's unit test proves when it fires.
MACHINE_BOUND = {"StorageNodeWalSyncSlow"}
PREFIX = "monitoring"

__all__ = ["etcd"]  # the session's etcd: the node's metadata store


@dataclass
class Stack:
    node: NodeProcess
    prometheus: Prometheus
    exported: set[str]  # sample names of the node's /metrics after the workload


def _call(node: NodeProcess, method: str, path: str, body: bytes | dict[str, Any] = b"") -> Any:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = OCTET if isinstance(body, bytes) and body else JSON
    request = urllib.request.Request(f"{node.url}{path}", data, headers, method=method)
    with urllib.request.urlopen(request, timeout=30) as r:
        text = r.read()
        json_reply = r.headers.get_content_type() == "application/json"
    return json.loads(text) if json_reply else text


def _workload(node: NodeProcess) -> None:
    """Adds past a few entry-log rolls (1 MiB logs), reads, a deleted ledger, a closed one
    offloaded, a stream with a cursor and a retention run, then a forced major GC."""
    kept, doomed = (_call(node, "POST", "/api/v1/ledgers", {})["ledgerId"] for _ in range(2))
    for _ in range(24):  # interleaved: every log holds both ledgers
        for lid in (kept, doomed):
            _call(node, "POST", f"/api/v1/ledgers/{lid}/entries", b"e" * 100_000)
    for eid in range(5):
        _call(node, "GET", f"/api/v1/ledgers/{kept}/entries/{eid}")
    offloaded = _call(node, "POST", "/api/v1/ledgers", {})["ledgerId"]
    _call(node, "POST", f"/api/v1/ledgers/{offloaded}/entries", b"o" * 10_000)
    _call(node, "POST", f"/api/v1/ledgers/{offloaded}/close")
    result = _call(node, "POST", "/api/v1/offload/run", {"ledgers": [offloaded]})
    assert result["offloaded"], result
    _call(node, "GET", f"/api/v1/ledgers/{offloaded}/entries/0")
    # One node: its streams keep one copy (a replicated fleet's default, 3/3/2, needs three)
    one = {"ensemble": 1, "writeQuorum": 1, "ackQuorum": 1}
    _call(node, "PUT", "/api/v1/streams/orders", {"retentionTimeInMinutes": 60, "replication": one})
    _call(node, "PUT", "/api/v1/streams/orders/cursors/billing", {"start": "earliest"})
    for _ in range(3):
        _call(node, "POST", "/api/v1/streams/orders/entries", b"order")
    _call(node, "POST", "/api/v1/retention/run")
    _call(node, "DELETE", f"/api/v1/ledgers/{doomed}")
    _call(node, "PUT", "/api/v1/bookie/gc", {"forceMajor": True})
    deadline = time.monotonic() + 30
    while _call(node, "GET", "/api/v1/bookie/gc")["is_in_force_gc"] == "true":
        assert time.monotonic() < deadline, "the forced GC did not finish in 30 s"
        time.sleep(0.1)
    _call(node, "PUT", "/api/v1/bookie/gc", {})  # GC learns the compaction's outputs
    now_ms = int(time.time() * 1000)
    clean = {check: {"violations": 0, "table": f"{check}.parquet"} for check in CHECKS}
    summary = {
        "version": 1,
        "startedMs": now_ms - 1000,
        "finishedMs": now_ms,
        "auditTimeMs": now_ms,
        "nodes": ["node-0"],
        "status": "clean",
        "checks": clean,
    }
    _call(node, "POST", "/api/v1/audit/result", summary)  # what the audit DAG posts


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, etcd: EtcdServer) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("monitoring")
    prefix = f"{PREFIX}-{uuid.uuid4().hex[:12]}"
    node = NodeProcess(
        work / "data",
        {
            "NODE_WAL_KIND": "blockdev",
            "NODE_WAL_PATH": str(work / "wal.ring"),
            "NODE_WAL_CAPACITY": str(64 * MiB),
            "NODE_METADATA_URL": etcd.url(prefix),
            "NODE_ID": "monitored",
            "NODE_AUTORECOVERY_POLL_S": "1",
        },
    )
    prometheus = Prometheus(work, [f"127.0.0.1:{node.port}"], [ALERTS])
    node.start()
    try:
        prometheus.start()
        try:
            _workload(node)
            report = _call(
                node, "POST", "/api/v1/autorecovery/audit", {"metadataUrl": etcd.url(prefix)}
            )
            assert report["underReplicatedLedgers"] == 0 and report["markers"] == [], report
            # Two scrapes after the workload at least, so rates over 10 s see it.
            prometheus.wait_for(f"storage_node_gc_runs_total{{job='{JOB}'}} >= 2")
            prometheus.wait_for(f"storage_node_registration_up{{job='{JOB}'}} == 1")
            prometheus.wait_for(
                f"storage_node_autorecovery_last_run_timestamp_seconds{{job='{JOB}'}} > 0"
            )
            time.sleep(3)
            for _ in range(3):  # traffic inside the last rate window too
                _call(node, "POST", "/api/v1/streams/orders/entries", b"order")
                time.sleep(1)
            families = text_string_to_metric_families(node.get_bytes("/metrics").decode())
            exported = {sample.name for family in families for sample in family.samples}
            yield Stack(node, prometheus, exported)
        finally:
            prometheus.stop()
    finally:
        if node.alive():
            node.terminate()


def _panels() -> list[tuple[str, str, str, str]]:
    """(dashboard uid, panel title, refId, expr) of every query of every dashboard."""
    found = []
    for make in generate.DASHBOARDS:
        board = generate.build(make())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                found.append((board["uid"], panel["title"], target["refId"], target["expr"]))
    return found


def _alerts() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]


def _substitute(expr: str) -> str:
    for variable, value in VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a variable Grafana would not fill: {expr}"
    return expr


def test_committed_json_and_prometheus_rule_are_the_generators_output() -> None:
    for path, text in generate.files().items():
        assert path.read_text() == text, f"{path} is stale: python -m grafana.generate"


def test_dashboards_have_fixed_uids_variables_and_units() -> None:
    uids = set()
    for make in generate.DASHBOARDS:
        board = json.loads(generate.render(make()))
        assert board["uid"].startswith("storage-node-") and board["uid"] not in uids
        uids.add(board["uid"])
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["instance"]["datasource"]["uid"] == "${datasource}"
        for panel in board["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            for target in panel["targets"]:
                assert 'instance=~"$instance"' in target["expr"], (panel["title"], target)
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= generate.WIDTH, panel["title"]


def test_every_panel_query_parses_names_exported_metrics_and_returns_data(
    stack: Stack,
) -> None:
    empty, failures = [], []
    for uid, title, ref, expr in _panels():
        names = set(METRIC.findall(expr)) - {"up"}  # `up` is Prometheus's own series
        missing = names - stack.exported
        if missing:
            failures.append(f"{uid} / {title} {ref}: not in /metrics: {sorted(missing)}")
        answer = stack.prometheus.query(_substitute(expr))
        if answer["status"] != "success":
            failures.append(f"{uid} / {title} {ref}: {answer.get('error')}")
        elif not answer["data"]["result"]:
            empty.append(f"{uid} / {title} {ref}: {expr}")
    assert not failures, "\n".join(failures)
    # Every subsystem ran (adds, reads, WAL ring, GC, retention, offload, streams): no
    # panel may be empty.
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_every_alert_parses_names_exported_metrics_and_is_quiet_on_a_healthy_node(
    stack: Stack,
) -> None:
    firing = []
    for rule in _alerts():
        names = set(METRIC.findall(rule["expr"])) - {"up"}
        assert names <= stack.exported, (rule["alert"], sorted(names - stack.exported))
        answer = stack.prometheus.query(rule["expr"])
        assert answer["status"] == "success", (rule["alert"], answer)
        if answer["data"]["result"] and rule["alert"] not in MACHINE_BOUND:
            firing.append((rule["alert"], answer["data"]["result"]))
    assert not firing, firing
    # Prometheus loaded the same file and evaluates every rule without error.
    groups = stack.prometheus.api("rules")["data"]["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(loaded) == {r["alert"] for r in _alerts()}
    for name, rule in loaded.items():
        assert rule["health"] in ("ok", "unknown") and not rule.get("lastError"), (name, rule)


def test_every_alert_has_a_runbook_section_in_the_operations_page() -> None:
    headings = {
        re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in RUNBOOKS.read_text().splitlines()
        if line.startswith("#")
    }
    for rule in _alerts():
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"], rule["alert"]
        assert annotations["runbook"] == f"docs/operations.md#{rule['alert'].lower()}"
        assert rule["alert"].lower() in headings, f"docs/operations.md has no {rule['alert']}"


def test_promtool_checks_and_unit_tests_the_rules(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed: make tools"
    check = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run(
        [promtool, "test", "rules", str(ALERT_TESTS)], capture_output=True, text=True, timeout=60
    )
    assert unit.returncode == 0, unit.stdout + unit.stderr
    # The unit tests can fail: a read-only rule that also matched a node shutting down (the
    # read_only gauge is 1 then too) fires on the healthy series beside the read-only one.
    loose = tmp_path / ALERTS.name
    loose.write_text(
        ALERTS.read_text().replace(
            'expr: storage_node_state{state="read_only"} == 1',
            "expr: storage_node_read_only == 1",
        )
    )
    assert loose.read_text() != ALERTS.read_text()
    (tmp_path / ALERT_TESTS.name).write_text(ALERT_TESTS.read_text())
    broken = subprocess.run(
        [promtool, "test", "rules", str(tmp_path / ALERT_TESTS.name)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert broken.returncode != 0 and "StorageNodeReadOnly" in broken.stdout + broken.stderr


def test_node_down_fires_when_the_node_stops(stack: Stack) -> None:
    """Last in the module: it stops the node."""
    (down,) = [r for r in _alerts() if r["alert"] == "StorageNodeDown"]
    assert not stack.prometheus.query(down["expr"])["data"]["result"]
    stack.node.terminate()
    (series,) = stack.prometheus.wait_for(down["expr"])
    assert series["metric"]["instance"] == f"127.0.0.1:{stack.node.port}"
