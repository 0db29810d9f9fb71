"""Kubernetes discovery with the real kubernetes client against a PodList served on loopback:
the client's request (namespace, label selector) and its decoding of the answer run for real."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from tests.airflow.conftest import Airflow

SELECTOR = "app.kubernetes.io/name=storage-node"


def pod(name: str, ip: str, *, ready: bool, phase: str = "Running", **more: Any) -> dict[str, Any]:
    labels = more.pop("labels", {"app.kubernetes.io/name": "storage-node"})
    return {
        "metadata": {"name": name, "namespace": "storage", "labels": labels, **more},
        "status": {
            "phase": phase,
            "podIP": ip,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True" if ready else "False"},
            ],
        },
    }


PODS = [
    pod("storage-node-2", "10.0.0.3", ready=True),
    pod("storage-node-0", "10.0.0.1", ready=True),
    pod("storage-node-1", "10.0.0.2", ready=False),  # starting: not Ready yet
    pod("storage-node-3", "10.0.0.4", ready=False, phase="Pending"),
    pod("storage-node-4", "10.0.0.5", ready=True, deletionTimestamp="2025-01-01T00:00:00Z"),
    pod("grafana-0", "10.0.0.9", ready=True, labels={"app.kubernetes.io/name": "grafana"}),
]


class ApiServer(BaseHTTPRequestHandler):
    """GET /api/v1/namespaces/{ns}/pods with an equality labelSelector, as the API server."""

    requests: list[str] = []

    def do_GET(self) -> None:
        url = urlparse(self.path)
        ApiServer.requests.append(self.path)
        if url.path != "/api/v1/namespaces/storage/pods":
            self.send_error(404)
            return
        wanted = dict(
            term.split("=", 1)
            for term in parse_qs(url.query).get("labelSelector", [""])[0].split(",")
            if term
        )
        items = [p for p in PODS if wanted.items() <= p["metadata"]["labels"].items()]
        body = json.dumps({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), ApiServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_kubernetes_discovery_finds_the_ready_pods_of_the_selector(
    airflow: Airflow, api_server: str
) -> None:
    config = {
        "kind": "kubernetes",
        "namespace": "storage",
        "labelSelector": SELECTOR,
        "port": 8080,
        "host": api_server,
    }
    urls = airflow.run("discover", json.dumps(config)).result
    assert urls == ["http://10.0.0.1:8080", "http://10.0.0.3:8080"]
    # The selector went to the server (the grafana pod was filtered there, as in a cluster).
    sent = [parse_qs(urlparse(r).query).get("labelSelector") for r in ApiServer.requests]
    assert sent == [[SELECTOR]]
