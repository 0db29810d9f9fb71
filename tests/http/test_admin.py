"""The admin API against BookKeeper's shapes (bookkeeper-server server/http/service/*)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from node.http.app import build_app
from node.http.state import SERVING, STORAGE, WORK
from node.settings import Settings
from node.storage import logformat
from tests.harness.settings import make_settings

OCTET = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}
SMALL_LOG = 16 * 1024  # entry logs roll every few entries
GC_DEADLINE_S = 60.0  # generous: a forced run over a few small logs takes well under a second


async def test_heartbeat_and_readiness(client: Any) -> None:
    r = await client.get("/heartbeat")
    assert r.status == 200 and await r.text() == "OK\n"
    r = await client.get("/api/v1/bookie/is_ready")
    assert r.status == 200 and await r.text() == "OK"
    client.server.app[SERVING].shutting_down = True  # what SIGTERM does first
    r = await client.get("/api/v1/bookie/is_ready")
    assert r.status == 503 and (await r.json())["code"] == "not_ready"
    state = await (await client.get("/api/v1/bookie/state")).json()
    assert state["shuttingDown"] is True and state["running"] is False


async def test_info_and_state_shapes(client: Any) -> None:
    info = await (await client.get("/api/v1/bookie/info")).json()
    assert set(info) == {"freeSpace", "totalSpace"}
    assert (
        all(type(v) is int for v in info.values()) and 0 < info["freeSpace"] <= info["totalSpace"]
    )
    state = await (await client.get("/api/v1/bookie/state")).json()
    assert state == {
        "running": True,
        "readOnly": False,
        "shuttingDown": False,
        "availableForHighPriorityWrites": True,
    }


async def test_read_only_mode_refuses_adds_and_serves_reads(client: Any) -> None:
    r = await client.post("/api/v1/ledgers")
    lid = (await r.json())["ledgerId"]
    await client.post(f"/api/v1/ledgers/{lid}/entries", data=b"before", headers=OCTET)
    assert await (await client.get("/api/v1/bookie/state/readonly")).json() == {"readOnly": False}
    r = await client.put("/api/v1/bookie/state/readonly", json={"readOnly": True})
    assert r.status == 200 and await r.json() == {"readOnly": True}
    state = await (await client.get("/api/v1/bookie/state")).json()
    assert state["readOnly"] is True and state["availableForHighPriorityWrites"] is False
    r = await client.post(f"/api/v1/ledgers/{lid}/entries", data=b"refused", headers=OCTET)
    assert r.status == 503 and (await r.json())["code"] == "read_only"
    assert (await client.post("/api/v1/ledgers")).status == 503
    r = await client.get(f"/api/v1/ledgers/{lid}/entries/0")
    assert await r.read() == b"before"
    assert (await client.post(f"/api/v1/ledgers/{lid}/close")).status == 200  # recovery ops go on
    r = await client.put("/api/v1/bookie/state/readonly", json={"readOnly": False})
    assert await r.json() == {"readOnly": False}
    assert (await client.post("/api/v1/ledgers")).status == 201
    for bad in (b"", b"{}", b'{"readOnly": "yes"}', b"[true]", b"\xff"):
        r = await client.put("/api/v1/bookie/state/readonly", data=bad, headers=JSON)
        code = "invalid_json" if bad == b"\xff" else "invalid_body"
        assert r.status == 400 and (await r.json())["code"] == code


async def test_list_disk_file_and_last_log_mark(client: Any) -> None:
    r = await client.post("/api/v1/ledgers")
    lid = (await r.json())["ledgerId"]
    await client.post(f"/api/v1/ledgers/{lid}/entries", data=b"x", headers=OCTET)
    await client.server.app[STORAGE].checkpoint(force=True)  # an entry log, a lastMark
    listing = await (await client.get("/api/v1/bookie/list_disk_file")).json()
    assert set(listing) == {"journal files", "entrylog files", "index files"}
    journals = listing["journal files"]
    assert journals.endswith("\t") and all(n.endswith(".txn") for n in journals.split("\t")[:-1])
    assert "CURRENT" in listing["index files"].split("\t")
    assert listing["entrylog files"].startswith("1.log\t")
    only = await (await client.get("/api/v1/bookie/list_disk_file?file_type=journal")).json()
    assert only == {"journal files": journals}
    r = await client.get("/api/v1/bookie/list_disk_file?file_type=../../etc")
    assert r.status == 400 and (await r.json())["code"] == "invalid_file_type"
    mark = await (await client.get("/api/v1/bookie/last_log_mark")).json()
    ((key, value),) = mark.items()
    assert key.startswith("LastLogMark: Journal Id - ") and key.endswith(".txn)")
    assert value.startswith("Pos - ") and int(value.removeprefix("Pos - ")) >= 0


async def test_server_config_lists_every_setting(client: Any) -> None:
    config = await (await client.get("/api/v1/config/server_config")).json()
    assert config["http_host"] == "127.0.0.1" and config["journal_max_group_wait_ms"] == 2
    assert config["log_size_limit"] == 1 << 30 and config["admin_token"] is None


async def test_gc_admin_routes(client: Any) -> None:
    r = await client.get("/api/v1/bookie/gc")
    assert await r.json() == {"is_in_force_gc": "false"}
    r = await client.put("/api/v1/bookie/gc")
    assert r.status == 200 and (await r.json()).startswith("Triggered GC on BookieServer")
    r = await client.put("/api/v1/bookie/gc", json={"forceMajor": True, "forceMinor": False})
    assert r.status == 200
    for bad in (b"[1]", b'{"forceMajor": "yes"}', b'{"other": true}', b"{"):
        r = await client.put("/api/v1/bookie/gc", data=bad, headers=JSON)
        code = "invalid_json" if bad == b"{" else "invalid_body"
        assert r.status == 400 and (await r.json())["code"] == code
    (details,) = await (await client.get("/api/v1/bookie/gc_details")).json()
    for name in ("forceCompacting", "majorCompacting", "minorCompacting"):
        assert type(details[name]) is bool
    for name in (
        "lastMajorCompactionTime",
        "lastMinorCompactionTime",
        "majorCompactionCounter",
        "minorCompactionCounter",
        "spaceCompactionCounter",
        "compactingBytesDone",
        "compactingBytesLeft",
    ):
        assert type(details[name]) is int
    assert details["lastErrors"] == {} and details["unreadableLogs"] == []
    suspended = "/api/v1/bookie/gc/suspend_compaction"
    assert await (await client.get(suspended)).json() == {
        "isMajorGcSuspended": "false",
        "isMinorGcSuspended": "false",
    }
    r = await client.put(suspended, json={"suspendMajor": True})
    assert (await r.json())["isMajorGcSuspended"] == "true"
    assert (await client.put(suspended, json={})).status == 400
    r = await client.put("/api/v1/bookie/gc/resume_compaction", json={"resumeMajor": True})
    assert (await r.json())["isMajorGcSuspended"] == "false"


async def _entry_logs(client: Any) -> set[int]:
    listing = await (await client.get("/api/v1/bookie/list_disk_file?file_type=entrylog")).json()
    names = listing["entrylog files"].split("\t")[:-1]
    return {int(name.removesuffix(logformat.SUFFIX), 16) for name in names}


async def test_forced_gc_right_after_deletes_reclaims_their_logs(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    # The default checkpoint interval: the deletions are not durable when GC is asked for,
    # so only a GC that makes them durable itself can give their logs back in this run.
    settings = make_settings(
        tmp_path / "data", log_size_limit=SMALL_LOG, max_entry_size=SMALL_LOG // 4
    )
    assert settings.flush_interval_ms == Settings.model_fields["flush_interval_ms"].default
    client = await aiohttp_client(build_app(settings))
    storage = client.server.app[STORAGE]
    payload = bytes(SMALL_LOG // 8)
    doomed, kept = [(await storage.create_ledger())[0].ledger_id for _ in range(2)]
    await storage.add_entries(doomed, [payload] * 40)
    await storage.checkpoint()  # several sealed logs of the doomed ledger only
    doomed_logs = await _entry_logs(client)
    await storage.add_entries(kept, [payload] * 40)
    await storage.checkpoint()
    kept_logs = await _entry_logs(client) - doomed_logs
    assert (await client.delete(f"/api/v1/ledgers/{doomed}")).status == 204
    gc = client.server.app[WORK].gc
    assert (await client.put("/api/v1/bookie/gc")).status == 200
    deadline = time.monotonic() + GC_DEADLINE_S
    while (await (await client.get("/api/v1/bookie/gc")).json())["is_in_force_gc"] == "true":
        assert time.monotonic() < deadline, "the forced GC run never ended"
        await asyncio.sleep(0.05)
    left = await _entry_logs(client)
    # All of the doomed ledger's logs but the one it may share with the kept ledger.
    assert len(doomed_logs - left) >= len(doomed_logs) - 1 >= 2, (doomed_logs, left)
    assert kept_logs <= left
    assert gc.stats.deleted_ledgers == 1 and gc.stats.reclaimed_by_deletion_bytes > 0
    r = await client.get(f"/api/v1/ledgers/{kept}/entries/39")
    assert r.status == 200 and await r.read() == payload
