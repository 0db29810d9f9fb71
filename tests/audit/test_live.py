"""The audit of a live node: a snapshot taken through the HTTP API while the node runs,
audited by the job (clean: exit 0), the job's summary posted back, kept across a restart
and exported as metrics."""

from __future__ import annotations

import asyncio
import io
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from node.audit import CHECKS, FLEET_CHECKS, job, kept, snapshot
from node.http.app import build_app
from node.http.audit import OFFLOAD_SNAPSHOTS
from node.http.state import STORAGE
from tests.audit import world as w
from tests.harness.metrics import scrape

pytestmark = pytest.mark.timeout(600)

SPLIT_BYTES = 16 * 1024  # several tasks per 64 KiB log
LEDGERS = 3
ROUNDS = 4
ENTRIES_PER_ROUND = 5
STREAM_ENTRIES = 7  # two ledgers of the stream (5 per ledger)
# A node without a metadata store: no ledger metadata, so the replicas check does not run.
NODE_CHECKS = {c for c in CHECKS if c not in FLEET_CHECKS}


async def _fill(client: Any, ledgers: list[int], rounds: int) -> None:
    """Entries in every ledger, checkpointed round by round (interleaved in the logs)."""
    storage = client.app[STORAGE]
    for _round in range(rounds):
        for lid in ledgers:
            for _ in range(ENTRIES_PER_ROUND):
                r = await client.post(f"/api/v1/ledgers/{lid}/entries", data=w.payload(lid, 0))
                assert r.status == 201, await r.text()
        await storage.checkpoint()


def _audit(uri: str, out: Path, spark: Any, node_url: str) -> int:
    args = ["--snapshot", uri, "--out", str(out), "--split-bytes", str(SPLIT_BYTES)]
    return job.run(job.build_parser().parse_args([*args, "--post-to", node_url]), spark)


async def test_live_snapshot_audits_clean_and_the_result_survives_a_restart(
    tmp_path: Path, aiohttp_client: Any, spark: Any
) -> None:
    settings = w.settings_for(tmp_path / "data")
    client = await aiohttp_client(build_app(settings))
    assert (await client.get("/api/v1/audit/result")).status == 404
    ledgers = []
    for _ in range(LEDGERS):
        r = await client.post("/api/v1/ledgers")
        ledgers.append((await r.json())["ledgerId"])
    await _fill(client, ledgers, ROUNDS)
    r = await client.post(f"/api/v1/ledgers/{ledgers[0]}/close")
    assert r.status == 200
    await client.app[STORAGE].checkpoint()
    r = await client.post("/api/v1/offload/run", json={"ledgers": [ledgers[0]]})
    assert (await r.json())["offloaded"] == [ledgers[0]]
    r = await client.put(f"/api/v1/streams/{w.STREAM}", json={"maxEntriesPerLedger": 5})
    assert r.status in (200, 201), await r.text()
    r = await client.put(f"/api/v1/streams/{w.STREAM}/cursors/reader", json={"start": "earliest"})
    assert r.status in (200, 201), await r.text()
    for i in range(STREAM_ENTRIES):
        r = await client.post(f"/api/v1/streams/{w.STREAM}/entries", data=w.payload(0, i))
        assert r.status in (200, 201), await r.text()
    await client.app[STORAGE].checkpoint()

    r = await client.post("/api/v1/audit/snapshot")
    assert r.status == 201, await r.text()
    taken = await r.json()
    uri = taken["uri"]
    root = await asyncio.to_thread(settings.audit_snapshots_dir.resolve)
    assert uri.startswith(root.as_uri())
    assert taken["rows"]["locations"] == LEDGERS * ROUNDS * ENTRIES_PER_ROUND + STREAM_ENTRIES
    assert taken["rows"]["cursors"] == 1 and taken["rows"]["streams"] == 1
    # The node goes on writing after the snapshot: the audit reads the logs as it saw them.
    await _fill(client, ledgers[1:], 2)

    out = tmp_path / "out"
    # The job blocks (Spark): off the test's event loop, which serves the node meanwhile.
    # It posts its summary back to the node (--post-to).
    node_url = str(client.make_url("/"))
    assert await asyncio.to_thread(_audit, uri, out, spark, node_url) == job.EXIT_CLEAN
    summary = json.loads(await asyncio.to_thread((out / job.SUMMARY_FILE).read_text))
    assert summary["status"] == "clean" and set(summary["checks"]) == NODE_CHECKS

    r = await client.get("/api/v1/audit/result")
    assert r.status == 200, await r.text()
    stored = await r.json()
    assert stored["summary"] == summary
    metrics = await scrape(client)
    stamp = metrics[("storage_node_audit_last_run_timestamp_seconds", ())]
    assert stamp == summary["finishedMs"] / 1000
    for check in NODE_CHECKS:
        assert metrics[("storage_node_audit_violations", (("check", check),))] == 0

    await client.close()
    client = await aiohttp_client(build_app(settings))
    r = await client.get("/api/v1/audit/result")
    assert r.status == 200 and await r.json() == stored
    metrics = await scrape(client)
    assert metrics[("storage_node_audit_last_run_timestamp_seconds", ())] == stamp


