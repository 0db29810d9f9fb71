"""A WAL that failed for good (a write error other than a full disk or a transient lack of
descriptors) takes no more adds until a restart: readiness, the state and the metrics say
so, instead of calling the node writable while every add answers 500."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from node.http.app import build_app
from node.storage.journalformat import journal_path
from tests.harness.settings import make_settings

OCTET = {"Content-Type": "application/octet-stream"}
JOURNAL_MAX = 64 * 1024
ENTRY = b"e" * 4096


async def test_a_failed_journal_makes_the_node_not_ready_and_read_only(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    settings = make_settings(
        tmp_path / "data", journal_max_size=JOURNAL_MAX, journal_pre_alloc_size=JOURNAL_MAX
    )
    client = await aiohttp_client(build_app(settings))
    r = await client.post("/api/v1/ledgers")
    ledger_id = (await r.json())["ledgerId"]
    # The next journal's name is taken by a directory: the rotation's exclusive create
    # fails with EEXIST, which no retry mends.
    await asyncio.to_thread((journal_path(settings.journal_dir, 2)).mkdir)
    statuses = []
    for _ in range(2 * JOURNAL_MAX // len(ENTRY)):
        r = await client.post(f"/api/v1/ledgers/{ledger_id}/entries", data=ENTRY, headers=OCTET)
        statuses.append(r.status)
        if r.status == 500:
            assert (await r.json())["code"] == "journal_failed"
            break
    assert statuses[-1] == 500, statuses

    r = await client.get("/api/v1/bookie/is_ready")
    assert r.status == 503
    body = await r.json()
    assert body["code"] == "not_ready" and "restart" in body["message"]
    state = await (await client.get("/api/v1/bookie/state")).json()
    assert state["readOnly"] is True and state["availableForHighPriorityWrites"] is False
    assert (await (await client.get("/api/v1/bookie/state/readonly")).json())["readOnly"]
    metrics = await (await client.get("/metrics")).text()
    assert 'storage_node_state{state="read_only"} 1.0' in metrics
    assert "storage_node_read_only 1.0" in metrics
    # An operator lifting read-only mode does not make the node writable again.
    r = await client.put("/api/v1/bookie/state/readonly", json={"readOnly": False})
    assert (await r.json())["readOnly"] is True
    # Reads go on.
    r = await client.get(f"/api/v1/ledgers/{ledger_id}/entries/0")
    assert r.status == 200 and await r.read() == ENTRY
