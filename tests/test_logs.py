"""Structured logs: one JSON object per line, tagged with the request's id."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from tests.harness.node import NodeProcess


def test_json_log_lines_carry_the_request_id(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path / "data", env={"NODE_LOG_JSON": "true", "NODE_LOG_LEVEL": "debug"})
    node.start()
    try:
        request = urllib.request.Request(
            f"{node.url}/api/v1/ledgers", method="POST", headers={"X-Request-Id": "trace-42"}
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            assert r.headers["X-Request-Id"] == "trace-42"
        with urllib.request.urlopen(f"{node.url}/heartbeat", timeout=10) as r:
            generated = r.headers["X-Request-Id"]
        assert generated and generated != "trace-42"
    finally:
        assert node.terminate() == 0
    events = [json.loads(line) for line in node.log().splitlines() if line.startswith("{")]
    assert events and all({"ts", "level", "logger", "msg"} <= set(e) for e in events)
    access = [e for e in events if e["logger"] == "node.http.access"]
    create = next(e for e in access if e.get("request_id") == "trace-42")
    assert create["method"] == "POST" and create["status"] == 201 and create["duration_ms"] >= 0
    assert any(e.get("request_id") == generated for e in access)