async def test_snapshot_targets_and_summary_checks(tmp_path: Path, aiohttp_client: Any) -> None:
    settings = w.settings_for(tmp_path / "data")
    client = await aiohttp_client(build_app(settings))
    r = await client.post("/api/v1/ledgers")
    lid = (await r.json())["ledgerId"]
    await _fill(client, [lid], 1)

    # offload: the store's audit/ prefix, which offload never counts as its unknown objects
    r = await client.post("/api/v1/audit/snapshot", json={"to": "offload"})
    assert r.status == 201, await r.text()
    uri = (await r.json())["uri"]
    local = await asyncio.to_thread(snapshot.fetch, uri)
    meta = await asyncio.to_thread(kept.read_meta, local)
    assert meta["rows"]["locations"] == ENTRIES_PER_ROUND
    status = await (await client.get("/api/v1/offload/status")).json()
    assert status["unknownObjects"] == []
    # Only the newest audit_snapshots_kept stay, in the store as on the disk.
    for _ in range(settings.audit_snapshots_kept):
        r = await client.post("/api/v1/audit/snapshot", json={"to": "offload"})
        assert r.status == 201, await r.text()
    in_store = settings.offload_dir / OFFLOAD_SNAPSHOTS  # the local store: objects are files
    objects = await asyncio.to_thread(lambda: [p for p in in_store.rglob("*") if p.is_file()])
    names = sorted({p.parent.name for p in objects})
    assert len(names) == settings.audit_snapshots_kept
    assert (await r.json())["uri"].endswith(names[-1])
    assert len(await asyncio.to_thread(kept.list_kept, settings.audit_snapshots_dir)) == len(names)

    inside = await asyncio.to_thread(settings.audit_snapshots_dir.resolve) / "mine"
    r = await client.post("/api/v1/audit/snapshot", json={"to": inside.as_uri()})
    assert r.status == 201 and (await r.json())["uri"] == inside.as_uri()
    r = await client.post("/api/v1/audit/snapshot", json={"to": inside.as_uri()})
    assert r.status == 409 and (await r.json())["code"] == "snapshot_exists"
    outside = (tmp_path / "elsewhere").as_uri()
    r = await client.post("/api/v1/audit/snapshot", json={"to": outside})
    assert r.status == 422 and (await r.json())["code"] == "invalid_target"
    assert not await asyncio.to_thread((tmp_path / "elsewhere").exists)

    lying = {
        "version": 1,
        "startedMs": 1,
        "finishedMs": 2,
        "auditTimeMs": 1,
        "nodes": ["n"],
        "status": "clean",
        "checks": {"crc": {"violations": 3, "table": "/x"}},
    }
    r = await client.post("/api/v1/audit/result", json=lying)
    assert r.status == 422 and (await r.json())["code"] == "invalid_summary"
    r = await client.post("/api/v1/audit/result", json={**lying, "checks": {"nope": {}}})
    assert r.status == 400 and (await r.json())["code"] == "invalid_summary"
    assert (await client.get("/api/v1/audit/result")).status == 404


async def test_a_summary_too_big_from_the_future_or_of_no_check_is_refused(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    """A result is kept in the index, served to anyone and read by the stale-audit alert:
    a body past audit_result_max_bytes (default), a finishedMs beyond the clock skew and
    an audit of no check are refused; nothing of them is kept."""
    client = await aiohttp_client(build_app(w.settings_for(tmp_path / "data")))
    now_ms = time.time_ns() // 1_000_000
    good = {
        "version": 1,
        "startedMs": now_ms - 60_000,
        "finishedMs": now_ms,
        "auditTimeMs": now_ms - 60_000,
        "nodes": ["n"],
        "status": "clean",
        "checks": {"crc": {"violations": 0, "table": "/x"}},
    }
    huge = {**good, "nodes": [f"{i}".ljust(1024, "n") for i in range(2048)]}  # 2 MiB
    body = io.BytesIO(json.dumps(huge).encode())  # aiohttp's client warns of raw big bytes
    headers = {"Content-Type": "application/json"}
    r = await client.post("/api/v1/audit/result", data=body, headers=headers)
    assert r.status == 413 and (await r.json())["code"] == "request_too_large"
    year_5000_ms = int(datetime(5000, 1, 1, tzinfo=UTC).timestamp() * 1000)
    r = await client.post("/api/v1/audit/result", json={**good, "finishedMs": year_5000_ms})
    assert r.status == 422 and (await r.json())["code"] == "invalid_summary"
    r = await client.post("/api/v1/audit/result", json={**good, "checks": {}})
    assert r.status == 400 and (await r.json())["code"] == "invalid_summary"
    assert (await client.get("/api/v1/audit/result")).status == 404

    # Within the skew (a job's clock a minute ahead of the node's) is taken.
    skewed = {**good, "finishedMs": now_ms + 60_000}
    r = await client.post("/api/v1/audit/result", json=skewed)
    assert r.status == 200, await r.text()
    assert (await (await client.get("/api/v1/audit/result")).json())["summary"] == skewed
