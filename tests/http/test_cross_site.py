"""Requests that other web sites make a browser send (node/http/crosssite.py): a node run as
shipped (a subprocess, default settings, no admin token), sent what a browser sends for a
page of https://evil.example: a POST with ``Origin`` and ``Content-Type: text/plain`` (no
CORS preflight), or, after DNS rebinding, anything with the page's own name in ``Host``."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from node.http.crosssite import ENTRY_ROUTES, Guard
from node.http.openapi import document
from node.settings import Settings
from tests.harness.node import DEFAULT_SETTINGS, NodeProcess

EVIL = "https://evil.example"
TEXT = "text/plain;charset=UTF-8"  # what fetch() sends with a string body
JSON = "application/json"
OCTET = "application/octet-stream"
ENTRIES = 6
CURSOR = "/api/v1/streams/orders/cursors/billing"
SUMMARY = {
    "version": 1,
    "startedMs": 1,
    "finishedMs": 2,
    "auditTimeMs": 1,
    "nodes": [],
    "status": "clean",
    "checks": {},
}


@dataclass
class Answer:
    status: int
    body: Any
    headers: http.client.HTTPMessage

    @property
    def code(self) -> str | None:
        return self.body.get("code") if isinstance(self.body, dict) else None


def send(
    port: int,
    method: str,
    path: str,
    body: bytes | str | dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    address: str = "127.0.0.1",
) -> Answer:
    """One request on its own connection, with exactly ``headers`` (Host included when
    given: http.client then sends no Host of its own)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    data = data.encode() if isinstance(data, str) else data
    conn = http.client.HTTPConnection(address, port, timeout=30)
    try:
        conn.request(method, path, body=data, headers=headers or {})
        reply = conn.getresponse()
        raw = reply.read()
    finally:
        conn.close()
    try:
        decoded: Any = json.loads(raw)
    except ValueError:
        decoded = raw
    return Answer(reply.status, decoded, reply.headers)


def browser(port: int, kind: str = JSON) -> dict[str, str]:
    """A page of evil.example posting to the node: its Origin, a type needing no preflight."""
    return {"Origin": EVIL, "Content-Type": kind}


def rebound(port: int) -> dict[str, str]:
    """A page of evil.example whose name now resolves to the node: same origin to the
    browser, so any method, and the page reads the answers."""
    return {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}


@dataclass
class Setup:
    node: NodeProcess
    last: str  # the stream's last position
    writer_ledger: int
    fenced_ledger: int
    added_ledger: int  # the one the cross-site adds go to


def _setup(node: NodeProcess) -> Setup:
    """A stream with 6 entries over 3 ledgers and a cursor at the start; three ledgers."""
    port = node.port
    policies = {
        "minLedgerRolloverTimeMinutes": 0,
        "maxEntriesPerLedger": 2,
        "retentionTimeInMinutes": 0,
    }
    assert (
        send(port, "PUT", "/api/v1/streams/orders", policies, {"Content-Type": JSON}).status == 201
    )
    last = ""
    for i in range(ENTRIES):
        r = send(
            port, "POST", "/api/v1/streams/orders/entries", b"e%d" % i, {"Content-Type": OCTET}
        )
        assert r.status == 201, r.body
        last = r.body["position"]
    cursor = {"start": "earliest"}
    r = send(port, "PUT", CURSOR, cursor, {"Content-Type": JSON})
    assert r.status == 201, r.body
    for ledger in (100, 101, 102):
        assert send(port, "PUT", f"/api/v1/ledgers/{ledger}").status == 201
    return Setup(node, last, 100, 101, 102)


@pytest.fixture
def shipped(tmp_path: Path) -> Iterator[Setup]:
    node = NodeProcess(tmp_path / "data", env=DEFAULT_SETTINGS)
    node.start()
    try:
        yield _setup(node)
    finally:
        assert node.terminate() == 0


def cross_site_requests(s: Setup) -> list[tuple[str, str, str, Any, dict[str, str]]]:
    """(row, method, path, body, headers): what a hostile page sends, in this order."""
    port = s.node.port
    ack = json.dumps({"position": s.last})
    return [
        ("cursor ack", "POST", f"{CURSOR}/ack", ack, browser(port, TEXT)),
        ("retention run", "POST", "/api/v1/retention/run", "", browser(port, TEXT)),
        ("fence", "POST", f"/api/v1/ledgers/{s.fenced_ledger}/fence", "", browser(port, TEXT)),
        ("close", "POST", f"/api/v1/ledgers/{s.writer_ledger}/close", "", browser(port, TEXT)),
        ("audit snapshot", "POST", "/api/v1/audit/snapshot", "{}", browser(port, TEXT)),
        ("audit result", "POST", "/api/v1/audit/result", json.dumps(SUMMARY), browser(port, TEXT)),
        ("offload run", "POST", "/api/v1/offload/run", "{}", browser(port, TEXT)),
        # A Blob body has no type at all: an add, answered by the fast lane.
        (
            "add (fast lane)",
            "POST",
            f"/api/v1/ledgers/{s.added_ledger}/entries",
            "x",
            {"Origin": EVIL},
        ),
        ("stream add", "POST", "/api/v1/streams/orders/entries", "x", {"Origin": EVIL}),
        ("rebinding: read settings", "GET", "/api/v1/config/server_config", None, rebound(port)),
        (
            "rebinding: add (fast lane)",
            "POST",
            f"/api/v1/ledgers/{s.added_ledger}/entries",
            "x",
            {"Host": f"evil.example:{port}", "Content-Type": OCTET},
        ),
        (
            "rebinding: delete ledger",
            "DELETE",
            f"/api/v1/ledgers/{s.fenced_ledger}",
            None,
            rebound(port),
        ),
        (
            "rebinding: read-only",
            "PUT",
            "/api/v1/bookie/state/readonly",
            '{"readOnly": true}',
            {**rebound(port), "Content-Type": JSON},
        ),
    ]


