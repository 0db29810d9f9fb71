"""A live node's snapshot holds the entry logs it lists (hard links in its directory), so
that GC running between the snapshot and the audit's scan takes nothing from the audit."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from node.audit import job, kept
from node.http.app import build_app
from node.http.state import STORAGE, WORK
from node.storage import entrylog, logformat
from tests.audit import world as w
from tests.audit.test_live import SPLIT_BYTES, _fill
from tests.harness.metrics import scrape

pytestmark = pytest.mark.timeout(600)

LEDGERS = 3
ROUNDS = 12  # a few 64 KiB logs, each holding every ledger


async def test_gc_between_snapshot_and_scan_leaves_the_audit_clean(
    tmp_path: Path, aiohttp_client: Any, spark: Any
) -> None:
    settings = w.settings_for(tmp_path / "data")
    client = await aiohttp_client(build_app(settings))
    ledgers = []
    for _ in range(LEDGERS):
        r = await client.post("/api/v1/ledgers")
        ledgers.append((await r.json())["ledgerId"])
    await _fill(client, ledgers, ROUNDS)

    r = await client.post("/api/v1/audit/snapshot")
    assert r.status == 201, await r.text()
    uri = (await r.json())["uri"]
    directory = Path(uri.removeprefix("file://"))
    meta = await asyncio.to_thread(kept.read_meta, directory)
    snapshot_logs = await asyncio.to_thread(entrylog.list_logs, directory / kept.LOGS_DIR)
    assert meta["ledgersDir"] == str(directory / kept.LOGS_DIR)
    assert len(snapshot_logs) >= 2

    # A third of every log dies: a forced major compaction moves the rest into new logs
    # and deletes the old ones, every one the snapshot's index points into.
    r = await client.delete(f"/api/v1/ledgers/{ledgers[0]}")
    assert r.status == 204, await r.text()
    gc = client.app[WORK].gc
    gc.request(force_major=True)
    await gc.run()
    await asyncio.to_thread(client.app[STORAGE].reap_retired_logs)
    now = await asyncio.to_thread(entrylog.list_logs, settings.ledgers_dir)
    assert set(snapshot_logs) - set(now), "GC deleted none of the snapshot's logs"

    out = tmp_path / "out"
    args = ["--snapshot", uri, "--out", str(out), "--split-bytes", str(SPLIT_BYTES)]
    status = await asyncio.to_thread(lambda: job.run(job.build_parser().parse_args(args), spark))
    summary = json.loads(await asyncio.to_thread((out / job.SUMMARY_FILE).read_text))
    violations = {name: c["violations"] for name, c in summary["checks"].items()}
    assert status == job.EXIT_CLEAN, violations
    assert summary["status"] == "clean"

    # The logs GC deleted are counted where the snapshot keeps them, until it goes.
    gone = set(snapshot_logs) - set(now)
    held = await asyncio.to_thread(_sizes, directory / kept.LOGS_DIR, gone)
    taken = await asyncio.to_thread(
        kept.kept_bytes, settings.audit_snapshots_dir, settings.ledgers_dir
    )
    assert taken >= held > 0
    metrics = await scrape(client)
    assert metrics[("storage_node_audit_snapshot_bytes", ())] == taken


def _sizes(directory: Path, log_ids: set[int]) -> int:
    return sum(logformat.log_path(directory, i).stat().st_size for i in log_ids)
