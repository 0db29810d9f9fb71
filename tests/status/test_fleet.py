"""The fleet view of the status page on a real fleet: etcd and three node processes, a
replicated stream (3/3/2) and a replicated ledger left open, then n2 SIGKILLed. Every live
node's status JSON lists n2 unregistered since the store's first sighting of it (the same time
on every node), the open ledgers and the stream whose ensemble names it with their copies
reachable against the ack quorum, when it will count as lost, and the ledgers at risk at once
(no audit has run). The page in Debian's chromium shows the same with the node down, names the
node by its fleet id, and passes axe-core.

The lost-node delay is the default (600 s): the node stays "unregistered", its re-replication
ten minutes ahead."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.client.sync import SyncClient
from node.localcluster import LocalCluster
from node.settings import Settings
from tests.harness.cluster import cluster_env
from tests.status.browser import DESKTOP, PHONE, SCREENSHOTS, axe_findings, browser

STREAM = "orders"
SHAPE = {"ensemble": 3, "writeQuorum": 3, "ackQuorum": 2}
ENV = {
    "NODE_REGISTRATION_TTL_S": "2",  # the killed node's registration ends within 2 s
    "NODE_AUTORECOVERY_POLL_S": "0.5",
    "NODE_STATUS_FLEET_CACHE_S": "0.5",
}
POLL_MS = 300  # the page's poll period here (?poll=)
LIVE = ("n0", "n1")
DEAD = "n2"
WAIT_S = 20.0

__all__ = ["browser"]  # the fixture


@pytest.fixture(autouse=True)
def no_blocking_io_on_the_loop() -> Iterator[None]:
    """As in test_page.py: the nodes run in their own processes, and Playwright's sync API runs
    an event loop on this thread that the suite's blockbuster check would take for a node's."""
    yield


def _request(url: str, method: str = "GET", body: Any = None, raw: bytes | None = None) -> Any:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    kind = "application/octet-stream" if raw is not None else "application/json"
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": kind})
    with urllib.request.urlopen(request, timeout=10) as reply:
        text = reply.read()
        return json.loads(text) if text else None


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    cluster = LocalCluster(tmp_path_factory.mktemp("fleet"), nodes=3, env=cluster_env(ENV))
    try:
        owner = cluster.url("n0")
        _request(f"{owner}/api/v1/streams/{STREAM}", "PUT", {"replication": SHAPE})
        _request(f"{owner}/api/v1/streams/{STREAM}/entries", "POST", raw=b"first")
        with SyncClient(cluster.metadata_url) as client:
            ledger = client.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
            ledger.add(b"left open")
            killed_ms = int(time.time() * 1000)
            cluster.kill(DEAD)
            yield {"cluster": cluster, "ledger_id": ledger.id, "killed_ms": killed_ms}
    finally:
        cluster.close()


def _summary(cluster: LocalCluster, node_id: str) -> dict[str, Any]:
    summary = _request(f"{cluster.url(node_id)}/api/v1/status/summary")
    assert isinstance(summary, dict)
    return summary


def _dead_seen(cluster: LocalCluster, node_id: str) -> dict[str, Any]:
    """The node's summary once its fleet view has n2 unregistered."""
    deadline = time.monotonic() + WAIT_S
    while True:
        summary = _summary(cluster, node_id)
        nodes = (summary["replication"]["fleet"] or {}).get("nodes") or []
        if any(n["id"] == DEAD and n["state"] == "unregistered" for n in nodes):
            return summary
        assert time.monotonic() < deadline, f"{node_id} did not see {DEAD} unregistered"
        time.sleep(0.1)


def _unregistered_gauge(cluster: LocalCluster, node_id: str) -> float:
    with urllib.request.urlopen(f"{cluster.url(node_id)}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return next(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "storage_node_unregistered_nodes"
    )


def test_every_node_s_json_names_the_killed_node_and_what_depends_on_it(
    fleet: dict[str, Any],
) -> None:
    cluster, ledger_id = fleet["cluster"], fleet["ledger_id"]
    summaries = {node_id: _dead_seen(cluster, node_id) for node_id in LIVE}
    sightings = set()
    for node_id, summary in summaries.items():
        replication = summary["replication"]
        view = replication["fleet"]
        members = {n["id"]: n for n in view["nodes"]}
        assert set(members) == {"n0", "n1", DEAD}, node_id
        assert [members[n]["state"] for n in LIVE] == ["registered", "registered"]
        dead = members[DEAD]
        assert (dead["registered"], dead["cookie"], dead["url"]) == (False, True, None)
        since = dead["unregisteredSinceMs"]
        assert fleet["killed_ms"] <= since <= view["readMs"], (node_id, since)
        sightings.add(since)
        # What will happen and when: the node's setting, at its default.
        delay_s = Settings().lost_node_recovery_delay_s
        assert view["lostNodeDelaySeconds"] == delay_s
        assert dead["lostAtMs"] == since + delay_s * 1000
        # What depends on it now: the open ledger and the stream's, each 2 of 3 reachable.
        assert dead["openLedgerCount"] == len(dead["openLedgers"]) == 2
        by_stream = {d["stream"]: d for d in dead["openLedgers"]}
        assert set(by_stream) == {None, STREAM}
        # A string: replicated ids are past what a JavaScript number holds exactly.
        assert by_stream[None]["ledgerId"] == str(ledger_id) and ledger_id > 2**53
        for dependent in dead["openLedgers"]:
            assert dependent["state"] == "OPEN"
            assert (dependent["reachable"], dependent["ensembleSize"]) == (2, 3)
            assert (dependent["writeQuorum"], dependent["ackQuorum"]) == (3, 2)
        assert dead["streams"] == [STREAM]
        # At risk at once; the auditor has not run, so its counters still say nothing.
        assert (view["atRiskLedgers"], view["atRiskOpenLedgers"]) == (2, 2)
        assert view["unregisteredNodes"] == 1 and view["ledgers"] == 2
        assert replication["lastAuditorRunMs"] is None
        assert replication["underReplicatedLedgers"] == 0 and replication["lostNodes"] == 0
        assert replication["nodeId"] == node_id
        # And for alerts: a dead node is counted by every other node's metrics (at its poll).
        deadline = time.monotonic() + WAIT_S
        while _unregistered_gauge(cluster, node_id) != 1:
            assert time.monotonic() < deadline, f"{node_id}'s metrics never counted {DEAD}"
            time.sleep(0.1)
    # The store's first sighting: the same time on every node.
    assert len(sightings) == 1