def test_requests_of_other_sites_change_nothing(shipped: Setup) -> None:
    port = shipped.node.port
    for row, method, path, body, headers in cross_site_requests(shipped):
        r = send(port, method, path, body, headers)
        expected = "host_not_allowed" if "Host" in headers else "origin_not_allowed"
        assert (r.status, r.code) == (403, expected), (row, r.status, r.body)
    # Retention found nothing acknowledged: the 6 entries are all still there, and the
    # writer adds to its ledger (neither closed nor fenced).
    assert send(port, "GET", CURSOR).body["backlogEntries"] == ENTRIES
    assert send(port, "GET", "/api/v1/streams/orders").body["entries"] == ENTRIES
    r = send(
        port,
        "POST",
        f"/api/v1/ledgers/{shipped.writer_ledger}/entries",
        b"w",
        {"Content-Type": OCTET},
    )
    assert r.status == 201, r.body
    assert send(port, "GET", f"/api/v1/ledgers/{shipped.fenced_ledger}").body["state"] == "open"
    assert send(port, "GET", f"/api/v1/ledgers/{shipped.added_ledger}").body["entries"] == 0
    assert send(port, "GET", "/api/v1/bookie/state/readonly").body == {"readOnly": False}
    assert send(port, "GET", "/api/v1/audit/result").status == 404
    assert shipped.node.alive()


def test_the_nodes_own_pages_and_names_still_work(shipped: Setup) -> None:
    """The status page posts with its own origin; loopback names and the address the client
    connected to are the node's."""
    port = shipped.node.port
    own = {"Origin": f"http://127.0.0.1:{port}", "Content-Type": JSON}
    r = send(port, "POST", "/api/v1/retention/run?dryRun=true", "", own)
    assert r.status == 200, r.body
    for host in (
        f"localhost:{port}",
        f"127.0.0.1:{port}",
        "127.0.0.1",
        f"[::1]:{port}",
        "LOCALHOST.",
    ):
        r = send(port, "GET", "/api/v1/bookie/state", headers={"Host": host})
        assert r.status == 200, (host, r.body)
        r = send(
            port,
            "POST",
            f"/api/v1/ledgers/{shipped.writer_ledger}/entries",
            b"x",
            {"Host": host, "Content-Type": OCTET, "Origin": f"http://{host}"},
        )
        assert r.status == 201, (host, r.body)
    # An address of this machine's that is not loopback: only a node bound to it sees it.
    r = send(port, "GET", "/heartbeat", headers={"Host": f"10.255.255.1:{port}"})
    assert (r.status, r.code) == (403, "host_not_allowed")


def _own_address() -> str:
    """This machine's address on its default route (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))
        address: str = s.getsockname()[0]
    assert not address.startswith("127."), "this machine has no address but loopback"
    return address


def test_a_node_bound_to_every_interface_answers_its_addresses(tmp_path: Path) -> None:
    """As in the pod (0.0.0.0): the kubelet's probes, Prometheus and Airflow use the pod IP."""
    node = NodeProcess(tmp_path / "data", env={**DEFAULT_SETTINGS, "NODE_HTTP_HOST": "0.0.0.0"})
    node.start()
    try:
        address = _own_address()
        for host, via, status in [
            (address, address, 200),
            (socket.gethostname(), "127.0.0.1", 200),
            ("evil.example", address, 403),
        ]:
            headers = {"Host": f"{host}:{node.port}"}
            r = send(node.port, "GET", "/api/v1/bookie/is_ready", headers=headers, address=via)
            assert r.status == status, (host, via, r.body)
    finally:
        assert node.terminate() == 0


