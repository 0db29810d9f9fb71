"""The OpenAPI document names exactly the routes the application serves, and schemathesis
fuzzes the live server against it with every check: no 5xx, no response outside the
document, and no request valid by the document refused as malformed."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from node.http.app import build_app
from node.http.openapi import document
from tests.harness.node import NodeProcess
from tests.harness.settings import make_settings

METHODS = {"get", "put", "post", "delete", "patch"}
# positive_data_acceptance: what a request valid by the document may get. Schemathesis's
# default (its config/_checks.py) plus 422: the node's answer to a well-formed request that the
# stream's state or a rule between two values refuses (a position not in the stream, a
# minimum rollover time above the maximum, a range from after its to), which no JSON schema
# can state. 400 stays out: it means the request breaks a schema of the document.
ACCEPTED_STATUSES = ["2xx", "3xx", "401", "403", "404", "409", "422", "429", "5xx"]


def test_document_and_routes_agree(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "d")
    app = build_app(settings)
    served = {
        (route.method.lower(), route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None and route.method != "HEAD"
    }
    documented = {
        (method, path)
        for path, item in document(settings)["paths"].items()
        for method in item
        if method in METHODS
    }
    assert served == documented


def _request(node: NodeProcess, method: str, path: str, body: bytes | None = None) -> Any:
    request = urllib.request.Request(
        f"{node.url}{path}",
        data=body,
        method=method,
        headers={"Content-Type": "application/octet-stream"},
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.status


def test_schemathesis_finds_no_server_error_and_no_schema_violation(tmp_path: Path) -> None:
    node = NodeProcess(
        tmp_path / "data",
        env={
            "NODE_MAX_REQUEST_SIZE": str(1 << 20),
            "NODE_MAX_ENTRY_SIZE": str(256 << 10),
            "NODE_MAX_LONG_POLL_MS": "50",  # long polls are fuzzed too: keep them short
        },
    )
    node.start()
    try:
        # Something to find: ledger 0 (the documents' example id) with entries.
        assert _request(node, "PUT", "/api/v1/ledgers/0") == 201
        for entry in range(3):
            assert _request(node, "PUT", f"/api/v1/ledgers/0/entries/{entry}", b"x") == 201
        config = tmp_path / "schemathesis.toml"
        statuses = ", ".join(f'"{s}"' for s in ACCEPTED_STATUSES)
        config.write_text(f"[checks.positive_data_acceptance]\nexpected-statuses = [{statuses}]\n")
        result = subprocess.run(
            [
                str(Path(sys.executable).parent / "schemathesis"),
                "--config-file",
                str(config),
                "run",
                f"{node.url}/openapi.json",
                "--checks=all",
                "--max-examples=40",
                # One worker: CPython 3.11's ast.parse is not thread safe, and hypothesis
                # parses lambdas' sources ("AST constructor recursion depth mismatch").
                "--workers=1",
                "--seed=20261122",
                # Switching the node to read-only in the middle would turn every add into 503.
                "--exclude-name=PUT /api/v1/bookie/state/readonly",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
        assert node.alive()
    finally:
        assert node.terminate() == 0
