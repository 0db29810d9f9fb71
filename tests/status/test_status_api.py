"""The status page's routes in process (blockbuster watching the event loop): the page and its
assets with their policy, the JSON routes against their models, the history sampled as the
application runs, the entry-log map naming a cursor that holds a log."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from node.http import models
from node.http.app import build_app
from tests.harness.settings import make_settings

OCTET = {"Content-Type": "application/octet-stream"}


async def _client(tmp_path: Path, aiohttp_client: Any) -> Any:
    settings = make_settings(
        tmp_path / "d",
        log_size_limit=64 * 1024,
        max_entry_size=16 * 1024,
        flush_interval_ms=50,
        status_history_interval_s=0.05,
    )
    return await aiohttp_client(build_app(settings))


async def test_the_page_and_its_assets_come_from_the_node_with_nothing_from_elsewhere(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    client = await _client(tmp_path, aiohttp_client)
    r = await client.get("/?poll=500", allow_redirects=False)
    assert r.status == 302 and r.headers["Location"] == "/status?poll=500"
    r = await client.get("/status")
    page = await r.text()
    assert r.status == 200 and r.content_type == "text/html"
    assert "default-src 'none'" in r.headers["Content-Security-Policy"]
    assert "http://" not in page and "https://" not in page  # no CDN, no web font
    for asset, kind in (("status.js", "text/javascript"), ("status.css", "text/css")):
        assert f'"/status/{asset}"' in page
        r = await client.get(f"/status/{asset}")
        assert r.status == 200 and r.content_type == kind and len(await r.read()) > 1000
    r = await client.get("/status/..%2fsettings.py")
    assert r.status == 404 and (await r.json())["code"] == "not_found"


async def test_the_json_routes_answer_their_models_and_the_history_fills(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    client = await _client(tmp_path, aiohttp_client)
    ledger = (await (await client.post("/api/v1/ledgers")).json())["ledgerId"]
    for _ in range(5):
        r = await client.post(f"/api/v1/ledgers/{ledger}/entries", data=b"x" * 100, headers=OCTET)
        assert r.status == 201
    await asyncio.sleep(0.3)  # a few history intervals
    summary = models.StatusSummary.model_validate(
        await (await client.get("/api/v1/status/summary")).json()
    )
    assert summary.state == "writable" and summary.counters.adds == 5
    assert summary.wal.kind == "journal" and summary.wal.healthy and summary.wal.groupWrites >= 5
    assert [d.dir for d in summary.disks] == ["journal", "ledgers", "index"]
    history = models.StatusHistory.model_validate(
        await (await client.get("/api/v1/status/history")).json()
    )
    assert history.intervalSeconds == 0.05 and len(history.samples) >= 2
    assert sum(s.addsPerSecond for s in history.samples) > 0
    assert any(s.addP99Seconds is not None for s in history.samples)
    models.StatusEntryLogs.model_validate(
        await (await client.get("/api/v1/status/entrylogs")).json()
    )


async def _lagging_stream(client: Any, wait_s: float, **policies: int) -> models.StatusEntryLogs:
    """Stream "s" (a ledger per 10 entries) with a cursor "lagging" that acknowledges none of
    its 40 entries; the entry-log map ``wait_s`` later."""
    policies = {"minLedgerRolloverTimeMinutes": 0, "maxEntriesPerLedger": 10, **policies}
    assert (await client.put("/api/v1/streams/s", json=policies)).status == 201
    r = await client.put("/api/v1/streams/s/cursors/lagging", json={"start": "earliest"})
    assert r.status == 201
    for _ in range(40):
        r = await client.post("/api/v1/streams/s/entries", data=b"y" * 3000, headers=OCTET)
        assert r.status == 201
    await asyncio.sleep(wait_s)
    return models.StatusEntryLogs.model_validate(
        await (await client.get("/api/v1/status/entrylogs")).json()
    )


async def test_the_map_names_the_cursor_whose_backlog_holds_an_old_log(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    client = await _client(tmp_path, aiohttp_client)
    found = await _lagging_stream(client, 0.3)  # checkpoints: the entries reach sealed logs
    assert len([c for c in found.logs if c.sealed]) >= 1
    oldest = found.oldestPinned[0]
    reasons = {(p.reason, p.stream, p.cursor) for p in oldest.pins}
    assert ("cursor_backlog", "s", "lagging") in reasons
    summary = await (await client.get("/api/v1/status/summary")).json()
    (cursor,) = summary["streams"][0]["cursors"]
    assert cursor["name"] == "lagging" and cursor["backlogEntries"] == 40


async def test_the_map_names_the_message_ttl_that_releases_what_a_cursor_holds(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    """A cursor that never acknowledges holds its ledgers, but the stream's message TTL moves
    it past them at the next retention run: the page names the TTL (and the cursor), and says
    the run deletes them, as the run's dry run does."""
    client = await _client(tmp_path, aiohttp_client)
    # 1.5 s: the closed ledgers are past the TTL, and their entries in sealed logs
    found = await _lagging_stream(client, 1.5, messageTtlInSeconds=1, retentionTimeInMinutes=0)
    pins = [p for log in found.oldestPinned for p in log.pins]
    released = {
        p.ledgerId
        for p in pins
        if (p.reason, p.stream, p.cursor) == ("message_ttl", "s", "lagging")
    }
    assert released, pins
    assert all(
        "the next retention run moves the cursor past it and deletes it" in p.detail
        for p in pins
        if p.ledgerId in released
    )
    dry = await (await client.post("/api/v1/retention/run?dryRun=true")).json()
    assert released <= {d["ledgerId"] for d in dry["streams"]["s"]}
    done = await (await client.post("/api/v1/retention/run")).json()
    assert released <= {d["ledgerId"] for d in done["streams"]["s"]}