def _fleet_page(
    browser: Any, cluster: LocalCluster, viewport: dict[str, int]
) -> tuple[Any, list[str]]:
    """n1's page (neither the stream's owner nor the ledger's writer: the view is the
    store's) once it shows n2 unregistered, and the errors it logs from then on."""
    page = browser.new_context(viewport=viewport, bypass_csp=True).new_page()
    page.set_default_timeout(WAIT_S * 1000)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(f"{cluster.url('n1')}/status?poll={POLL_MS}")
    page.wait_for_selector(f'#fleet-nodes tr[data-node="{DEAD}"][data-state="unregistered"]')
    return page, errors


def test_the_page_shows_the_node_down_its_state_and_what_names_it(
    fleet: dict[str, Any], browser: Any
) -> None:
    cluster, ledger_id = fleet["cluster"], fleet["ledger_id"]
    page, errors = _fleet_page(browser, cluster, DESKTOP)
    view = _dead_seen(cluster, "n1")["replication"]["fleet"]
    dead = next(n for n in view["nodes"] if n["id"] == DEAD)
    row = page.locator(f'#fleet-nodes tr[data-node="{DEAD}"]')
    state = row.locator('[data-field="state"]')
    assert re.fullmatch(r"unregistered since \d\d:\d\d:\d\d", state.inner_text()), (
        state.inner_text()
    )
    assert (
        json.loads(state.locator("time").get_attribute("data-value") or "null")
        == dead["unregisteredSinceMs"]
    )
    depends = row.locator('[data-field="depends"]')
    mine = depends.locator(f'li[data-ledger="{ledger_id}"]')
    assert mine.inner_text() == f"ledger {ledger_id}: 2 of 3 copies reachable, needs 2"
    stream_ledger = next(d["ledgerId"] for d in dead["openLedgers"] if d["stream"] == STREAM)
    assert depends.locator(f'li[data-ledger="{stream_ledger}"]').inner_text() == (
        f"ledger {stream_ledger} (stream {STREAM}): 2 of 3 copies reachable, needs 2"
    )
    assert depends.locator('[data-field="streams"]').inner_text() == f"streams: {STREAM}"
    upcoming = row.locator('[data-field="next"]')
    assert re.fullmatch(
        r"its ledgers re-replicated from \d\d:\d\d unless it returns \(lost-node delay 10 min\)",
        upcoming.inner_text(),
    ), upcoming.inner_text()
    assert (
        json.loads(upcoming.locator("time").get_attribute("data-value") or "null")
        == dead["lostAtMs"]
    )
    for live in LIVE:
        assert page.locator(f'#fleet-nodes tr[data-node="{live}"]').get_attribute("data-state") == (
            "registered"
        )
    # The counters say so at once, before any audit.
    at_risk = page.locator("#fleet-at-risk")
    assert at_risk.inner_text() == "2" and "bad" in (at_risk.get_attribute("class") or "")
    assert page.locator("#fleet-unregistered").inner_text() == "1"
    assert f"name {DEAD}, not registered" in page.locator("#fleet-risk").inner_text()
    # The header names the node as the fleet does; no zone declared: none mentioned.
    assert page.locator("#node-id").inner_text() == "n1"
    assert page.title() == "Storage node n1 status"
    assert page.locator("#replication-zone").is_hidden()
    note = page.locator("#fleet-note").inner_text()
    assert note.startswith("2 of 3 nodes registered;") and "zone" not in note, note
    assert errors == []
    SCREENSHOTS.mkdir(exist_ok=True)
    shot = SCREENSHOTS / "fleet-node-down.png"
    page.locator("#panel-replication").screenshot(path=str(shot))
    print(f"screenshot: {shot}")
    page.context.close()


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_axe_passes_with_the_node_down(
    fleet: dict[str, Any], browser: Any, viewport: dict[str, int]
) -> None:
    page, _errors = _fleet_page(browser, fleet["cluster"], viewport)
    serious, minor, passes = axe_findings(page)
    print("axe: minor findings:", minor or "none")
    assert serious == [] and passes > 20
    page.context.close()
