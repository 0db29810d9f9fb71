"""The OpenAPI document names exactly the routes the application serves, and schemathesis
fuzzes the live server against it: no 5xx, no response outside the document."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from node.http.app import build_app
from node.http.openapi import document
from tests.conftest import make_settings
from tests.crash.nodeproc import NodeProcess

METHODS = {"get", "put", "post", "delete", "patch"}


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
        result = subprocess.run(
            [
                str(Path(sys.executable).parent / "schemathesis"),
                "run",
                f"{node.url}/openapi.json",
                "--checks=all",
                # Rules no JSON schema can state (a stream's minimum rollover time below its
                # maximum, a position that must exist in the stream) rightly give 400.
                "--exclude-checks=positive_data_acceptance",
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