def test_json_routes_take_json_only(shipped: Setup) -> None:
    """Without an Origin too (a form of an old browser, a confused client): a JSON body
    sent as another type is refused before anything happens."""
    port = shipped.node.port
    ack = json.dumps({"position": shipped.last})
    path = f"{CURSOR}/ack"
    for kind in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        OCTET,
    ):
        r = send(port, "POST", path, ack, {"Content-Type": kind})
        assert (r.status, r.code) == (415, "unsupported_media_type"), (kind, r.body)
    assert send(port, "GET", CURSOR).body["backlogEntries"] == ENTRIES
    # JSON (with parameters), no body, or a body without a type are accepted.
    assert (
        send(port, "POST", path, ack, {"Content-Type": "application/json; charset=utf-8"}).status
        == 200
    )
    assert send(port, "POST", "/api/v1/retention/run?dryRun=true").status == 200
    assert send(port, "POST", "/api/v1/ledgers", b'{"properties": {"a": "b"}}').status == 201


def test_allowed_hosts_and_origins(tmp_path: Path) -> None:
    env = {
        **DEFAULT_SETTINGS,
        "NODE_ALLOWED_HOSTS": '["storage-node", ".storage-node-headless.ns.svc.cluster.local"]',
        "NODE_ALLOWED_ORIGINS": '["https://console.example"]',
    }
    node = NodeProcess(tmp_path / "data", env=env)
    node.start()
    try:
        port = node.port
        for host in (
            "storage-node:8080",
            "storage-node-0.storage-node-headless.ns.svc.cluster.local",
        ):
            assert send(port, "GET", "/heartbeat", headers={"Host": host}).status == 200, host
        for host in (
            "storage-node.evil.example",
            "evil.storage-node",
            "storage-node-headless.ns.svc.cluster.local.evil",
        ):
            r = send(port, "GET", "/heartbeat", headers={"Host": host})
            assert (r.status, r.code) == (403, "host_not_allowed"), host
        # A page of the allowed origin: the preflight, then the request, with CORS headers.
        console = "https://console.example"
        preflight = {
            "Origin": console,
            "Access-Control-Request-Method": "PUT",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        r = send(port, "OPTIONS", "/api/v1/ledgers/7", headers=preflight)
        assert r.status == 204
        assert r.headers["Access-Control-Allow-Origin"] == console
        assert "PUT" in r.headers["Access-Control-Allow-Methods"]
        assert "Content-Type" in r.headers["Access-Control-Allow-Headers"]
        r = send(port, "PUT", "/api/v1/ledgers/7", headers={"Origin": console})
        assert r.status == 201 and r.headers["Access-Control-Allow-Origin"] == console
        r = send(
            port,
            "POST",
            "/api/v1/ledgers/7/entries",
            b"x",
            {"Origin": console, "Content-Type": OCTET},
        )
        assert r.status == 201 and r.headers["Access-Control-Allow-Origin"] == console
        # Others get no CORS answer, and no state change.
        r = send(port, "OPTIONS", "/api/v1/ledgers/8", headers={**preflight, "Origin": EVIL})
        assert "Access-Control-Allow-Origin" not in r.headers
        r = send(port, "PUT", "/api/v1/ledgers/8", headers={"Origin": EVIL})
        assert (r.status, r.code) == (403, "origin_not_allowed")
    finally:
        assert node.terminate() == 0


def test_entry_routes_are_the_routes_without_a_json_body() -> None:
    """The content type rule's exceptions are the routes whose bodies the OpenAPI document
    says are not JSON."""
    paths = document(Settings())["paths"]
    binary = {
        path
        for path, item in paths.items()
        for operation in item.values()
        if isinstance(operation, dict)
        and "requestBody" in operation
        and JSON not in operation["requestBody"]["content"]
    }
    assert binary == ENTRY_ROUTES


@pytest.mark.parametrize(
    ("header", "own"),
    [
        ("127.0.0.1:80", True),
        ("127.5.5.5", True),
        ("[::1]:8080", True),
        ("[::ffff:127.0.0.1]:8080", True),
        ("localhost", True),
        ("Localhost.:1", True),
        ("10.1.2.3:8080", True),  # the address the client connected to
        ("10.1.2.4:8080", False),
        ("evil.example", False),
        ("", False),
        ("localhost.evil.example", False),
        ("127.0.0.1.evil.example", False),
    ],
)
def test_the_hosts_that_are_the_nodes_own(header: str, own: bool) -> None:
    guard = Guard(Settings(http_host="0.0.0.0"))
    assert guard.host_allowed(header, ("10.1.2.3", 8080)) is own


@pytest.mark.parametrize(
    ("bound", "header", "own"),
    [
        ("::1", "[::1]:8080", True),
        ("fd00::7", "[fd00::7]:8080", True),
        ("fd00::7", "[fd00::8]:8080", False),
        ("node-1.example", "node-1.example:8080", True),
        ("node-1.example", "node-2.example:8080", False),
    ],
)
def test_the_bound_host_is_the_nodes_own(bound: str, header: str, own: bool) -> None:
    guard = Guard(Settings(http_host=bound))
    assert guard.host_allowed(header, None) is own
