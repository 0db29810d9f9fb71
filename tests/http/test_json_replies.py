"""Every JSON reply ends with a newline: the aiohttp routes, their errors,
the fast lane's adds and errors, and the errors made before a request reaches the app, from
a real node process (the fast lane lives in its server)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.node import DEFAULT_SETTINGS, NodeProcess

OCTET = {"Content-Type": "application/octet-stream"}
JSON_HEADERS = {"Content-Type": "application/json"}


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProcess]:
    proc = NodeProcess(tmp_path / "data", env=DEFAULT_SETTINGS)  # adds past the fast lane
    proc.start()
    try:
        yield proc
    finally:
        proc.kill()
        NodeProcess.started.remove(proc)


def _reply(
    node: NodeProcess, method: str, path: str, body: bytes | None, headers: dict[str, str]
) -> tuple[int, bytes]:
    request = urllib.request.Request(f"{node.url}{path}", body, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _assert_one_json_line(body: bytes) -> object:
    assert body.endswith(b"\n"), body[-80:]
    assert body.count(b"\n") == 1, body[:200]
    return json.loads(body)


def test_every_json_reply_is_one_line_ending_with_a_newline(node: NodeProcess) -> None:
    status, body = _reply(node, "POST", "/api/v1/ledgers", b"{}", JSON_HEADERS)
    assert status == 201
    ledger = _assert_one_json_line(body)["ledgerId"]  # type: ignore[index]
    asked = [
        ("POST", f"/api/v1/ledgers/{ledger}/entries", b"small", OCTET, 201),  # fast lane
        ("POST", f"/api/v1/ledgers/{ledger}/entries", b"x" * (5 << 20), OCTET, 201),  # aiohttp
        ("POST", "/api/v1/ledgers/987654/entries", b"x", OCTET, 404),  # fast lane's error
        ("GET", "/api/v1/ledgers/00x", None, {}, 400),
        ("GET", "/api/v1/ledgers", None, {}, 200),
        ("GET", f"/api/v1/ledgers/{ledger}/lac", None, {}, 200),
        ("PUT", "/api/v1/streams/s", b"{}", JSON_HEADERS, 201),
        ("POST", "/api/v1/streams/s/entries", b"e", OCTET, 201),
        ("GET", "/api/v1/streams/s", None, {}, 200),
        ("GET", "/api/v1/streams/nope", None, {}, 404),
        ("GET", "/api/v1/status/summary", None, {}, 200),
        ("GET", "/api/v1/bookie/state", None, {}, 200),
        ("GET", "/openapi.json", None, {}, 200),
        ("GET", "/no/such/route", None, {}, 404),
    ]
    for method, path, body_out, headers, expected in asked:
        status, body = _reply(node, method, path, body_out, headers)
        assert status == expected, (method, path, status, body[:200])
        _assert_one_json_line(body)


def test_an_error_before_the_app_ends_with_a_newline_too(node: NodeProcess) -> None:
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as sock:
        sock.sendall(b"GET /api/v1/ledgers HTTP/1.1\r\nHost: 127.0.0.1\r\nX: " + b"a" * 20000)
        sock.sendall(b"\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b" ")[1].startswith(b"4"), head
    assert _assert_one_json_line(body)["code"] == "bad_request"  # type: ignore[index]
